// Block-format conversions, portable scalar reference: dequantize every
// supported ggml type, quantize f32 to q8_0 / q4_0 / q4_1. Bit-exact with gguf-py.
// The per-ISA copies used on hot paths live in cpp/cpu/dequant_isa.cpp.
#pragma once
#include <cstdint>

namespace dl {

// n must be a whole number of blocks of `type`. Throws dl::UnsupportedModelError
// for a type with no dequantizer, dl::Error for a bad n.
void dequantize_row(uint32_t type, const void* src, float* dst, int64_t n);

// Supported targets: F32, F16, BF16, Q8_0, Q4_0, Q4_1 (and Q8_K for activations).
void quantize_row(uint32_t type, const float* src, void* dst, int64_t n);

}  // namespace dl
