// Block-format conversions of whole rows, bit-exact with gguf-py. Dequantizing runs
// the decoders of quant/dequant_impl.h: compiled here for the baseline, or the
// active ISA's copy once the CPU backend installs it (set_fast_dequantizer; same
// bits, so quant/ depends on no backend). Quantizing is a scalar reference.
#pragma once
#include <cstdint>

namespace dl {

// n must be a whole number of blocks of `type`. Throws dl::UnsupportedModelError
// for a type with no dequantizer, dl::Error for a bad n.
void dequantize_row(uint32_t type, const void* src, float* dst, int64_t n);

// A faster decoder with the same bits (the CPU backend's per-ISA copy); false for an unknown type.
using DequantRowFn = bool (*)(uint32_t type, const void* src, float* dst, int64_t n);
void set_fast_dequantizer(DequantRowFn fn);

// Supported targets: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 (and Q8_K for
// activations). Same errors as dequantize_row.
void quantize_row(uint32_t type, const float* src, void* dst, int64_t n);

}  // namespace dl
