// Kernels defined once per ISA, in namespace dl::cpu::<DL_ISA>. Each *_isa.cpp
// defines some of them; table_isa.cpp puts them in the table.
#pragma once
#include <cstdint>

#ifndef DL_ISA
#error "isa_kernels.h is included only by *_isa.cpp files, compiled with -DDL_ISA=<name>"
#endif

namespace dl::cpu::DL_ISA {

bool dequant_row(uint32_t type, const void* src, float* dst, int64_t n);

}  // namespace dl::cpu::DL_ISA
