// Block-format conversions of whole rows, bit-exact with gguf-py. Dequantizing runs
// the active ISA's kernel (cpp/cpu/dequant_isa.cpp over quant/dequant_impl.h);
// quantizing is a scalar reference (targets for weights and activations).
#pragma once
#include <cstdint>

namespace dl {

// n must be a whole number of blocks of `type`. Throws dl::UnsupportedModelError
// for a type with no dequantizer, dl::Error for a bad n.
void dequantize_row(uint32_t type, const void* src, float* dst, int64_t n);

// Supported targets: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 (and Q8_K for
// activations). Same errors as dequantize_row.
void quantize_row(uint32_t type, const float* src, void* dst, int64_t n);

}  // namespace dl
