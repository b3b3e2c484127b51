// Declarations shared by the per-ISA translation units (cpp/cpu/*_isa.cpp).
// DL_ISA names the namespace each compilation fills; dispatch.cpp knows them all.
#pragma once
#include "cpu/kernels.h"

#define DL_DECLARE_ISA_FILL(ns) \
  namespace dl::cpu::ns {       \
  void fill_table(KernelTable& t); \
  }
DL_DECLARE_ISA_FILL(baseline)
DL_DECLARE_ISA_FILL(avx2)
DL_DECLARE_ISA_FILL(avx512)
DL_DECLARE_ISA_FILL(neon)
DL_DECLARE_ISA_FILL(i8mm)
#undef DL_DECLARE_ISA_FILL
