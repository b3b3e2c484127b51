// Row conversions: dequantize_row dispatches to the active ISA's kernel table;
// quantize_row is the scalar f32 -> f32/f16/bf16/q8_0/q4_0/q4_1/q5_0/q5_1/q8_K
// reference, byte-exact with gguf-py's numpy quantizers (q8_K: ggml's reference).
#include "quant/quant.h"

#include <atomic>

#include <cmath>
#include <cstring>
#include <string>

#include "core/errors.h"
#include "core/half.h"
#include "quant/dequant_impl.h"
#include "quant/blocks.h"
#include "quant/types.h"

namespace dl {

namespace {
using namespace dl::quant;

std::string type_name(uint32_t type) {
  const TypeTraits* t = type_traits(type);
  return t ? std::string(t->name) : "id " + std::to_string(type);
}

void check_blocks(uint32_t type, int64_t n, const char* what) {
  const TypeTraits* t = type_traits(type);
  if (!t) throw UnsupportedModelError(std::string(what) + ": unknown tensor type id " + std::to_string(type));
  if (n < 0 || n % t->block_size != 0)
    throw Error(std::string(what) + ": " + std::to_string(n) + " elements is not a whole number of " + t->name +
                " blocks of " + std::to_string(t->block_size));
}

// float -> half as numpy's astype(float16) does, NaN payloads included
// (dl::f32_to_f16 canonicalizes NaN; numpy keeps the top payload bits).
uint16_t f16_numpy(float f) {
  const uint32_t x = fp32_to_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) {
    uint16_t h = (uint16_t)(0x7c00u | ((x & 0x7fffffu) >> 13));
    if (h == 0x7c00u) ++h;  // keep it a NaN
    return (uint16_t)(((x >> 16) & 0x8000u) | h);
  }
  return f32_to_f16(f);
}

// gguf-py's BF16.quantize_blocks (ggml's fp32_to_bf16): NaN made quiet, then round to nearest even.
uint16_t bf16_round(float f) {
  uint32_t n = fp32_to_bits(f);
  if ((n & 0x7fffffffu) > 0x7f800000u) n = (n & 0xffff0000u) | (64u << 16);
  return (uint16_t)(((uint64_t)n + 0x7fffu + ((n >> 16) & 1u)) >> 16);
}

// numpy's astype(uint8) of a float already known to lie near [0, 2^k): NaN maps to 0.
inline int to_u8(float v) { return v >= 0.0f && v < 256.0f ? (int)v : 0; }
inline int clampi(int v, int lo, int hi) { return v < lo ? lo : (v > hi ? hi : v); }

// gguf-py's np_roundf: round half away from zero, written as it computes it.
inline float roundf_np(float n) {
  const float a = std::fabs(n);
  const float fl = std::floor(a);
  const float b = fl + std::floor(2.0f * (a - fl));
  return n > 0 ? b : (n < 0 ? -b : 0.0f);
}

// gguf-py picks the signed value of the first element of largest magnitude.
inline float signed_absmax(const float* x, int k) {
  float amax = std::fabs(x[0]), max = x[0];
  for (int j = 1; j < k; ++j)
    if (std::fabs(x[j]) > amax) {
      amax = std::fabs(x[j]);
      max = x[j];
    }
  return max;
}

void q8_0_block(const float* x, block_q8_0* y) {
  float amax = 0.0f;
  for (int j = 0; j < QK4; ++j) amax = std::fmax(amax, std::fabs(x[j]));
  const float d = amax / 127.0f;
  const float id = d == 0.0f ? 0.0f : 1.0f / d;
  for (int j = 0; j < QK4; ++j) y->qs[j] = (int8_t)(int)roundf_np(x[j] * id);
  y->d = f32_to_f16(d);
}

void q4_0_block(const float* x, block_q4_0* y) {
  const float d = signed_absmax(x, QK4) / -8.0f;
  const float id = d == 0.0f ? 0.0f : 1.0f / d;
  uint8_t q[QK4];
  for (int j = 0; j < QK4; ++j) q[j] = (uint8_t)clampi(to_u8(std::trunc(x[j] * id + 8.5f)), 0, 15);
  for (int j = 0; j < 16; ++j) y->qs[j] = (uint8_t)(q[j] | q[j + 16] << 4);
  y->d = f32_to_f16(d);
}

void q4_1_block(const float* x, block_q4_1* y) {
  float mn = x[0], mx = x[0];
  for (int j = 1; j < QK4; ++j) {
    mn = std::fmin(mn, x[j]);
    mx = std::fmax(mx, x[j]);
  }
  const float d = (mx - mn) / 15.0f;
  const float id = d == 0.0f ? 0.0f : 1.0f / d;
  uint8_t q[QK4];
  for (int j = 0; j < QK4; ++j) q[j] = (uint8_t)clampi(to_u8(std::trunc((x[j] - mn) * id + 0.5f)), 0, 15);
  for (int j = 0; j < 16; ++j) y->qs[j] = (uint8_t)(q[j] | q[j + 16] << 4);
  y->d = f32_to_f16(d);
  y->m = f32_to_f16(mn);
}

// 5-bit formats: low nibbles packed like q4, bit 4 of element j in bit j of qh.
void pack5(const uint8_t* q, uint8_t* qs, uint8_t* qh) {
  uint32_t h = 0;
  for (int j = 0; j < 16; ++j) qs[j] = (uint8_t)((q[j] & 0xF) | (q[j + 16] << 4));
  for (int j = 0; j < QK4; ++j) h |= (uint32_t)((q[j] >> 4) & 1) << j;
  for (int i = 0; i < 4; ++i) qh[i] = (uint8_t)(h >> (8 * i));
}

void q5_0_block(const float* x, block_q5_0* y) {
  const float d = signed_absmax(x, QK4) / -16.0f;
  const float id = d == 0.0f ? 0.0f : 1.0f / d;
  uint8_t q[QK4];
  for (int j = 0; j < QK4; ++j) q[j] = (uint8_t)clampi(to_u8(std::trunc(x[j] * id + 16.5f)), 0, 31);
  pack5(q, y->qs, y->qh);
  y->d = f32_to_f16(d);
}

void q5_1_block(const float* x, block_q5_1* y) {
  float mn = x[0], mx = x[0];
  for (int j = 1; j < QK4; ++j) {
    mn = std::fmin(mn, x[j]);
    mx = std::fmax(mx, x[j]);
  }
  const float d = (mx - mn) / 31.0f;
  const float id = d == 0.0f ? 0.0f : 1.0f / d;
  uint8_t q[QK4];
  for (int j = 0; j < QK4; ++j) q[j] = (uint8_t)clampi(to_u8(std::trunc((x[j] - mn) * id + 0.5f)), 0, 31);
  pack5(q, y->qs, y->qh);
  y->d = f32_to_f16(d);
  y->m = f32_to_f16(mn);
}

// ggml's nearest_int: adding 1.5*2^23 rounds to nearest even in the mantissa.
inline int nearest_int(float v) {
  const float t = v + 12582912.0f;
  int32_t i;
  std::memcpy(&i, &t, 4);
  return (i & 0x007fffff) - 0x00400000;
}

// ggml's q8_K reference (activations for k-quant dot products): scale -127/max so
// the largest magnitude maps to -127, per-16 sums kept for the min terms.
void q8_K_block(const float* x, block_q8_K* y) {
  float amax = 0.0f, max = 0.0f;
  for (int j = 0; j < QK_K; ++j)
    if (std::fabs(x[j]) > amax) {
      amax = std::fabs(x[j]);
      max = x[j];
    }
  if (amax == 0.0f) {  // ggml leaves bsums untouched here; zero them so the output is defined
    std::memset(y, 0, sizeof(*y));
    return;
  }
  const float iscale = -127.0f / max;
  for (int j = 0; j < QK_K; ++j) {
    const int v = nearest_int(iscale * x[j]);
    y->qs[j] = (int8_t)(v < 127 ? v : 127);
  }
  for (int j = 0; j < QK_K / 16; ++j) {
    int sum = 0;
    for (int i = 0; i < 16; ++i) sum += y->qs[j * 16 + i];
    y->bsums[j] = (int16_t)sum;
  }
  y->d = 1.0f / iscale;
}

template <typename Block, int QK, void (*Encode)(const float*, Block*)>
void rows(const float* x, void* dst, int64_t n) {
  Block* y = static_cast<Block*>(dst);
  for (int64_t i = 0; i < n / QK; ++i) Encode(x + i * QK, y + i);
}
}  // namespace

namespace {
std::atomic<DequantRowFn> g_fast_dequant{nullptr};
}  // namespace

void set_fast_dequantizer(DequantRowFn fn) { g_fast_dequant.store(fn, std::memory_order_release); }

void dequantize_row(uint32_t type, const void* src, float* dst, int64_t n) {
  check_blocks(type, n, "dequantize");
  DequantRowFn fast = g_fast_dequant.load(std::memory_order_acquire);
  if (!(fast ? fast(type, src, dst, n) : quant::dequant_row_impl(type, src, dst, n)))
    throw UnsupportedModelError("no dequantizer for tensor type " + type_name(type));
}

void quantize_row(uint32_t type, const float* src, void* dst, int64_t n) {
  check_blocks(type, n, "quantize");
  switch ((GGMLType)type) {
    case GGMLType::F32: std::memcpy(dst, src, (size_t)n * 4); return;
    case GGMLType::F16:
      for (int64_t i = 0; i < n; ++i) static_cast<uint16_t*>(dst)[i] = f16_numpy(src[i]);
      return;
    case GGMLType::BF16:
      for (int64_t i = 0; i < n; ++i) static_cast<uint16_t*>(dst)[i] = bf16_round(src[i]);
      return;
    case GGMLType::Q8_0: rows<block_q8_0, QK4, q8_0_block>(src, dst, n); return;
    case GGMLType::Q4_0: rows<block_q4_0, QK4, q4_0_block>(src, dst, n); return;
    case GGMLType::Q4_1: rows<block_q4_1, QK4, q4_1_block>(src, dst, n); return;
    case GGMLType::Q5_0: rows<block_q5_0, QK4, q5_0_block>(src, dst, n); return;
    case GGMLType::Q5_1: rows<block_q5_1, QK4, q5_1_block>(src, dst, n); return;
    case GGMLType::Q8_K: rows<block_q8_K, QK_K, q8_K_block>(src, dst, n); return;
    default: throw UnsupportedModelError("no quantizer to tensor type " + type_name(type));
  }
}

size_t split_row_bytes(uint32_t type, int64_t cols) {
  if (cols <= 0 || cols % 32 != 0) return 0;
  const int64_t qs = type == (uint32_t)GGMLType::Q8_0 ? cols : type == (uint32_t)GGMLType::Q4_0 ? cols / 2 : -1;
  if (qs < 0) return 0;
  return (size_t)((qs + cols / 32 * 2 + 15) / 16 * 16);
}

void split_rows(uint32_t type, const uint8_t* src, size_t src_rb, int64_t cols, int64_t rows, uint8_t* dst) {
  const size_t rb = split_row_bytes(type, cols);
  if (rb == 0) throw Error("split_rows: no split layout for type " + type_name(type));
  const int64_t nb = cols / 32, qb = type == (uint32_t)GGMLType::Q8_0 ? 32 : 16, qs_row = nb * qb;
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* s = src + (size_t)r * src_rb;
    uint8_t* d = dst + (size_t)r * rb;
    std::memset(d + qs_row + nb * 2, 0, rb - (size_t)(qs_row + nb * 2));  // the padding
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = s + b * (2 + qb);
      std::memcpy(d + b * qb, blk + 2, (size_t)qb);
      std::memcpy(d + qs_row + b * 2, blk, 2);
    }
  }
}

}  // namespace dl
