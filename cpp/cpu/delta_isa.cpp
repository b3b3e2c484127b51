// The chunked gated delta rule (see DeltaRuleArgs). For a chunk of L tokens with cumulative
// log-decays gc (gc_t = g_0 + ... + g_t), normed keys k, queries q, betas b and the state S
// it starts from, the token-by-token rule unrolls to:
//   M[t][s] = b_t exp(gc_t - gc_s) k_t.k_s  (s < t),
//   u_t = b_t (v_t - exp(gc_t) S^T k_t) - sum_{s<t} M[t][s] u_s   (a unit lower-triangular solve),
//   out_t = exp(gc_t) S^T q_t + sum_{s<=t} exp(gc_t - gc_s) (q_t.k_s) u_s,
//   S' = exp(gc_{L-1}) S + sum_t exp(gc_{L-1} - gc_t) k_t (x) u_t,
// which is transformers' torch_chunk_gated_delta_rule with its (I + M)^-1 applied to the
// right-hand side directly. Every exponent is <= 0. Apart from the solve, each step is a
// small matmul (mm_acc).
#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/backend.h"
#include "cpu/isa_kernels.h"

namespace dl::cpu::DL_ISA {
namespace {

// C[M][N] += A[M][K] B[K][N], all row-major with the given strides. A 4 x 2-vector tile of C
// is held in registers (GCC / Clang vector types, as wide as this ISA's registers), written out
// explicitly: with runtime strides the compiler leaves a plain-array tile in memory.
#if defined(__AVX512F__)
constexpr int VW = 16;
#elif defined(__AVX2__)
constexpr int VW = 8;
#else
constexpr int VW = 4;  // SSE2, NEON
#endif
typedef float vf __attribute__((vector_size(VW * 4)));
inline vf ld(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void st(float* p, vf v) { std::memcpy(p, &v, sizeof v); }

void mm_acc(const float* __restrict__ A, int64_t lda, const float* __restrict__ B, int64_t ldb, float* __restrict__ C,
            int64_t ldc, int64_t M, int64_t K, int64_t N) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) {
    const float* a0 = A + m * lda;
    float* c0 = C + m * ldc;
    int64_t j = 0;
    for (; j + 2 * VW <= N; j += 2 * VW) {
      float* c1 = c0 + ldc;
      float* c2 = c1 + ldc;
      float* c3 = c2 + ldc;
      vf x0 = ld(c0 + j), y0 = ld(c0 + j + VW), x1 = ld(c1 + j), y1 = ld(c1 + j + VW);
      vf x2 = ld(c2 + j), y2 = ld(c2 + j + VW), x3 = ld(c3 + j), y3 = ld(c3 + j + VW);
      for (int64_t k = 0; k < K; ++k) {
        const vf b0 = ld(B + k * ldb + j), b1 = ld(B + k * ldb + j + VW);
        const float s0 = a0[k], s1 = a0[lda + k], s2 = a0[2 * lda + k], s3 = a0[3 * lda + k];
        x0 += s0 * b0, y0 += s0 * b1;
        x1 += s1 * b0, y1 += s1 * b1;
        x2 += s2 * b0, y2 += s2 * b1;
        x3 += s3 * b0, y3 += s3 * b1;
      }
      st(c0 + j, x0), st(c0 + j + VW, y0), st(c1 + j, x1), st(c1 + j + VW, y1);
      st(c2 + j, x2), st(c2 + j + VW, y2), st(c3 + j, x3), st(c3 + j + VW, y3);
    }
    for (; j < N; ++j)
      for (int r = 0; r < 4; ++r) {
        float acc = C[(m + r) * ldc + j];
        for (int64_t k = 0; k < K; ++k) acc += A[(m + r) * lda + k] * B[k * ldb + j];
        C[(m + r) * ldc + j] = acc;
      }
  }
  for (; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) {
      const float x = A[m * lda + k];
      const float* b = B + k * ldb;
      float* c = C + m * ldc;
      for (int64_t j = 0; j < N; ++j) c[j] += x * b[j];
    }
}

// exp(x) for the decays (x <= 0), 0 below e^-60: a factor that small changes nothing at f32
// precision, and its products would be subnormal floats, which x86 cores handle slowly.
inline float dexp(float x) { return x < -60.f ? 0.f : std::exp(x); }

}  // namespace

void delta_chunked_head(const DeltaRuleArgs& a, int64_t h, DeltaScratch& scratch) {
  constexpr int64_t CL = kDeltaChunk;
  const int64_t dk = a.dk, dv = a.dv;
  const int64_t kh = a.grouped ? h / (a.n_v_heads / a.n_k_heads) : h % a.n_k_heads;
  float* S = a.state + h * dk * dv;
  // q, k [CL][dk]; kT [dk][CL]; KK, QK [CL][CL]; KS, QS, U [CL][dv]; gc, b [CL].
  const size_t need = (size_t)(2 * CL * dk + dk * CL + 2 * CL * CL + 3 * CL * dv + 2 * CL);
  if (scratch.buf.size() < need) scratch.buf.resize(need);
  float* q = scratch.buf.data();
  float* k = q + CL * dk;
  float* kT = k + CL * dk;
  float* KK = kT + dk * CL;
  float* QK = KK + CL * CL;
  float* KS = QK + CL * CL;
  float* QS = KS + CL * dv;
  float* U = QS + CL * dv;
  float* gc = U + CL * dv;
  float* b = gc + CL;
  for (int64_t t0 = 0; t0 < a.n; t0 += CL) {
    const int64_t L = std::min(CL, a.n - t0);
    float run = 0.f;
    for (int64_t t = 0; t < L; ++t) {
      const float* qt = a.q + (t0 + t) * a.qkv_stride + kh * dk;
      const float* kt = a.k + (t0 + t) * a.qkv_stride + kh * dk;
      double sq = 0, sk = 0;  // the norms in double, as the token-by-token rule
      for (int64_t i = 0; i < dk; ++i) sq += (double)qt[i] * qt[i], sk += (double)kt[i] * kt[i];
      const float iq = (float)(1.0 / std::sqrt(sq + a.l2_eps) / std::sqrt((double)dk));
      const float ik = (float)(1.0 / std::sqrt(sk + a.l2_eps));
      for (int64_t i = 0; i < dk; ++i) {
        q[t * dk + i] = qt[i] * iq;
        k[t * dk + i] = kt[i] * ik;
        kT[i * CL + t] = k[t * dk + i];
      }
      const float x = a.alpha[(t0 + t) * a.ab_stride + h] + a.dt_bias[h];
      const float sp = x > 20.f ? x : std::log1p(std::exp(x));  // softplus (torch's threshold)
      run += a.A[h] * sp;
      gc[t] = run;
      b[t] = 1.f / (1.f + std::exp(-a.beta[(t0 + t) * a.ab_stride + h]));
    }
    // Products with the state the chunk starts from, and the key / query Gram rows.
    std::fill(KS, KS + 2 * CL * dv, 0.f);  // KS and QS
    std::fill(KK, KK + 2 * CL * CL, 0.f);  // KK and QK
    mm_acc(k, dk, S, dv, KS, dv, L, dk, dv);
    mm_acc(q, dk, S, dv, QS, dv, L, dk, dv);
    mm_acc(k, dk, kT, CL, KK, CL, L, dk, L);
    mm_acc(q, dk, kT, CL, QK, CL, L, dk, L);
    // The solve, row by row: U_t = b_t (v_t - exp(gc_t) KS_t) - sum_{s<t} M[t][s] U_s.
    for (int64_t t = 0; t < L; ++t) {
      const float* vt = a.v + (t0 + t) * a.qkv_stride + h * dv;
      const float e = dexp(gc[t]);
      float* ut = U + t * dv;
      for (int64_t j = 0; j < dv; ++j) ut[j] = b[t] * (vt[j] - e * KS[t * dv + j]);
      for (int64_t s = 0; s < t; ++s) {
        const float m = b[t] * dexp(gc[t] - gc[s]) * KK[t * CL + s];
        const float* us = U + s * dv;
        for (int64_t j = 0; j < dv; ++j) ut[j] -= m * us[j];
      }
    }
    // out = exp(gc) QS + (decayed, causal QK) U; QK is masked in place, QS becomes the output.
    for (int64_t t = 0; t < L; ++t) {
      const float e = dexp(gc[t]);
      for (int64_t j = 0; j < dv; ++j) QS[t * dv + j] *= e;
      for (int64_t s = 0; s < L; ++s) QK[t * CL + s] = s <= t ? QK[t * CL + s] * dexp(gc[t] - gc[s]) : 0.f;
    }
    mm_acc(QK, CL, U, dv, QS, dv, L, L, dv);
    for (int64_t t = 0; t < L; ++t) std::copy(QS + t * dv, QS + (t + 1) * dv, a.out + (t0 + t) * a.out_stride + h * dv);
    // The state at the chunk's end.
    const float gl = gc[L - 1], el = dexp(gl);
    for (int64_t i = 0; i < dk * dv; ++i) S[i] *= el;
    for (int64_t t = 0; t < L; ++t) {
      const float e = dexp(gl - gc[t]);
      for (int64_t i = 0; i < dk; ++i) kT[i * CL + t] *= e;
    }
    mm_acc(kT, CL, U, dv, S, dv, dk, L, dv);
  }
}

}  // namespace dl::cpu::DL_ISA
