// Branch-free float math for the per-ISA kernels (loops over these vectorize).
// Included only by *_isa.cpp files: internal linkage keeps each ISA's copy apart.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace dl::cpu::DL_ISA {
namespace {

// exp(x) for x <= 0: 2^n * p(r) with |r| <= ln2/2 and a degree-6 polynomial, ~2 ulp.
inline float exp_neg(float x) {
  x = std::max(x, -87.f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
  float p = 1.f / 720;
  p = p * r + 1.f / 120;
  p = p * r + 1.f / 24;
  p = p * r + 1.f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  int32_t bits;
  std::memcpy(&bits, &p, 4);
  bits += (int32_t)n << 23;
  std::memcpy(&p, &bits, 4);
  return p;
}

// x * sigmoid(x), from e = exp(-|x|) so the exponent never overflows.
inline float silu(float x) {
  const float e = exp_neg(-std::fabs(x));
  return (x >= 0.f ? x : x * e) / (1.f + e);
}

// 1 / (1 + exp(-x)), from e = exp(-|x|) so the exponent never overflows.
inline float sigmoid(float x) {
  const float e = exp_neg(-std::fabs(x));
  return (x >= 0.f ? 1.f : e) / (1.f + e);
}

// gpt-oss's clamped SwiGLU (Act::swiglu_oai).
inline float swiglu_oai(float gate, float up) {
  const float g = std::fmin(gate, 7.f), u = std::fmin(std::fmax(up, -7.f), 7.f);
  const float z = 1.702f * g;
  const float e = exp_neg(-std::fabs(z));
  return g * ((z >= 0.f ? 1.f : e) / (1.f + e)) * (u + 1.f);
}

// tanh(y) = sign(y) (1 - e) / (1 + e) with e = exp(-2|y|).
inline float tanh_f(float y) {
  const float e = exp_neg(-2.f * std::fabs(y));
  const float t = (1.f - e) / (1.f + e);
  return y < 0.f ? -t : t;
}

// erf(x) = 1 - erfc(|x|) with sign: erfc from Numerical Recipes' Chebyshev fit
// (t = 1 / (1 + |x| / 2), fractional error < 1.2e-7), so |error| < 1.2e-7 everywhere.
inline float erf_f(float x) {
  const float z = std::fabs(x);
  const float t = 1.f / (1.f + 0.5f * z);
  float p = 0.17087277f;
  p = p * t - 0.82215223f;
  p = p * t + 1.48851587f;
  p = p * t - 1.13520398f;
  p = p * t + 0.27886807f;
  p = p * t - 0.18628806f;
  p = p * t + 0.09678418f;
  p = p * t + 0.37409196f;
  p = p * t + 1.00002368f;
  p = p * t - 1.26551223f;
  const float r = 1.f - t * exp_neg(-z * z + p);
  return x < 0.f ? -r : r;
}

inline float gelu_erf(float x) { return 0.5f * x * (1.f + erf_f(x * 0.70710678118654752f)); }

#if defined(__AVX512F__)
// exp(x) for x <= 0 (exp_neg, 16 lanes): 2^n p(r), |r| <= ln2 / 2, ~2 ulp.
inline __m512 exp_neg16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// gelu_erf on 16 lanes: erf_f's fit in FMAs, and 1 / (1 + z / 2) from rcp14 and one Newton step
// (relative error ~2^-28) instead of a division (the scalar form's two divisions made the
// whisper encoder's GELU 3% of its time). Not the scalar form's bits; as accurate.
inline __m512 gelu_erf16(__m512 x) {
  const __m512 one = _mm512_set1_ps(1.f);
  const __m512 z = _mm512_abs_ps(_mm512_mul_ps(x, _mm512_set1_ps(0.70710678118654752f)));
  const __m512 d = _mm512_fmadd_ps(z, _mm512_set1_ps(0.5f), one);
  __m512 t = _mm512_rcp14_ps(d);
  t = _mm512_mul_ps(t, _mm512_fnmadd_ps(d, t, _mm512_set1_ps(2.f)));
  __m512 p = _mm512_set1_ps(0.17087277f);
  p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(-0.82215223f));
  p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(1.48851587f));
  p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(-1.13520398f));
  p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(0.27886807f));
  p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(-0.18628806f));
  p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(0.09678418f));
  p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(0.37409196f));
  p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(1.00002368f));
  p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(-1.26551223f));
  const __m512 r = _mm512_fnmadd_ps(t, exp_neg16(_mm512_fnmadd_ps(z, z, p)), one);  // erf(|x| / sqrt 2)
  const __m512 s = _mm512_mask_sub_ps(r, _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ), _mm512_setzero_ps(), r);
  return _mm512_mul_ps(_mm512_mul_ps(x, _mm512_set1_ps(0.5f)), _mm512_add_ps(one, s));
}
#endif

inline float gelu_tanh(float x) {
  return 0.5f * x * (1.f + tanh_f(0.7978845608028654f * (x + 0.044715f * x * x * x)));
}

}  // namespace
}  // namespace dl::cpu::DL_ISA
