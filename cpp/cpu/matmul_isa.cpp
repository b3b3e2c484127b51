// Matmul kernels per ISA: activation quantizers, weight-row unpackers, tiled integer dot products, dot_f32.
//
// Every quantized weight row is first unpacked (per tile of rows, into a thread-local
// buffer) to unsigned bytes u plus per-group scales, so that
//   32-block family (q4_0 q4_1 q5_0 q5_1 q8_0 iq4_nl mxfp4):  w = dw * u + mw   per block of 32
//   256-block family (q2_K..q6_K, iq4_xs):   w = D * sc[g] * u - M * mn[g]     per group of 16
// with small integer sc/mn. The dot with int8 activations is then one u8 x s8 integer
// product per group (AVX-512 VNNI dpbusd, AVX2 maddubs, scalar), and the offsets become block sums of the
// activations that quantize_act precomputes (A8 "s", K8 "bsums"). An unpacked tile is
// reused by every token, so prefill pays the unpacking once per weight row.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <new>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__ARM_FEATURE_DOTPROD)
#include <arm_neon.h>
#endif

#include "cpu/act_blocks.h"
#include "cpu/isa_kernels.h"
#include "cpu/kernels.h"
#include "quant/dequant_impl.h"
#include "quant/types.h"

namespace dl::cpu::DL_ISA {

namespace {
using namespace dl::quant;

constexpr int kTileRows = 4;

// ---- thread-local scratch (grows, never shrinks; no allocation in steady state) ----------------

struct Scratch {
  uint8_t* p = nullptr;
  size_t n = 0;
  ~Scratch() { std::free(p); }
  uint8_t* get(size_t want) {
    if (want > n) {
      std::free(p);
      n = (want + 4095) / 4096 * 4096;
      p = static_cast<uint8_t*>(std::aligned_alloc(64, n));
      if (!p) {
        n = 0;
        throw std::bad_alloc();
      }
    }
    return p;
  }
};
thread_local Scratch tl_unpack, tl_row;

inline size_t round64(size_t n) { return (n + 63) / 64 * 64; }

// f16 scale -> float: one F16C instruction where we have it (exact, same as h2f).
inline float f16s(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  return h2f(h);
#endif
}

// ---- dot_f32 ------------------------------------------------------------------------------------

float dot_f32_impl(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
  for (; i + 64 <= n; i += 64) {
    s0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), s0);
    s1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), _mm512_loadu_ps(b + i + 16), s1);
    s2 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 32), _mm512_loadu_ps(b + i + 32), s2);
    s3 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 48), _mm512_loadu_ps(b + i + 48), s3);
  }
  for (; i + 16 <= n; i += 16) s0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), s0);
  if (i < n) {
    const __mmask16 m = (__mmask16)((1u << (n - i)) - 1);
    s1 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + i), _mm512_maskz_loadu_ps(m, b + i), s1);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3)));
#elif defined(__AVX2__)
  __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
  for (; i + 32 <= n; i += 32) {
    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
    s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
    s2 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 16), _mm256_loadu_ps(b + i + 16), s2);
    s3 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 24), _mm256_loadu_ps(b + i + 24), s3);
  }
  for (; i + 8 <= n; i += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
  const __m256 s = _mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3));
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  float r = _mm_cvtss_f32(h);
  for (; i < n; ++i) r += a[i] * b[i];
  return r;
#else
  // Eight partial sums: independent chains the compiler can keep in registers.
  float s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) s[j] += a[i + j] * b[i + j];
  float r = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
  for (; i < n; ++i) r += a[i] * b[i];
  return r;
#endif
}

// ---- activation quantization --------------------------------------------------------------------

// One block of n (32 or 256) floats to int8 with scale d (see act_blocks.h for the rule).
// Returns the sum of the quantized values.
inline int quant_block(const float* x, int n, int8_t* q, float* d_out) {
#if defined(__AVX512F__)
  __m512 mx = _mm512_setzero_ps();
  for (int i = 0; i < n; i += 16) mx = _mm512_max_ps(mx, _mm512_abs_ps(_mm512_loadu_ps(x + i)));
  const float amax = _mm512_reduce_max_ps(mx);
  const float d = amax / 127.0f;
  const float id = amax > 0 ? 127.0f / amax : 0.0f;
  *d_out = d;
  const __m512 vid = _mm512_set1_ps(id), lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
  __m512i sum = _mm512_setzero_si512();
  for (int i = 0; i < n; i += 16) {
    // max(v, lo) returns lo for a NaN v (second operand), like the scalar clamp below.
    const __m512 v = _mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(_mm512_loadu_ps(x + i), vid), lo), hi);
    const __m512i iv = _mm512_cvtps_epi32(v);  // round to nearest even (default MXCSR)
    sum = _mm512_add_epi32(sum, iv);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), _mm512_cvtsepi32_epi8(iv));
  }
  return _mm512_reduce_add_epi32(sum);
#else
  float amax = 0.0f;
  for (int i = 0; i < n; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float d = amax / 127.0f;
  const float id = amax > 0 ? 127.0f / amax : 0.0f;
  *d_out = d;
  int sum = 0;
  for (int i = 0; i < n; ++i) {
    float v = x[i] * id;
    if (!(v >= -127.0f)) v = -127.0f;  // NaN too
    if (v > 127.0f) v = 127.0f;
    const int iv = (int)std::nearbyint(v);  // round to nearest even, as np.rint
    sum += iv;
    q[i] = (int8_t)iv;
  }
  return sum;
#endif
}

void quant_act_a8(const float* x, uint8_t* dst, int64_t k) {
  const int64_t kp = act_a8_padded_k(k), nb = kp / 32;
  int8_t* qs = reinterpret_cast<int8_t*>(dst);
  float* d = reinterpret_cast<float*>(dst + kp);
  float* s = d + nb;
  for (int64_t b = 0; b < k / 32; ++b) {
    const int sum = quant_block(x + b * 32, 32, qs + b * 32, d + b);
    s[b] = d[b] * (float)sum;
  }
  for (int64_t b = k / 32; b < nb; ++b) {
    std::memset(qs + b * 32, 0, 32);
    d[b] = 0.0f;
    s[b] = 0.0f;
  }
}

void quant_act_k8(const float* x, uint8_t* dst, int64_t k) {
  block_q8_K* y = reinterpret_cast<block_q8_K*>(dst);
  for (int64_t b = 0; b < k / QK_K; ++b) {
    block_q8_K blk;  // packed struct: fill a local, then copy
    float d;
    quant_block(x + b * QK_K, QK_K, blk.qs, &d);
    blk.d = d;
    for (int g = 0; g < 16; ++g) {
      int s = 0;
      for (int j = 0; j < 16; ++j) s += blk.qs[g * 16 + j];
      blk.bsums[g] = (int16_t)s;
    }
    std::memcpy(y + b, &blk, sizeof(blk));
  }
}

// ---- unpackers: 32-block family ----------------------------------------------------------------
// Per block: u[32] (element order), dw and mw such that w = dw * u + mw.

// 16 bytes of nibbles -> u[0..15] = low nibbles, u[16..31] = high nibbles.
inline void up_nibbles(const uint8_t* qs, uint8_t* u) {
#if defined(__AVX2__)
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i m = _mm_set1_epi8(0x0F);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(u), _mm_and_si128(q, m));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(u + 16), _mm_and_si128(_mm_srli_epi16(q, 4), m));
#else
  for (int j = 0; j < 16; ++j) {
    u[j] = qs[j] & 0xF;
    u[j + 16] = qs[j] >> 4;
  }
#endif
}

inline void up_q4_0(const block_q4_0* b, uint8_t* u, float& dw, float& mw) {
  up_nibbles(b->qs, u);
  dw = f16s(b->d);
  mw = -8.0f * dw;
}
inline void up_q4_1(const block_q4_1* b, uint8_t* u, float& dw, float& mw) {
  up_nibbles(b->qs, u);
  dw = f16s(b->d);
  mw = f16s(b->m);
}
inline void up_q5_bits(const uint8_t* qs, const uint8_t* qh4, uint8_t* u) {
  uint32_t qh;
  std::memcpy(&qh, qh4, 4);
#if defined(__AVX2__)
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i m = _mm_set1_epi8(0x0F);
  const __m256i nib = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), m), _mm_and_si128(q, m));
  // Bit j of qh to byte j: byte j takes qh byte j/8, then tests bit j%8.
  const __m256i bytes = _mm256_shuffle_epi8(
      _mm256_set1_epi32((int)qh),
      _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL, 0x0101010101010101LL, 0));
  const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
  const __m256i hb = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit), _mm256_set1_epi8(0x10));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(u), _mm256_or_si256(nib, hb));
#else
  for (int j = 0; j < 16; ++j) {
    u[j] = (uint8_t)((qs[j] & 0xF) | ((qh >> j) & 1) << 4);
    u[j + 16] = (uint8_t)((qs[j] >> 4) | ((qh >> (j + 16)) & 1) << 4);
  }
#endif
}
inline void up_q5_0(const block_q5_0* b, uint8_t* u, float& dw, float& mw) {
  up_q5_bits(b->qs, b->qh, u);
  dw = f16s(b->d);
  mw = -16.0f * dw;
}
inline void up_q5_1(const block_q5_1* b, uint8_t* u, float& dw, float& mw) {
  up_q5_bits(b->qs, b->qh, u);
  dw = f16s(b->d);
  mw = f16s(b->m);
}
// Signed weights shifted by 128 to unsigned; the -128 * d * sum term undoes it.
inline void up_q8_0(const block_q8_0* b, uint8_t* u, float& dw, float& mw) {
#if defined(__AVX2__)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(u),
                      _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b->qs)), _mm256_set1_epi8(-128)));
#else
  for (int j = 0; j < 32; ++j) u[j] = (uint8_t)b->qs[j] ^ 0x80;
#endif
  dw = f16s(b->d);
  mw = -128.0f * dw;
}
inline void up_iq4_nl(const block_iq4_nl* b, uint8_t* u, float& dw, float& mw) {
  for (int j = 0; j < 16; ++j) {
    u[j] = (uint8_t)(kvalues_iq4nl[b->qs[j] & 0xF] + 128);
    u[j + 16] = (uint8_t)(kvalues_iq4nl[b->qs[j] >> 4] + 128);
  }
  dw = f16s(b->d);
  mw = -128.0f * dw;
}
inline void up_mxfp4(const block_mxfp4* b, uint8_t* u, float& dw, float& mw) {
  for (int j = 0; j < 16; ++j) {
    u[j] = (uint8_t)(kvalues_mxfp4[b->qs[j] & 0xF] + 12);
    u[j + 16] = (uint8_t)(kvalues_mxfp4[b->qs[j] >> 4] + 12);
  }
  dw = e8m0_half(b->e);
  mw = -12.0f * dw;
}

// Unpacked 32-block row: u[kp] | dwx[kp/32 * 8] (dw repeated per 4-byte dot lane) | mw[kp/32].
inline size_t ubytes_a(int64_t kp) { return round64((size_t)kp + (size_t)(kp / 32) * 36); }

template <class Blk, void (*UP)(const Blk*, uint8_t*, float&, float&)>
void unpack_row_a(const void* w, int64_t k, uint8_t* out) {
  const int64_t kp = act_a8_padded_k(k), nb = kp / 32, nbr = k / 32;
  const Blk* blk = static_cast<const Blk*>(w);
  float* dwx = reinterpret_cast<float*>(out + kp);
  float* mw = dwx + nb * 8;
  for (int64_t b = 0; b < nbr; ++b) {
    float dw, m;
    UP(blk + b, out + b * 32, dw, m);
#if defined(__AVX2__)
    _mm256_storeu_ps(dwx + b * 8, _mm256_set1_ps(dw));
#else
    for (int j = 0; j < 8; ++j) dwx[b * 8 + j] = dw;
#endif
    mw[b] = m;
  }
  for (int64_t b = nbr; b < nb; ++b) {
    std::memset(out + b * 32, 0, 32);
    for (int j = 0; j < 8; ++j) dwx[b * 8 + j] = 0.0f;
    mw[b] = 0.0f;
  }
}

// ---- unpackers: 256-block family ---------------------------------------------------------------
// Per super-block: u[256], sc[16] and mn[16] per group of 16, D and M: w = D*sc*u - M*mn.

struct KOut {
  uint8_t* u;
  int32_t sc[16];
  int16_t mn[16];
  float D, M;
};

inline void upk_q2_K(const block_q2_K* b, KOut& o) {
  for (int h = 0; h < 2; ++h)
    for (int s = 0; s < 4; ++s)
      for (int half = 0; half < 2; ++half) {
        const int g = h * 8 + s * 2 + half;
        const uint8_t* q = b->qs + h * 32 + half * 16;
        for (int l = 0; l < 16; ++l) o.u[g * 16 + l] = (q[l] >> (2 * s)) & 3;
      }
  for (int g = 0; g < 16; ++g) {
    o.sc[g] = b->scales[g] & 0xF;
    o.mn[g] = b->scales[g] >> 4;
  }
  o.D = f16s(b->d);
  o.M = f16s(b->dmin);
}

inline void upk_q3_K(const block_q3_K* b, KOut& o) {
  for (int h = 0; h < 2; ++h)
    for (int s = 0; s < 4; ++s) {
      const int base = h * 128 + s * 32, bit = base >> 5;
      for (int l = 0; l < 32; ++l) {
        const int ql = (b->qs[h * 32 + l] >> (2 * s)) & 3;
        const int hm = (b->hmask[l] >> bit) & 1;
        o.u[base + l] = (uint8_t)(ql + 4 * hm);  // q + 4, q = ql - 4 * !hm
      }
    }
  for (int i = 0; i < 16; ++i) {
    const int lo = i < 8 ? (b->scales[i] & 0xF) : (b->scales[i - 8] >> 4);
    const int hi = (b->scales[8 + (i & 3)] >> (2 * (i >> 2))) & 3;
    o.sc[i] = (lo | hi << 4) - 32;
    o.mn[i] = (int16_t)(4 * o.sc[i]);
  }
  o.D = o.M = f16s(b->d);
}

template <bool kFive, class Blk>
inline void upk_q45_K(const Blk* b, const uint8_t* qh, KOut& o) {
  uint8_t sc[8], mn[8];
  k_scale_min(b->scales, sc, mn);
#if defined(__AVX2__)
  if (!kFive) {
    const __m256i m = _mm256_set1_epi8(0x0F);
    for (int c = 0; c < 4; ++c) {
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b->qs + c * 32));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o.u + c * 64), _mm256_and_si256(q, m));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o.u + c * 64 + 32), _mm256_and_si256(_mm256_srli_epi16(q, 4), m));
    }
    for (int j = 0; j < 8; ++j) {
      o.sc[2 * j] = o.sc[2 * j + 1] = sc[j];
      o.mn[2 * j] = o.mn[2 * j + 1] = mn[j];
    }
    o.D = f16s(b->d);
    o.M = f16s(b->dmin);
    return;
  }
#endif
  for (int j = 0; j < 8; ++j) {
    const uint8_t* q = b->qs + (j >> 1) * 32;
    const int sh = (j & 1) * 4;
    for (int l = 0; l < 32; ++l) {
      int v = (q[l] >> sh) & 0xF;
      if (kFive) v |= ((qh[l] >> j) & 1) << 4;
      o.u[j * 32 + l] = (uint8_t)v;
    }
    o.sc[2 * j] = o.sc[2 * j + 1] = sc[j];
    o.mn[2 * j] = o.mn[2 * j + 1] = mn[j];
  }
  o.D = f16s(b->d);
  o.M = f16s(b->dmin);
}
inline void upk_q4_K(const block_q4_K* b, KOut& o) { upk_q45_K<false>(b, nullptr, o); }
inline void upk_q5_K(const block_q5_K* b, KOut& o) { upk_q45_K<true>(b, b->qh, o); }

inline void upk_q6_K(const block_q6_K* b, KOut& o) {
#if defined(__AVX2__)
  const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(0x03);
  for (int h = 0; h < 2; ++h) {
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b->qh + h * 32));
    const __m256i ql0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b->ql + h * 64));
    const __m256i ql1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b->ql + h * 64 + 32));
    const __m256i lo[4] = {_mm256_and_si256(ql0, m4), _mm256_and_si256(ql1, m4),
                           _mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4), _mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4)};
    const __m256i hi[4] = {_mm256_and_si256(qh, m2), _mm256_and_si256(_mm256_srli_epi16(qh, 2), m2),
                           _mm256_and_si256(_mm256_srli_epi16(qh, 4), m2), _mm256_and_si256(_mm256_srli_epi16(qh, 6), m2)};
    for (int s = 0; s < 4; ++s)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o.u + h * 128 + s * 32),
                          _mm256_or_si256(lo[s], _mm256_slli_epi16(hi[s], 4)));
  }
#else
  for (int h = 0; h < 2; ++h)
    for (int s = 0; s < 4; ++s) {
      const uint8_t* ql = b->ql + h * 64 + (s & 1) * 32;
      const uint8_t* qh = b->qh + h * 32;
      const int shl = (s >> 1) * 4;
      for (int l = 0; l < 32; ++l)
        o.u[h * 128 + s * 32 + l] = (uint8_t)(((ql[l] >> shl) & 0xF) | ((qh[l] >> (2 * s)) & 3) << 4);
    }
#endif
  for (int g = 0; g < 16; ++g) {
    o.sc[g] = b->scales[g];
    o.mn[g] = (int16_t)(32 * b->scales[g]);  // u - 32
  }
  o.D = o.M = f16s(b->d);
}

inline void upk_iq4_xs(const block_iq4_xs* b, KOut& o) {
  for (int i = 0; i < 8; ++i) {
    const uint8_t* q = b->qs + i * 16;
    for (int j = 0; j < 16; ++j) {
      o.u[i * 32 + j] = (uint8_t)(kvalues_iq4nl[q[j] & 0xF] + 128);
      o.u[i * 32 + j + 16] = (uint8_t)(kvalues_iq4nl[q[j] >> 4] + 128);
    }
    const int lo = (b->scales_l[i >> 1] >> (4 * (i & 1))) & 0xF;
    const int hi = (b->scales_h >> (2 * i)) & 3;
    const int ls = (lo | hi << 4) - 32;
    o.sc[2 * i] = o.sc[2 * i + 1] = ls;
    o.mn[2 * i] = o.mn[2 * i + 1] = (int16_t)(128 * ls);
  }
  o.D = o.M = f16s(b->d);
}

// Unpacked 256-block row: u[k] | scx[k/4] int32 (group scale per 4-byte dot lane) |
// mn[k/16] int16 | D[k/256] | M[k/256].
inline size_t ubytes_k(int64_t k) { return round64((size_t)k * 2 + (size_t)(k / 16) * 2 + (size_t)(k / 256) * 8); }

template <class Blk, void (*UP)(const Blk*, KOut&)>
void unpack_row_k(const void* w, int64_t k, uint8_t* out) {
  const int64_t nsb = k / QK_K;
  const Blk* blk = static_cast<const Blk*>(w);
  int32_t* scx = reinterpret_cast<int32_t*>(out + k);
  int16_t* mn = reinterpret_cast<int16_t*>(out + 2 * k);
  float* D = reinterpret_cast<float*>(out + 2 * k + (k / 16) * 2);
  float* M = D + nsb;
  KOut o;
  for (int64_t b = 0; b < nsb; ++b) {
    o.u = out + b * QK_K;
    UP(blk + b, o);
    for (int g = 0; g < 16; ++g) {
#if defined(__AVX2__)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(scx + b * 64 + g * 4), _mm_set1_epi32(o.sc[g]));
#else
      for (int j = 0; j < 4; ++j) scx[b * 64 + g * 4 + j] = o.sc[g];
#endif
      mn[b * 16 + g] = o.mn[g];
    }
    D[b] = o.D;
    M[b] = o.M;
  }
}

// ---- tile kernels -------------------------------------------------------------------------------
// R unpacked weight rows x T activation rows -> out[r][t].

#if defined(__ARM_FEATURE_MATMUL_INT8)
// smmla (the 'i8mm' variant): one instruction multiplies two weight rows' 8 bytes (a 2x8 int8
// tile) by two tokens' 8 bytes into a 2x2 int32 tile, so four give a block of 32 for a pair of
// rows and a pair of tokens, and no per-output horizontal sum is needed. R rows go in pairs (an
// odd last row is paired with itself), T is even. The block sums are exact integers, equal to
// the sdot path's, and each output then takes the sdot path's float operations in the same order
// (one lane each), so the two give the same bits: a token decoded alone (sdot) equals itself
// inside a prefill batch (smmla), and this variant equals 'neon' bit for bit.
template <int R, int T, bool Wide>
void tile_a_mmla(const uint8_t* const* U, const uint8_t* const* A, int64_t kp, float (*out)[4]) {
  static_assert(T % 2 == 0, "tokens go in pairs");
  constexpr int RP = (R + 1) / 2, TP = T / 2;
  const int64_t nb = kp / 32;
  // Lanes of a 2x2 tile: (r0, t0) (r0, t1) (r1, t0) (r1, t1).
  float32x4_t acc[RP][TP];
  for (int i = 0; i < RP; ++i)
    for (int j = 0; j < TP; ++j) acc[i][j] = vdupq_n_f32(0.0f);
  const int8x16_t x80 = vdupq_n_s8(-128);
  const int32x4_t zero = vdupq_n_s32(0);
  for (int64_t b = 0; b < nb; ++b) {
    int8x16_t qa[TP][4];  // chunk c: [t0 bytes 8c..8c+7 | t1 bytes 8c..8c+7]
    float32x4_t da[TP], sa[TP];  // [t0, t1, t0, t1]
    for (int j = 0; j < TP; ++j) {
      const int8_t* q0 = reinterpret_cast<const int8_t*>(A[2 * j]) + b * 32;
      const int8_t* q1 = reinterpret_cast<const int8_t*>(A[2 * j + 1]) + b * 32;
      const int64x2_t a0 = vreinterpretq_s64_s8(vld1q_s8(q0)), a1 = vreinterpretq_s64_s8(vld1q_s8(q0 + 16));
      const int64x2_t b0 = vreinterpretq_s64_s8(vld1q_s8(q1)), b1 = vreinterpretq_s64_s8(vld1q_s8(q1 + 16));
      qa[j][0] = vreinterpretq_s8_s64(vzip1q_s64(a0, b0));
      qa[j][1] = vreinterpretq_s8_s64(vzip2q_s64(a0, b0));
      qa[j][2] = vreinterpretq_s8_s64(vzip1q_s64(a1, b1));
      qa[j][3] = vreinterpretq_s8_s64(vzip2q_s64(a1, b1));
      const float* f0 = reinterpret_cast<const float*>(A[2 * j] + kp);
      const float* f1 = reinterpret_cast<const float*>(A[2 * j + 1] + kp);
      const float d2[2] = {f0[b], f1[b]}, s2[2] = {f0[nb + b], f1[nb + b]};
      const float32x2_t dv = vld1_f32(d2), sv = vld1_f32(s2);
      da[j] = vcombine_f32(dv, dv);
      sa[j] = vcombine_f32(sv, sv);
    }
    for (int i = 0; i < RP; ++i) {
      const uint8_t* u0p = U[2 * i] + b * 32;
      const uint8_t* u1p = U[std::min(2 * i + 1, R - 1)] + b * 32;
      int8x16_t u0a = vreinterpretq_s8_u8(vld1q_u8(u0p)), u0b = vreinterpretq_s8_u8(vld1q_u8(u0p + 16));
      int8x16_t u1a = vreinterpretq_s8_u8(vld1q_u8(u1p)), u1b = vreinterpretq_s8_u8(vld1q_u8(u1p + 16));
      if (Wide) {
        u0a = veorq_s8(u0a, x80);
        u0b = veorq_s8(u0b, x80);
        u1a = veorq_s8(u1a, x80);
        u1b = veorq_s8(u1b, x80);
      }
      const int64x2_t p0 = vreinterpretq_s64_s8(u0a), p1 = vreinterpretq_s64_s8(u0b);
      const int64x2_t q0 = vreinterpretq_s64_s8(u1a), q1 = vreinterpretq_s64_s8(u1b);
      const int8x16_t w0 = vreinterpretq_s8_s64(vzip1q_s64(p0, q0)), w1 = vreinterpretq_s8_s64(vzip2q_s64(p0, q0));
      const int8x16_t w2 = vreinterpretq_s8_s64(vzip1q_s64(p1, q1)), w3 = vreinterpretq_s8_s64(vzip2q_s64(p1, q1));
      // Per row: dw and the offset, exactly as the sdot path forms them.
      const float* dx0 = reinterpret_cast<const float*>(U[2 * i] + kp);
      const float* dx1 = reinterpret_cast<const float*>(U[std::min(2 * i + 1, R - 1)] + kp);
      const float dw0 = dx0[b * 8], dw1 = dx1[b * 8];
      const float off0 = Wide ? dx0[nb * 8 + b] + 128.0f * dw0 : dx0[nb * 8 + b];
      const float off1 = Wide ? dx1[nb * 8 + b] + 128.0f * dw1 : dx1[nb * 8 + b];
      const float dw4[4] = {dw0, dw0, dw1, dw1}, off4[4] = {off0, off0, off1, off1};
      const float32x4_t dw = vld1q_f32(dw4), off = vld1q_f32(off4);
      for (int j = 0; j < TP; ++j) {
        int32x4_t s = vmmlaq_s32(zero, w0, qa[j][0]);
        s = vmmlaq_s32(s, w1, qa[j][1]);
        s = vmmlaq_s32(s, w2, qa[j][2]);
        s = vmmlaq_s32(s, w3, qa[j][3]);
        // acc += (float)sum * (dw * da) + off * sa, lane by lane (no fused multiply-add: fp-contract=off).
        acc[i][j] = vaddq_f32(acc[i][j], vaddq_f32(vmulq_f32(vcvtq_f32_s32(s), vmulq_f32(dw, da[j])),
                                                   vmulq_f32(off, sa[j])));
      }
    }
  }
  for (int i = 0; i < RP; ++i)
    for (int j = 0; j < TP; ++j) {
      float v[4];
      vst1q_f32(v, acc[i][j]);
      out[2 * i][2 * j] = v[0];
      out[2 * i][2 * j + 1] = v[1];
      if (2 * i + 1 < R) {
        out[2 * i + 1][2 * j] = v[2];
        out[2 * i + 1][2 * j + 1] = v[3];
      }
    }
}
#endif


// Wide: u spans 0..255 (q8_0, iq4_nl); AVX2's maddubs would saturate, so it uses the sign trick there.
template <int R, int T, bool Wide>
void tile_a(const uint8_t* const* U, const uint8_t* const* A, int64_t kp, float (*out)[4]) {
#if defined(__ARM_FEATURE_MATMUL_INT8)
  if constexpr (T >= 2) {
    tile_a_mmla<R, T & ~1, Wide>(U, A, kp, out);
    if constexpr (T % 2 == 1) {  // the odd token through sdot (the same bits)
      float last[4][4];
      tile_a<R, 1, Wide>(U, A + (T - 1), kp, last);
      for (int r = 0; r < R; ++r) out[r][T - 1] = last[r][0];
    }
    return;
  }
#endif
  const int64_t nb = kp / 32;
#if defined(__AVX512F__)
  __m512 acc[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_ps();
  const __m512i idx = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t c = 0; c < kp / 64; ++c) {
    __m512i qa[T];
    __m512 dax[T];
    for (int t = 0; t < T; ++t) {
      qa[t] = _mm512_loadu_si512(A[t] + c * 64);
      const __m128 d2 = _mm_castsi128_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(A[t] + kp + c * 8)));
      dax[t] = _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(d2));
    }
    for (int r = 0; r < R; ++r) {
      const __m512i u = _mm512_loadu_si512(U[r] + c * 64);
      const __m512 dw = _mm512_loadu_ps(reinterpret_cast<const float*>(U[r] + kp) + c * 16);
      for (int t = 0; t < T; ++t) {
        const __m512i p = _mm512_dpbusd_epi32(zero, u, qa[t]);
        acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(dw, dax[t]), acc[r][t]);
      }
    }
  }
  // Offsets (sum over blocks of mw * s) folded into the same accumulators: one reduction per output.
  for (int64_t i = 0; i < nb; i += 16) {
    const __mmask16 m = nb - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (nb - i)) - 1);
    for (int r = 0; r < R; ++r) {
      const __m512 mw = _mm512_maskz_loadu_ps(m, reinterpret_cast<const float*>(U[r] + kp) + nb * 8 + i);
      for (int t = 0; t < T; ++t)
        acc[r][t] = _mm512_fmadd_ps(mw, _mm512_maskz_loadu_ps(m, reinterpret_cast<const float*>(A[t] + kp) + nb + i),
                                    acc[r][t]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) out[r][t] = _mm512_reduce_add_ps(acc[r][t]);
#elif defined(__AVX2__)
  __m256 acc[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1), x80 = _mm256_set1_epi8(-128);
  for (int64_t b = 0; b < nb; ++b) {
    __m256i qa[T];
    __m256 da[T];
    for (int t = 0; t < T; ++t) {
      qa[t] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(A[t] + b * 32));
      da[t] = _mm256_broadcast_ss(reinterpret_cast<const float*>(A[t] + kp) + b);
    }
    for (int r = 0; r < R; ++r) {
      const __m256i u = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(U[r] + b * 32));
      const __m256 dw = _mm256_broadcast_ss(reinterpret_cast<const float*>(U[r] + kp) + b * 8);
      // Wide: signed w = u - 128, |w| <= 128 keeps maddubs pairs below 2^15; sum w*qa is exact.
      const __m256i ws = Wide ? _mm256_xor_si256(u, x80) : u;
      const __m256i au = Wide ? _mm256_abs_epi8(ws) : u;
      for (int t = 0; t < T; ++t) {
        const __m256i p16 = _mm256_maddubs_epi16(au, Wide ? _mm256_sign_epi8(qa[t], ws) : qa[t]);
        const __m256i p = _mm256_madd_epi16(p16, ones);
        acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(dw, da[t]), acc[r][t]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    const float* dwx = reinterpret_cast<const float*>(U[r] + kp);
    const float* mw = dwx + nb * 8;
    for (int t = 0; t < T; ++t) {
      const float* sa = reinterpret_cast<const float*>(A[t] + kp) + nb;
      const __m256 v = acc[r][t];
      __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
      h = _mm_add_ps(h, _mm_movehl_ps(h, h));
      h = _mm_add_ss(h, _mm_movehdup_ps(h));
      float o = 0.0f;
      // Wide computed sum (u - 128) * qa, so its offset is mw + 128 * dw (exactly 0 for q8_0 / iq4_nl).
      for (int64_t b = 0; b < nb; ++b) o += (Wide ? mw[b] + 128.0f * dwx[b * 8] : mw[b]) * sa[b];
      out[r][t] = _mm_cvtss_f32(h) + o;
    }
  }
#elif defined(__ARM_FEATURE_DOTPROD)
  // sdot: signed bytes, four products per int32 lane. Narrow u (<= 31) is already a valid int8;
  // Wide u is shifted to w = u - 128 as on AVX2, and the offset takes the 128 * dw back.
  // Each block's integer sum and its offset (mw * s) are combined before they join the sum: an
  // activation outlier makes both large and nearly opposite, and adding the offsets at the end
  // instead (baseline, AVX2) loses digits to that cancellation (test_kernels outliers, q4_0: 8.5e-6 of
  // sum |w||x| there, 2.4e-7 here).
  float acc[R][T] = {};
  const int8x16_t x80 = vdupq_n_s8(-128);
  for (int64_t b = 0; b < nb; ++b) {
    int8x16_t qa0[T], qa1[T];
    float da[T], sa[T];
    for (int t = 0; t < T; ++t) {
      const int8_t* q = reinterpret_cast<const int8_t*>(A[t]) + b * 32;
      qa0[t] = vld1q_s8(q);
      qa1[t] = vld1q_s8(q + 16);
      da[t] = reinterpret_cast<const float*>(A[t] + kp)[b];
      sa[t] = reinterpret_cast<const float*>(A[t] + kp)[nb + b];
    }
    for (int r = 0; r < R; ++r) {
      int8x16_t u0 = vreinterpretq_s8_u8(vld1q_u8(U[r] + b * 32));
      int8x16_t u1 = vreinterpretq_s8_u8(vld1q_u8(U[r] + b * 32 + 16));
      if (Wide) {
        u0 = veorq_s8(u0, x80);
        u1 = veorq_s8(u1, x80);
      }
      const float* dwx = reinterpret_cast<const float*>(U[r] + kp);
      const float dw = dwx[b * 8], mw = dwx[nb * 8 + b];
      const float off = Wide ? mw + 128.0f * dw : mw;
      for (int t = 0; t < T; ++t) {
        const int32_t sum = vaddvq_s32(vdotq_s32(vdotq_s32(vdupq_n_s32(0), u0, qa0[t]), u1, qa1[t]));
        acc[r][t] += (float)sum * (dw * da[t]) + off * sa[t];
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) out[r][t] = acc[r][t];
#else
  for (int r = 0; r < R; ++r) {
    const float* dw = reinterpret_cast<const float*>(U[r] + kp);
    for (int t = 0; t < T; ++t) {
      const int8_t* qa = reinterpret_cast<const int8_t*>(A[t]);
      const float* da = reinterpret_cast<const float*>(A[t] + kp);
      float acc = 0.0f;
      for (int64_t b = 0; b < nb; ++b) {
        int32_t s = 0;
        for (int j = 0; j < 32; ++j) s += (int32_t)U[r][b * 32 + j] * (int32_t)qa[b * 32 + j];
        acc += dw[b * 8] * da[b] * (float)s;
      }
      out[r][t] = acc;
    }
  }
  // Offsets: sum over blocks of mw * (da * sum qa).
  for (int r = 0; r < R; ++r) {
    const float* mw = reinterpret_cast<const float*>(U[r] + kp) + nb * 8;
    for (int t = 0; t < T; ++t) out[r][t] += dot_f32_impl(mw, reinterpret_cast<const float*>(A[t] + kp) + nb, nb);
  }
#endif
}

// Mins: out -= sum over super-blocks of M * da * sum_g mn[g] * bsums[g].
template <int R, int T>
void sub_mins(const uint8_t* const* U, const uint8_t* const* A, int64_t k, float (*out)[4]) {
  const int64_t nsb = k / QK_K;
  for (int r = 0; r < R; ++r) {
    const int16_t* mn = reinterpret_cast<const int16_t*>(U[r] + 2 * k);
    const float* M = reinterpret_cast<const float*>(U[r] + 2 * k + (k / 16) * 2) + nsb;
    for (int t = 0; t < T; ++t) {
      const block_q8_K* a = reinterpret_cast<const block_q8_K*>(A[t]);
      float m = 0.0f;
      for (int64_t b = 0; b < nsb; ++b) {
        int16_t bs[16];
        float da;
        std::memcpy(bs, a[b].bsums, sizeof(bs));
        std::memcpy(&da, &a[b].d, 4);
        int32_t s = 0;
        for (int g = 0; g < 16; ++g) s += (int32_t)mn[b * 16 + g] * bs[g];
        m += M[b] * da * (float)s;
      }
      out[r][t] -= m;
    }
  }
}

// Wide: u spans 0..255 (iq4_xs, u = value + 128 and mn = 128 * sc); AVX2 then sums (u - 128) * qa
// with the sign trick, which makes the min term exactly zero.
template <int R, int T, bool Wide>
void tile_k(const uint8_t* const* U, const uint8_t* const* A, int64_t k, float (*out)[4]) {
  const int64_t nsb = k / QK_K;
#if defined(__AVX512F__)
  __m512 acc[R][T];
  __m256 macc[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) {
      acc[r][t] = _mm512_setzero_ps();
      macc[r][t] = _mm256_setzero_ps();
    }
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t b = 0; b < nsb; ++b) {
    __m512i ia[R][T];
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < T; ++t) ia[r][t] = zero;
    for (int c = 0; c < 4; ++c) {
      __m512i qa[T];
      for (int t = 0; t < T; ++t)
        qa[t] = _mm512_loadu_si512(reinterpret_cast<const block_q8_K*>(A[t])[b].qs + c * 64);
      for (int r = 0; r < R; ++r) {
        const __m512i u = _mm512_loadu_si512(U[r] + b * QK_K + c * 64);
        const __m512i sc = _mm512_loadu_si512(U[r] + k + (b * 4 + c) * 64);
        for (int t = 0; t < T; ++t)
          ia[r][t] = _mm512_add_epi32(ia[r][t], _mm512_mullo_epi32(_mm512_dpbusd_epi32(zero, u, qa[t]), sc));
      }
    }
    // Scales and mins of this super-block: D * da on the integer sums, M * da on mn . bsums.
    float da[T];
    __m256i bs[T];
    for (int t = 0; t < T; ++t) {
      const block_q8_K* ab = reinterpret_cast<const block_q8_K*>(A[t]) + b;
      std::memcpy(&da[t], &ab->d, 4);
      bs[t] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ab->bsums));
    }
    for (int r = 0; r < R; ++r) {
      const float* DM = reinterpret_cast<const float*>(U[r] + 2 * k + (k / 16) * 2);
      const float D = DM[b], M = DM[nsb + b];
      const __m256i mn = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(U[r] + 2 * k) + b);
      for (int t = 0; t < T; ++t) {
        acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia[r][t]), _mm512_set1_ps(D * da[t]), acc[r][t]);
        macc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(mn, bs[t])), _mm256_set1_ps(M * da[t]),
                                     macc[r][t]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) {
      const __m256 m = macc[r][t];
      __m128 h = _mm_add_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
      h = _mm_add_ps(h, _mm_movehl_ps(h, h));
      h = _mm_add_ss(h, _mm_movehdup_ps(h));
      out[r][t] = _mm512_reduce_add_ps(acc[r][t]) - _mm_cvtss_f32(h);
    }
#elif defined(__AVX2__)
  __m256 acc[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm256_setzero_ps();
  const __m256i x80 = _mm256_set1_epi8(-128);
  for (int64_t b = 0; b < nsb; ++b) {
    __m256i ia[R][T];
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < T; ++t) ia[r][t] = _mm256_setzero_si256();
    for (int c = 0; c < 8; ++c) {
      __m256i qa[T];
      for (int t = 0; t < T; ++t)
        qa[t] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(reinterpret_cast<const block_q8_K*>(A[t])[b].qs + c * 32));
      for (int r = 0; r < R; ++r) {
        const __m256i u = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(U[r] + b * QK_K + c * 32));
        // Lane scales of two groups -> 16 int16 [g0 x8 | g1 x8] (packs works per 128-bit half).
        const __m256i sx = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(U[r] + k + (b * 8 + c) * 32));
        const __m256i sc16 = _mm256_packs_epi32(sx, sx);
        const __m256i ws = Wide ? _mm256_xor_si256(u, x80) : u;
        const __m256i au = Wide ? _mm256_abs_epi8(ws) : u;
        for (int t = 0; t < T; ++t) {
          const __m256i p16 = _mm256_maddubs_epi16(au, Wide ? _mm256_sign_epi8(qa[t], ws) : qa[t]);
          ia[r][t] = _mm256_add_epi32(ia[r][t], _mm256_madd_epi16(p16, sc16));
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      const float D = reinterpret_cast<const float*>(U[r] + 2 * k + (k / 16) * 2)[b];
      for (int t = 0; t < T; ++t) {
        float da;
        std::memcpy(&da, &reinterpret_cast<const block_q8_K*>(A[t])[b].d, 4);
        acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia[r][t]), _mm256_set1_ps(D * da), acc[r][t]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) {
      const __m256 v = acc[r][t];
      __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
      h = _mm_add_ps(h, _mm_movehl_ps(h, h));
      h = _mm_add_ss(h, _mm_movehdup_ps(h));
      out[r][t] = _mm_cvtss_f32(h);
    }
  if (!Wide) sub_mins<R, T>(U, A, k, out);
#elif defined(__ARM_FEATURE_DOTPROD)
  // sdot per group of 16 (u <= 63 but for Wide iq4_xs, shifted to u - 128 as on AVX2, whose min term
  // is then exactly zero); the group's int32 scale multiplies the four lanes, all in exact integers.
  float32x4_t acc[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = vdupq_n_f32(0.0f);
  const int8x16_t x80 = vdupq_n_s8(-128);
  for (int64_t b = 0; b < nsb; ++b) {
    int32x4_t ia[R][T];
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < T; ++t) ia[r][t] = vdupq_n_s32(0);
    for (int g = 0; g < 16; ++g) {
      int8x16_t qa[T];
      for (int t = 0; t < T; ++t) qa[t] = vld1q_s8(reinterpret_cast<const block_q8_K*>(A[t])[b].qs + g * 16);
      for (int r = 0; r < R; ++r) {
        int8x16_t u = vreinterpretq_s8_u8(vld1q_u8(U[r] + b * QK_K + g * 16));
        if (Wide) u = veorq_s8(u, x80);
        const int32x4_t sc = vld1q_s32(reinterpret_cast<const int32_t*>(U[r] + k) + b * 64 + g * 4);
        for (int t = 0; t < T; ++t) ia[r][t] = vmlaq_s32(ia[r][t], vdotq_s32(vdupq_n_s32(0), u, qa[t]), sc);
      }
    }
    for (int r = 0; r < R; ++r) {
      const float D = reinterpret_cast<const float*>(U[r] + 2 * k + (k / 16) * 2)[b];
      for (int t = 0; t < T; ++t) {
        float da;
        std::memcpy(&da, &reinterpret_cast<const block_q8_K*>(A[t])[b].d, 4);
        acc[r][t] = vfmaq_n_f32(acc[r][t], vcvtq_f32_s32(ia[r][t]), D * da);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) out[r][t] = vaddvq_f32(acc[r][t]);
  if (!Wide) sub_mins<R, T>(U, A, k, out);
#else
  for (int r = 0; r < R; ++r) {
    const int32_t* scx = reinterpret_cast<const int32_t*>(U[r] + k);
    const float* D = reinterpret_cast<const float*>(U[r] + 2 * k + (k / 16) * 2);
    for (int t = 0; t < T; ++t) {
      const block_q8_K* a = reinterpret_cast<const block_q8_K*>(A[t]);
      float acc = 0.0f;
      for (int64_t b = 0; b < nsb; ++b) {
        int32_t s = 0;
        for (int g = 0; g < 16; ++g) {
          int32_t p = 0;
          for (int j = 0; j < 16; ++j) p += (int32_t)U[r][b * QK_K + g * 16 + j] * (int32_t)a[b].qs[g * 16 + j];
          s += p * scx[b * 64 + g * 4];
        }
        float da;
        std::memcpy(&da, &a[b].d, 4);
        acc += D[b] * da * (float)s;
      }
      out[r][t] = acc;
    }
  }
  sub_mins<R, T>(U, A, k, out);
#endif
}

// ---- drivers ------------------------------------------------------------------------------------

using TileFn = void (*)(const uint8_t* const*, const uint8_t* const*, int64_t, float (*)[4]);

template <bool Wide>
struct TileA {
  template <int R, int T>
  struct At {
    static void run(const uint8_t* const* U, const uint8_t* const* A, int64_t n, float (*o)[4]) {
      tile_a<R, T, Wide>(U, A, n, o);
    }
  };
};
template <bool Wide>
struct TileK {
  template <int R, int T>
  struct At {
    static void run(const uint8_t* const* U, const uint8_t* const* A, int64_t n, float (*o)[4]) {
      tile_k<R, T, Wide>(U, A, n, o);
    }
  };
};

// Tokens per tile: AVX-512 has 32 registers for the R x T accumulators, AVX2 16. i8mm's 4 x 4
// tile keeps 4 accumulators, 8 activation and 4 weight vectors of its 32 registers.
#if defined(__AVX512F__)
constexpr int kTileTokA = 4, kTileTokK = 2;
#elif defined(__ARM_FEATURE_MATMUL_INT8)
constexpr int kTileTokA = 4, kTileTokK = 2;
#else
constexpr int kTileTokA = 2, kTileTokK = 2;
#endif

// fns[R-1][T-1] for R, T in 1..4.
template <template <int, int> class Tile>
TileFn tile_fn(int R, int T) {
  static const TileFn f[4][4] = {
      {Tile<1, 1>::run, Tile<1, 2>::run, Tile<1, 3>::run, Tile<1, 4>::run},
      {Tile<2, 1>::run, Tile<2, 2>::run, Tile<2, 3>::run, Tile<2, 4>::run},
      {Tile<3, 1>::run, Tile<3, 2>::run, Tile<3, 3>::run, Tile<3, 4>::run},
      {Tile<4, 1>::run, Tile<4, 2>::run, Tile<4, 3>::run, Tile<4, 4>::run},
  };
  return f[R - 1][T - 1];
}

// Unpack up to kTileRows weight rows, then run them against every token in tiles of maxT.
template <template <int, int> class Tile>
void run_unpacked(const MatmulArgs& a, int64_t r0, int64_t r1, void (*unpack)(const void*, int64_t, uint8_t*),
                  size_t ubytes, int64_t kdim, int maxT) {
  uint8_t* buf = tl_unpack.get(ubytes * kTileRows);
  const uint8_t* W = static_cast<const uint8_t*>(a.w);
  const uint8_t* X = static_cast<const uint8_t*>(a.act);
  for (int64_t r = r0; r < r1; r += kTileRows) {
    const int R = (int)std::min<int64_t>(kTileRows, r1 - r);
    const uint8_t* U[kTileRows];
    for (int i = 0; i < R; ++i) {
      unpack(W + (size_t)(r + i) * a.w_row_bytes, a.k, buf + i * ubytes);
      U[i] = buf + i * ubytes;
    }
    for (int64_t t = 0; t < a.n_tok; t += maxT) {
      const int T = (int)std::min<int64_t>(maxT, a.n_tok - t);
      const uint8_t* A[4];
      for (int j = 0; j < T; ++j) A[j] = X + (size_t)(t + j) * a.act_row_bytes;
      float out[4][4];
      tile_fn<Tile>(R, T)(U, A, kdim, out);
      for (int i = 0; i < R; ++i)
        for (int j = 0; j < T; ++j) a.y[(t + j) * a.y_stride + r + i] = out[i][j];
    }
  }
}

#if defined(__AVX512F__)
// ---- decode GEMV (one token), 32-block family --------------------------------------------------
// Streams weight blocks straight into registers (no unpack buffer): one token
// cannot amortize unpacking, and decode is bound by reading the weights.
// Each loader gives u (unsigned, element order) and w = dw * u + mw for one block.
struct U32 {
  __m256i u;
  float dw, mw;
};
inline __m256i nibbles256(const uint8_t* qs) {
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i m = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), m), _mm_and_si128(q, m));
}
inline U32 ld_q4_0(const block_q4_0* b) {
  const float d = f16s(b->d);
  return {nibbles256(b->qs), d, -8.0f * d};
}
inline U32 ld_q4_1(const block_q4_1* b) { return {nibbles256(b->qs), f16s(b->d), f16s(b->m)}; }
inline U32 ld_q8_0(const block_q8_0* b) {
  const float d = f16s(b->d);
  const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b->qs));
  return {_mm256_xor_si256(q, _mm256_set1_epi8(-128)), d, -128.0f * d};
}
inline U32 ld_q5_0(const block_q5_0* b) {
  uint32_t qh;
  std::memcpy(&qh, b->qh, 4);
  const __m256i bytes = _mm256_shuffle_epi8(
      _mm256_set1_epi32((int)qh), _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL, 0x0101010101010101LL, 0));
  const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
  const __m256i hb = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit), _mm256_set1_epi8(0x10));
  const float d = f16s(b->d);
  return {_mm256_or_si256(nibbles256(b->qs), hb), d, -16.0f * d};
}

// Rows [r, r + nr) (nr <= R) against tokens [t0, t0 + T): each block is unpacked in
// registers once and dotted with all T activation rows (decode and batched decode).
// The arithmetic is tile_a's, operation for operation (two blocks per 512-bit product,
// the same scale products, offsets folded into the accumulators 16 blocks at a time,
// one final reduction), so a token computes bit-identically whether it is decoded here
// or prefilled through the tiled path: a prefix-cache hit then gives a cold run's logits.
template <class Blk, U32 (*LD)(const Blk*), int R, int T>
void gemv_rt(const MatmulArgs& a, int64_t r, int nr, int64_t t0, float* mwb, int64_t nbs, size_t pf) {
  const int64_t nb = a.k / 32, kp = act_a8_padded_k(a.k);
  const uint8_t* A[T];
  const float* da[T];
  const float* sa[T];
  for (int t = 0; t < T; ++t) a8_row(a.act, a.act_row_bytes, t0 + t, kp, A[t], da[t], sa[t]);
  const __m512i idx = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m512i zero = _mm512_setzero_si512();
  const Blk* w[R];
  for (int i = 0; i < R; ++i)
    w[i] = reinterpret_cast<const Blk*>(static_cast<const uint8_t*>(a.w) + (size_t)(r + std::min(i, nr - 1)) * a.w_row_bytes);
  __m512 acc[R][T];
  for (int i = 0; i < R; ++i)
    for (int t = 0; t < T; ++t) acc[i][t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; b += 2) {
    const bool two = b + 1 < nb;
    __m512i qa[T];
    __m512 dax[T];
    for (int t = 0; t < T; ++t) {  // activation rows are padded to 64: the pair is always there
      qa[t] = _mm512_loadu_si512(A[t] + b * 32);
      const __m128 d2 = _mm_castsi128_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(da[t] + b)));
      dax[t] = _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(d2));
    }
    for (int i = 0; i < R; ++i) {
      // Weights come from DRAM once per step: fetch the same column two groups
      // of rows ahead (at least 2 KiB) while this group computes.
      if (pf) _mm_prefetch(reinterpret_cast<const char*>(w[i] + b) + pf, _MM_HINT_T0);
      const U32 u0 = LD(w[i] + b);
      const U32 u1 = two ? LD(w[i] + b + 1) : U32{_mm256_setzero_si256(), 0.0f, 0.0f};
      mwb[i * nbs + b] = u0.mw;
      if (two) mwb[i * nbs + b + 1] = u1.mw;
      const __m512i u = _mm512_inserti64x4(_mm512_castsi256_si512(u0.u), u1.u, 1);
      const __m512 dw = _mm512_mask_blend_ps((__mmask16)0xFF00, _mm512_set1_ps(u0.dw), _mm512_set1_ps(u1.dw));
      for (int t = 0; t < T; ++t) {
        const __m512i p = _mm512_dpbusd_epi32(zero, u, qa[t]);
        acc[i][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(dw, dax[t]), acc[i][t]);
      }
    }
  }
  for (int64_t j = 0; j < nb; j += 16) {
    const __mmask16 m = nb - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (nb - j)) - 1);
    for (int i = 0; i < R; ++i) {
      const __m512 mw = _mm512_maskz_loadu_ps(m, mwb + i * nbs + j);
      for (int t = 0; t < T; ++t) acc[i][t] = _mm512_fmadd_ps(mw, _mm512_maskz_loadu_ps(m, sa[t] + j), acc[i][t]);
    }
  }
  for (int i = 0; i < nr; ++i)
    for (int t = 0; t < T; ++t) a.y[(t0 + t) * a.y_stride + r + i] = _mm512_reduce_add_ps(acc[i][t]);
}

// Tokens up to this count take the register-unpack GEMV; more take the tiled path,
// whose unpack buffer is then shared by enough tokens to pay for itself.
constexpr int64_t kGemvMaxTok = 8;

template <class Blk, U32 (*LD)(const Blk*)>
void gemv_a(const MatmulArgs& a, int64_t r0, int64_t r1) {
  constexpr int R = 4;  // rows in flight: R x T independent accumulator chains
  const int64_t nb = a.k / 32, nbs = (nb + 15) / 16 * 16;
  float* mwb = reinterpret_cast<float*>(tl_row.get((size_t)R * nbs * 4));
  const size_t pf = std::max<size_t>(2048, 2 * R * a.w_row_bytes);
  for (int64_t r = r0; r < r1; r += R) {
    const int nr = (int)std::min<int64_t>(R, r1 - r);
    // Token chunks inside the row group: the group's weights stay in L1 for the later chunks.
    for (int64_t t = 0; t < a.n_tok; t += 4) {
      const size_t p = t == 0 ? pf : 0;
      switch (std::min<int64_t>(4, a.n_tok - t)) {
        case 1: gemv_rt<Blk, LD, R, 1>(a, r, nr, t, mwb, nbs, p); break;
        case 2: gemv_rt<Blk, LD, R, 2>(a, r, nr, t, mwb, nbs, p); break;
        case 3: gemv_rt<Blk, LD, R, 3>(a, r, nr, t, mwb, nbs, p); break;
        default: gemv_rt<Blk, LD, R, 4>(a, r, nr, t, mwb, nbs, p); break;
      }
    }
  }
}

// q4_K rows against T (<= 3) tokens of q8_K activations, unpacked in registers:
// per 64 elements one VNNI product covers two sub-blocks, each lane group is
// scaled by its 6-bit sub-block scale in integers, mins come from the bsums.
// Same operations in the same order as tile_k (mins per lane, one reduction tree),
// so decode and prefill give a token the same bits.
template <int T>
void gemv_q4_K_t(const MatmulArgs& a, int64_t r0, int64_t r1, int64_t t0) {
  const int64_t nsb = a.k / QK_K;
  const block_q8_K* A[T];
  for (int t = 0; t < T; ++t)
    A[t] = reinterpret_cast<const block_q8_K*>(static_cast<const uint8_t*>(a.act) + (size_t)(t0 + t) * a.act_row_bytes);
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  const size_t pf = std::max<size_t>(2048, 2 * a.w_row_bytes);
  for (int64_t r = r0; r < r1; ++r) {
    const block_q4_K* w = reinterpret_cast<const block_q4_K*>(static_cast<const uint8_t*>(a.w) + (size_t)r * a.w_row_bytes);
    __m512 acc[T];
    __m256 macc[T];
    for (int t = 0; t < T; ++t) {
      acc[t] = _mm512_setzero_ps();
      macc[t] = _mm256_setzero_ps();
    }
    for (int64_t sb = 0; sb < nsb; ++sb) {
      const block_q4_K* b = w + sb;
      _mm_prefetch(reinterpret_cast<const char*>(b) + pf, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(b) + pf + 64, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(b) + pf + 128, _MM_HINT_T0);
      uint8_t sc[8], mn[8];
      k_scale_min(b->scales, sc, mn);
      const float d = f16s(b->d), dmin = f16s(b->dmin);
      __m512i U[4], S[4];
      for (int c = 0; c < 4; ++c) {
        const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b->qs + c * 32));
        U[c] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(q, m4)),
                                  _mm256_and_si256(_mm256_srli_epi16(q, 4), m4), 1);
        S[c] = _mm512_inserti64x4(_mm512_set1_epi32(sc[2 * c]), _mm256_set1_epi32(sc[2 * c + 1]), 1);
      }
      // Per group of 16 (as the unpacked layout): mn repeated for both groups of a sub-block.
      const __m256i mn16 = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(mn)),
                                                                   _mm_loadl_epi64(reinterpret_cast<const __m128i*>(mn))));
      for (int t = 0; t < T; ++t) {
        const block_q8_K* x = A[t] + sb;
        __m512i isum = _mm512_setzero_si512();
        for (int c = 0; c < 4; ++c) {
          const __m512i qa = _mm512_loadu_si512(x->qs + c * 64);
          isum = _mm512_add_epi32(isum, _mm512_mullo_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), U[c], qa), S[c]));
        }
        float da;
        std::memcpy(&da, &x->d, 4);
        acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_set1_ps(d * da), acc[t]);
        const __m256i bs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x->bsums));
        macc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(mn16, bs)), _mm256_set1_ps(dmin * da), macc[t]);
      }
    }
    for (int t = 0; t < T; ++t) {
      const __m256 m = macc[t];
      __m128 h = _mm_add_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
      h = _mm_add_ps(h, _mm_movehl_ps(h, h));
      h = _mm_add_ss(h, _mm_movehdup_ps(h));
      a.y[(t0 + t) * a.y_stride + r] = _mm512_reduce_add_ps(acc[t]) - _mm_cvtss_f32(h);
    }
  }
}

void gemv_q4_K(const MatmulArgs& a, int64_t r0, int64_t r1) {
  for (int64_t t = 0; t < a.n_tok; t += 3) {
    switch (std::min<int64_t>(3, a.n_tok - t)) {
      case 1: gemv_q4_K_t<1>(a, r0, r1, t); break;
      case 2: gemv_q4_K_t<2>(a, r0, r1, t); break;
      default: gemv_q4_K_t<3>(a, r0, r1, t); break;
    }
  }
}

#endif

template <class Blk, void (*UP)(const Blk*, uint8_t*, float&, float&), bool Wide = false>
void run_a(const MatmulArgs& a, int64_t r0, int64_t r1) {
  const int64_t kp = act_a8_padded_k(a.k);
  run_unpacked<TileA<Wide>::template At>(a, r0, r1, &unpack_row_a<Blk, UP>, ubytes_a(kp), kp, kTileTokA);
}

template <class Blk, void (*UP)(const Blk*, KOut&), bool Wide = false>
void run_k(const MatmulArgs& a, int64_t r0, int64_t r1) {
  run_unpacked<TileK<Wide>::template At>(a, r0, r1, &unpack_row_k<Blk, UP>, ubytes_k(a.k), a.k, kTileTokK);
}

// f32 weights: straight dot products (the row stays in L1 across tokens).
void run_f32(const MatmulArgs& a, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    const float* w = reinterpret_cast<const float*>(static_cast<const uint8_t*>(a.w) + (size_t)r * a.w_row_bytes);
    for (int64_t t = 0; t < a.n_tok; ++t)
      a.y[t * a.y_stride + r] = dot_f32_impl(
          w, reinterpret_cast<const float*>(static_cast<const uint8_t*>(a.act) + (size_t)t * a.act_row_bytes), a.k);
  }
}

// Every other dequantizable type (f16, bf16, q8_K, ...): dequantize the row once, dot per token.
void run_generic(const MatmulArgs& a, int64_t r0, int64_t r1) {
  float* row = reinterpret_cast<float*>(tl_row.get((size_t)a.k * 4));
  for (int64_t r = r0; r < r1; ++r) {
    const void* src = static_cast<const uint8_t*>(a.w) + (size_t)r * a.w_row_bytes;
#if defined(__AVX2__)
    if (a.wtype == (uint32_t)GGMLType::F16 && a.k % 8 == 0) {  // F16C: exact, as the decoder
      const __m128i* h = static_cast<const __m128i*>(src);
      for (int64_t i = 0; i < a.k / 8; ++i) _mm256_storeu_ps(row + i * 8, _mm256_cvtph_ps(_mm_loadu_si128(h + i)));
    } else
#endif
      dequant_row(a.wtype, src, row, a.k);
    for (int64_t t = 0; t < a.n_tok; ++t)
      a.y[t * a.y_stride + r] = dot_f32_impl(
          row, reinterpret_cast<const float*>(static_cast<const uint8_t*>(a.act) + (size_t)t * a.act_row_bytes), a.k);
  }
}

}  // namespace

float dot_f32(const float* a, const float* b, int64_t n) { return dot_f32_impl(a, b, n); }

uint32_t act_type(uint32_t wtype) {
  switch ((GGMLType)wtype) {
    case GGMLType::Q4_0: case GGMLType::Q4_1: case GGMLType::Q5_0: case GGMLType::Q5_1:
    case GGMLType::Q8_0: case GGMLType::IQ4_NL: case GGMLType::MXFP4:
      return (uint32_t)GGMLType::Q8_1;
    case GGMLType::Q2_K: case GGMLType::Q3_K: case GGMLType::Q4_K: case GGMLType::Q5_K:
    case GGMLType::Q6_K: case GGMLType::IQ4_XS:
      return (uint32_t)GGMLType::Q8_K;
    default: {
      const TypeTraits* t = type_traits(wtype);
      return t && t->dequantizable ? (uint32_t)GGMLType::F32 : UINT32_MAX;
    }
  }
}

void quantize_act(uint32_t at, const float* x, void* dst, int64_t n) {
  uint8_t* d = static_cast<uint8_t*>(dst);
  switch ((GGMLType)at) {
    case GGMLType::Q8_1: quant_act_a8(x, d, n); break;
    case GGMLType::Q8_K: quant_act_k8(x, d, n); break;
    case GGMLType::F32: std::memcpy(d, x, (size_t)n * 4); break;
    default: break;
  }
}

void matmul_rows(const MatmulArgs& a, int64_t r0, int64_t r1) {
  if (r1 <= r0 || a.n_tok <= 0) return;
  if (a.wpack != nullptr && matmul_packed(a, r0, r1)) return;
#if defined(__AVX512F__)
  // Decode and batched decode unpack in registers: too few tokens to amortize the
  // unpack buffer of the tiled path.
  if (a.n_tok <= kGemvMaxTok) {
    switch ((GGMLType)a.wtype) {
      case GGMLType::Q4_0: return gemv_a<block_q4_0, ld_q4_0>(a, r0, r1);
      case GGMLType::Q4_1: return gemv_a<block_q4_1, ld_q4_1>(a, r0, r1);
      case GGMLType::Q5_0: return gemv_a<block_q5_0, ld_q5_0>(a, r0, r1);
      case GGMLType::Q8_0: return gemv_a<block_q8_0, ld_q8_0>(a, r0, r1);
      default: break;
    }
  }
  if (a.n_tok < 4 && (GGMLType)a.wtype == GGMLType::Q4_K) return gemv_q4_K(a, r0, r1);
#endif
  switch ((GGMLType)a.wtype) {
    case GGMLType::Q4_0: run_a<block_q4_0, up_q4_0>(a, r0, r1); break;
    case GGMLType::Q4_1: run_a<block_q4_1, up_q4_1>(a, r0, r1); break;
    case GGMLType::Q5_0: run_a<block_q5_0, up_q5_0>(a, r0, r1); break;
    case GGMLType::Q5_1: run_a<block_q5_1, up_q5_1>(a, r0, r1); break;
    case GGMLType::Q8_0: run_a<block_q8_0, up_q8_0, true>(a, r0, r1); break;
    case GGMLType::IQ4_NL: run_a<block_iq4_nl, up_iq4_nl, true>(a, r0, r1); break;
    case GGMLType::MXFP4: run_a<block_mxfp4, up_mxfp4>(a, r0, r1); break;
    case GGMLType::Q2_K: run_k<block_q2_K, upk_q2_K>(a, r0, r1); break;
    case GGMLType::Q3_K: run_k<block_q3_K, upk_q3_K>(a, r0, r1); break;
    case GGMLType::Q4_K: run_k<block_q4_K, upk_q4_K>(a, r0, r1); break;
    case GGMLType::Q5_K: run_k<block_q5_K, upk_q5_K>(a, r0, r1); break;
    case GGMLType::Q6_K: run_k<block_q6_K, upk_q6_K>(a, r0, r1); break;
    case GGMLType::IQ4_XS: run_k<block_iq4_xs, upk_iq4_xs, true>(a, r0, r1); break;
    case GGMLType::F32: run_f32(a, r0, r1); break;
    default: run_generic(a, r0, r1); break;
  }
}

}  // namespace dl::cpu::DL_ISA
