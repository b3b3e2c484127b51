// Block-format conversions of whole rows, bit-exact with gguf-py. Dequantizing runs
// the decoders of quant/dequant_impl.h: compiled here for the baseline, or the
// active ISA's copy once the CPU backend installs it (set_fast_dequantizer; same
// bits, so quant/ depends on no backend). Quantizing is a scalar reference.
#pragma once
#include <cstddef>
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

// The GPU backends' split layout of q8_0 / q4_0 rows: a row's quants (a block's 32 or 16
// bytes, blocks in order), then its f16 scales, padded to 16 bytes, so the quants sit
// aligned. split_row_bytes is 0 for a type or width without one; split_rows writes `rows`
// rows of src (the file's layout, src_rb apart) split_row_bytes apart into dst.
size_t split_row_bytes(uint32_t type, int64_t cols);
void split_rows(uint32_t type, const uint8_t* src, size_t src_rb, int64_t cols, int64_t rows, uint8_t* dst);

}  // namespace dl
