// Elementwise float kernels per ISA: gated activations, f16 cache rows to and from f32.
#include "core/half.h"
#include "cpu/isa_kernels.h"
#include "cpu/vmath.h"
#include "quant/dequant_impl.h"

#include <cmath>

#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace dl::cpu::DL_ISA {

void glu_f32(const float* gate, const float* up, float* out, int64_t n, int act) {
  if (act == 0)
    for (int64_t i = 0; i < n; ++i) out[i] = silu(gate[i]) * up[i];
  else if (act == 2)
    for (int64_t i = 0; i < n; ++i) out[i] = swiglu_oai(gate[i], up[i]);
  else if (act == 3)
    for (int64_t i = 0; i < n; ++i) out[i] = sigmoid(gate[i]) * up[i];
  else if (act == 4)
    for (int64_t i = 0; i < n; ++i) out[i] = (gate[i] > 0.f ? gate[i] : 0.f) * up[i];
  else
    for (int64_t i = 0; i < n; ++i) out[i] = gelu_tanh(gate[i]) * up[i];
}

void gelu_erf_f32(float* y, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i < n; i += 16) {
    const __mmask16 m = n - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - i)) - 1);
    _mm512_mask_storeu_ps(y + i, m, gelu_erf16(_mm512_maskz_loadu_ps(m, y + i)));
  }
#endif
  for (; i < n; ++i) y[i] = gelu_erf(y[i]);
}

// Eight double lanes summed in a fixed order, so an ISA with 8-wide double vectors gives the
// scalar form's bits: lane l holds elements l, l + 8, ...; the lanes are combined as below.
static inline double lane_sum(const double* lane) {
  return ((lane[0] + lane[4]) + (lane[1] + lane[5])) + ((lane[2] + lane[6]) + (lane[3] + lane[7]));
}

void layer_norm_row(const float* x, const float* w, const float* b, float* y, int64_t dim, float eps) {
  // Two passes in double: the mean first, so the variance does not cancel.
  alignas(64) double lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512d acc = _mm512_setzero_pd();
  for (; i + 8 <= dim; i += 8) acc = _mm512_add_pd(acc, _mm512_cvtps_pd(_mm256_loadu_ps(x + i)));
  _mm512_store_pd(lane, acc);
#endif
  for (; i + 8 <= dim; i += 8)
    for (int l = 0; l < 8; ++l) lane[l] += x[i + l];
  for (; i < dim; ++i) lane[i % 8] += x[i];
  const double mean = lane_sum(lane) / dim;
  for (int l = 0; l < 8; ++l) lane[l] = 0;
  i = 0;
#if defined(__AVX512F__)
  const __m512d vm = _mm512_set1_pd(mean);
  acc = _mm512_setzero_pd();
  for (; i + 8 <= dim; i += 8) {
    const __m512d d = _mm512_sub_pd(_mm512_cvtps_pd(_mm256_loadu_ps(x + i)), vm);
    acc = _mm512_add_pd(acc, _mm512_mul_pd(d, d));
  }
  _mm512_store_pd(lane, acc);
#endif
  for (; i + 8 <= dim; i += 8)
    for (int l = 0; l < 8; ++l) lane[l] += ((double)x[i + l] - mean) * ((double)x[i + l] - mean);
  for (; i < dim; ++i) lane[i % 8] += ((double)x[i] - mean) * ((double)x[i] - mean);
  const double inv = 1.0 / std::sqrt(lane_sum(lane) / dim + eps);
  i = 0;
#if defined(__AVX512F__)
  const __m512d vi = _mm512_set1_pd(inv);
  for (; i + 8 <= dim; i += 8) {
    __m256 v = _mm512_cvtpd_ps(_mm512_mul_pd(_mm512_sub_pd(_mm512_cvtps_pd(_mm256_loadu_ps(x + i)), vm), vi));
    if (w) v = _mm256_mul_ps(v, _mm256_loadu_ps(w + i));
    if (b) v = _mm256_add_ps(v, _mm256_loadu_ps(b + i));
    _mm256_storeu_ps(y + i, v);
  }
#endif
  for (; i < dim; ++i) {
    float v = (float)(((double)x[i] - mean) * inv);
    if (w) v *= w[i];
    if (b) v += b[i];
    y[i] = v;
  }
}

// The converting instruction where the ISA has one: exact for every finite half and
// infinity, and (unlike the auto-vectorized select form) indifferent to where the row
// starts; signaling NaNs come out quiet, which a KV cache never holds.
void f16_to_f32(const uint16_t* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
#endif
  for (; i < n; ++i) dst[i] = dl::quant::h2f(src[i]);
}

// Rounds to nearest even like dl::f32_to_f16 (the same bits for every non-NaN value).
void f32_to_f16(const float* src, uint16_t* dst, int64_t n) {
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
  for (; i < n; ++i) dst[i] = dl::f32_to_f16(src[i]);
}

}  // namespace dl::cpu::DL_ISA
