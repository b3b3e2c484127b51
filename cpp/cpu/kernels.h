// The CPU kernel table: one instance per compiled ISA, chosen at run time.
// Kernel bodies live in cpp/cpu/*_isa.cpp, compiled once per ISA (see CMakeLists).
#pragma once
#include <cstdint>

#include "core/cpu_features.h"

namespace dl::cpu {

struct KernelTable {
  Isa isa = Isa::baseline;
  // Dequantize n elements (a whole number of blocks) of ggml type `type`.
  // Returns false if the type has no dequantizer.
  bool (*dequant_row)(uint32_t type, const void* src, float* dst, int64_t n) = nullptr;
};

// The table for the active ISA (dl::active_isa()).
const KernelTable& kernels();
const KernelTable& kernels_for(Isa isa);

}  // namespace dl::cpu
