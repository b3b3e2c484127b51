// Per-block decoders of every dequantizable format, as inline functions that the
// per-ISA kernels (cpp/cpu/dequant_isa.cpp) and later matmul kernels compile in.
// The arithmetic mirrors gguf-py's numpy order exactly (float32 products, scale*q
// then -min or +m, no FMA: the build uses -ffp-contract=off), so every ISA is
// bit-identical with gguf-py. Branch-free where it matters so loops vectorize.
#pragma once
#include <cstdint>
#include <cstring>

#include "quant/blocks.h"
#include "quant/types.h"

namespace dl::quant {
// Internal linkage on purpose: this header is compiled once per ISA with
// different flags, and shared inline symbols would let the linker hand an
// AVX-512 body to the baseline table.
namespace {

inline float bits_f32(uint32_t w) {
  float f;
  std::memcpy(&f, &w, 4);
  return f;
}
inline uint32_t f32_bits(float f) {
  uint32_t w;
  std::memcpy(&w, &f, 4);
  return w;
}

// IEEE half -> float, exact; NaN payloads kept (as numpy's conversion does).
// Written with selects so it vectorizes.
inline float h2f(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
  const uint32_t em = h & 0x7fffu;
  const uint32_t normal = (em << 13) + ((127u - 15u) << 23);
  const uint32_t infnan = (em << 13) | 0x7f800000u;
  // Subnormal halves are man * 2^-24: the int converts exactly and the scale is a power of two.
  const uint32_t sub = f32_bits((float)(int32_t)em * 0x1p-24f);
  const uint32_t bits = em >= 0x7c00u ? infnan : (em >= 0x0400u ? normal : sub);
  return bits_f32(bits | sign);
}

inline float bf2f(uint16_t h) { return bits_f32((uint32_t)h << 16); }

// e8m0 exponent to float, halved (the mxfp4 codebook is stored doubled).
inline float e8m0_half(uint8_t x) {
  return bits_f32(x < 2 ? 0x00200000u << x : (uint32_t)(x - 1) << 23);
}

inline void dq_q4_0(const block_q4_0* b, float* y) {
  const float d = h2f(b->d);
  for (int j = 0; j < 16; ++j) {
    y[j] = d * (float)((int)(b->qs[j] & 0xF) - 8);
    y[j + 16] = d * (float)((int)(b->qs[j] >> 4) - 8);
  }
}

inline void dq_q4_1(const block_q4_1* b, float* y) {
  const float d = h2f(b->d), m = h2f(b->m);
  for (int j = 0; j < 16; ++j) {
    y[j] = d * (float)(b->qs[j] & 0xF) + m;
    y[j + 16] = d * (float)(b->qs[j] >> 4) + m;
  }
}

inline void dq_q5_0(const block_q5_0* b, float* y) {
  const float d = h2f(b->d);
  uint32_t qh;
  std::memcpy(&qh, b->qh, 4);  // little-endian bit j is the 5th bit of element j
  for (int j = 0; j < 16; ++j) {
    const int lo = (b->qs[j] & 0xF) | (int)((qh >> j) & 1) << 4;
    const int hi = (b->qs[j] >> 4) | (int)((qh >> (j + 16)) & 1) << 4;
    y[j] = d * (float)(lo - 16);
    y[j + 16] = d * (float)(hi - 16);
  }
}

inline void dq_q5_1(const block_q5_1* b, float* y) {
  const float d = h2f(b->d), m = h2f(b->m);
  uint32_t qh;
  std::memcpy(&qh, b->qh, 4);
  for (int j = 0; j < 16; ++j) {
    const int lo = (b->qs[j] & 0xF) | (int)((qh >> j) & 1) << 4;
    const int hi = (b->qs[j] >> 4) | (int)((qh >> (j + 16)) & 1) << 4;
    y[j] = d * (float)lo + m;
    y[j + 16] = d * (float)hi + m;
  }
}

inline void dq_q8_0(const block_q8_0* b, float* y) {
  const float d = h2f(b->d);
  for (int j = 0; j < 32; ++j) y[j] = (float)b->qs[j] * d;
}

// Element e = h*128 + s*32 + l holds bits 2s..2s+1 of qs[h*32 + l]; 16 sub-blocks of 16.
inline void dq_q2_K(const block_q2_K* b, float* y) {
  const float d = h2f(b->d), dmin = h2f(b->dmin);
  for (int h = 0; h < 2; ++h)
    for (int s = 0; s < 4; ++s)
      for (int half = 0; half < 2; ++half) {
        const int sb = h * 8 + s * 2 + half;
        const float dl = d * (float)(b->scales[sb] & 0xF);
        const float ml = dmin * (float)(b->scales[sb] >> 4);
        float* out = y + sb * 16;
        const uint8_t* q = b->qs + h * 32 + half * 16;
        for (int l = 0; l < 16; ++l) out[l] = dl * (float)((q[l] >> (2 * s)) & 3) - ml;
      }
}

// 6-bit signed scales: low nibbles in scales[0..7] (lo then hi nibble), top 2 bits in scales[8..11].
inline void dq_q3_K(const block_q3_K* b, float* y) {
  const float d = h2f(b->d);
  float dl[16];
  for (int i = 0; i < 16; ++i) {
    const int lo = i < 8 ? (b->scales[i] & 0xF) : (b->scales[i - 8] >> 4);
    const int hi = (b->scales[8 + (i & 3)] >> (2 * (i >> 2))) & 3;
    dl[i] = d * (float)((lo | hi << 4) - 32);
  }
  for (int h = 0; h < 2; ++h)
    for (int s = 0; s < 4; ++s) {
      const int base = h * 128 + s * 32;  // element index; its hmask bit is base/32
      const int bit = base >> 5;
      for (int l = 0; l < 32; ++l) {
        const int ql = (b->qs[h * 32 + l] >> (2 * s)) & 3;
        const int hm = (b->hmask[l] >> bit) & 1;  // a set bit means no -4 offset
        y[base + l] = dl[(base + l) >> 4] * (float)(ql - ((hm ^ 1) << 2));
      }
    }
}

// The 12 scale bytes hold 8 (scale, min) pairs of 6 bits.
inline void k_scale_min(const uint8_t* sc, uint8_t* scale, uint8_t* min) {
  for (int j = 0; j < 4; ++j) {
    scale[j] = sc[j] & 0x3F;
    min[j] = sc[j + 4] & 0x3F;
    scale[j + 4] = (sc[j + 8] & 0xF) | ((sc[j] >> 2) & 0x30);
    min[j + 4] = (sc[j + 8] >> 4) | ((sc[j + 4] >> 2) & 0x30);
  }
}

// Sub-block 2c+s (32 elements) holds nibble s of qs[c*32 + l].
inline void dq_q4_K(const block_q4_K* b, float* y) {
  const float d = h2f(b->d), dmin = h2f(b->dmin);
  uint8_t sc[8], mn[8];
  k_scale_min(b->scales, sc, mn);
  for (int j = 0; j < 8; ++j) {
    const float dl = d * (float)sc[j], ml = dmin * (float)mn[j];
    const uint8_t* q = b->qs + (j >> 1) * 32;
    const int sh = (j & 1) * 4;
    for (int l = 0; l < 32; ++l) y[j * 32 + l] = dl * (float)((q[l] >> sh) & 0xF) - ml;
  }
}

inline void dq_q5_K(const block_q5_K* b, float* y) {
  const float d = h2f(b->d), dmin = h2f(b->dmin);
  uint8_t sc[8], mn[8];
  k_scale_min(b->scales, sc, mn);
  for (int j = 0; j < 8; ++j) {
    const float dl = d * (float)sc[j], ml = dmin * (float)mn[j];
    const uint8_t* q = b->qs + (j >> 1) * 32;
    const int sh = (j & 1) * 4;
    for (int l = 0; l < 32; ++l) {
      const int v = ((q[l] >> sh) & 0xF) | ((b->qh[l] >> j) & 1) << 4;
      y[j * 32 + l] = dl * (float)v - ml;
    }
  }
}

// Element e = h*128 + s*32 + l: low nibble s>>1 of ql[h*64 + (s&1)*32 + l], high 2 bits s of qh[h*32 + l].
inline void dq_q6_K(const block_q6_K* b, float* y) {
  const float d = h2f(b->d);
  float dl[16];
  for (int i = 0; i < 16; ++i) dl[i] = d * (float)b->scales[i];
  for (int h = 0; h < 2; ++h)
    for (int s = 0; s < 4; ++s) {
      const int base = h * 128 + s * 32;
      const uint8_t* ql = b->ql + h * 64 + (s & 1) * 32;
      const uint8_t* qh = b->qh + h * 32;
      const int shl = (s >> 1) * 4;
      for (int l = 0; l < 32; ++l) {
        const int v = (((ql[l] >> shl) & 0xF) | ((qh[l] >> (2 * s)) & 3) << 4) - 32;
        y[base + l] = dl[(base + l) >> 4] * (float)v;
      }
    }
}

inline void dq_q8_K(const block_q8_K* b, float* y) {
  for (int j = 0; j < QK_K; ++j) y[j] = b->d * (float)b->qs[j];
}

inline void dq_mxfp4(const block_mxfp4* b, float* y) {
  const float d = e8m0_half(b->e);
  for (int j = 0; j < 16; ++j) {
    y[j] = d * (float)kvalues_mxfp4[b->qs[j] & 0xF];
    y[j + 16] = d * (float)kvalues_mxfp4[b->qs[j] >> 4];
  }
}

inline void dq_iq4_nl(const block_iq4_nl* b, float* y) {
  const float d = h2f(b->d);
  for (int j = 0; j < 16; ++j) {
    y[j] = d * (float)kvalues_iq4nl[b->qs[j] & 0xF];
    y[j + 16] = d * (float)kvalues_iq4nl[b->qs[j] >> 4];
  }
}

// 8 sub-blocks of 32 with 6-bit scales: low nibble from scales_l, top 2 bits from scales_h.
inline void dq_iq4_xs(const block_iq4_xs* b, float* y) {
  const float d = h2f(b->d);
  for (int i = 0; i < 8; ++i) {
    const int lo = (b->scales_l[i >> 1] >> (4 * (i & 1))) & 0xF;
    const int hi = (b->scales_h >> (2 * i)) & 3;
    const float dl = d * (float)((lo | hi << 4) - 32);
    const uint8_t* q = b->qs + i * 16;
    for (int j = 0; j < 16; ++j) {
      y[i * 32 + j] = dl * (float)kvalues_iq4nl[q[j] & 0xF];
      y[i * 32 + j + 16] = dl * (float)kvalues_iq4nl[q[j] >> 4];
    }
  }
}


// A whole row of n elements (a whole number of blocks); false for a type with no decoder.
template <typename Block, int QK, void (*Decode)(const Block*, float*)>
inline void dq_rows(const void* src, float* dst, int64_t n) {
  const Block* b = static_cast<const Block*>(src);
  const int64_t nb = n / QK;
  for (int64_t i = 0; i < nb; ++i) Decode(b + i, dst + i * QK);
}

inline bool dequant_row_impl(uint32_t type, const void* src, float* dst, int64_t n) {
  switch ((GGMLType)type) {
    case GGMLType::F32: std::memcpy(dst, src, (size_t)n * 4); return true;
    case GGMLType::F16: {
      const uint16_t* s = static_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < n; ++i) dst[i] = h2f(s[i]);
      return true;
    }
    case GGMLType::BF16: {
      const uint16_t* s = static_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < n; ++i) dst[i] = bf2f(s[i]);
      return true;
    }
    case GGMLType::Q4_0: dq_rows<block_q4_0, QK4, dq_q4_0>(src, dst, n); return true;
    case GGMLType::Q4_1: dq_rows<block_q4_1, QK4, dq_q4_1>(src, dst, n); return true;
    case GGMLType::Q5_0: dq_rows<block_q5_0, QK4, dq_q5_0>(src, dst, n); return true;
    case GGMLType::Q5_1: dq_rows<block_q5_1, QK4, dq_q5_1>(src, dst, n); return true;
    case GGMLType::Q8_0: dq_rows<block_q8_0, QK4, dq_q8_0>(src, dst, n); return true;
    case GGMLType::Q2_K: dq_rows<block_q2_K, QK_K, dq_q2_K>(src, dst, n); return true;
    case GGMLType::Q3_K: dq_rows<block_q3_K, QK_K, dq_q3_K>(src, dst, n); return true;
    case GGMLType::Q4_K: dq_rows<block_q4_K, QK_K, dq_q4_K>(src, dst, n); return true;
    case GGMLType::Q5_K: dq_rows<block_q5_K, QK_K, dq_q5_K>(src, dst, n); return true;
    case GGMLType::Q6_K: dq_rows<block_q6_K, QK_K, dq_q6_K>(src, dst, n); return true;
    case GGMLType::Q8_K: dq_rows<block_q8_K, QK_K, dq_q8_K>(src, dst, n); return true;
    case GGMLType::MXFP4: dq_rows<block_mxfp4, QK4, dq_mxfp4>(src, dst, n); return true;
    case GGMLType::IQ4_NL: dq_rows<block_iq4_nl, QK4, dq_iq4_nl>(src, dst, n); return true;
    case GGMLType::IQ4_XS: dq_rows<block_iq4_xs, QK_K, dq_iq4_xs>(src, dst, n); return true;
    default: return false;
  }
}

}  // namespace
}  // namespace dl::quant
