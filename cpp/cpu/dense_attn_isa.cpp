// Dense attention of an encoder (AttnArgs::any_order): every query row sees every key and no
// decode step will ever read these rows, so the sums may run in any order. Blocked like a
// GEMM: a head's K is packed once into transposed 64-key blocks, a block of query rows scores
// against 64 keys at a time in 6-row x 64-key register tiles, each row's softmax runs over
// all its keys at once (no chunk partials to combine), and P.V accumulates 6 rows x 64
// columns in registers over 64-key blocks (the block's V rows stay in L1 for every row tile).
// This is not attn_isa.cpp's order: a row's bits differ from what the paged kernel gives.
// AVX-512 only; other ISAs leave the table entry empty and run the paged kernel.
#include <algorithm>
#include <cmath>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "cpu/isa_kernels.h"
#include "cpu/vmath.h"

namespace dl::cpu::DL_ISA {

#if defined(__AVX512F__)
namespace {

constexpr int kRows = 6;   // query rows per register tile
constexpr int kKeyBlk = 64;  // keys per block (4 tiles of 16)

inline __mmask16 tail_mask(int64_t n) { return n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1); }

// Scores of kRows query rows (copied and scaled, qp[r][hd]) against one block of 64 keys
// (kt[d][64]). HD: head_dim when fixed at compile time (64: the rows are constant offsets from
// one pointer, none waits in a spilled register), 0 for any other. The block's first `valid`
// keys are real: their maxima join each row's running max (rmax[r][16]).
template <int HD>
inline void score_tile(const float* qp, const float* kt, int hd_rt, float* const* s, int nr, int64_t valid,
                       float* rmax) {
  const int hd = HD ? HD : hd_rt;
  __m512 acc[kRows][4];
  for (int r = 0; r < kRows; ++r)
    for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int d = 0; d < hd; ++d) {
    __m512 k[4];
    for (int v = 0; v < 4; ++v) k[v] = _mm512_loadu_ps(kt + d * kKeyBlk + 16 * v);
    for (int r = 0; r < kRows; ++r) {
      const __m512 x = _mm512_set1_ps(qp[r * hd + d]);
      for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_fmadd_ps(x, k[v], acc[r][v]);
    }
  }
  for (int r = 0; r < nr; ++r) {
    __m512 m = _mm512_loadu_ps(rmax + 16 * r);
    for (int v = 0; v < 4; ++v) {
      _mm512_storeu_ps(s[r] + 16 * v, acc[r][v]);
      if (valid > 16 * v) m = _mm512_mask_max_ps(m, tail_mask(valid - 16 * v), m, acc[r][v]);
    }
    _mm512_storeu_ps(rmax + 16 * r, m);
  }
}

// o[r][0 .. 16 NV) (+)= sum over keys j in [j0, j1) of p[r][j] * V[j][0 .. 16 NV); the last key
// block scales by inv[r] as it stores.
template <int NV>
inline void pv_tile(const float* v, int64_t v_stride, int64_t j0, int64_t j1, const float* const* p, float* const* o,
                    const float* inv, int nr, bool first, bool last) {
  __m512 acc[kRows][NV];
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < NV; ++c) acc[r][c] = first || r >= nr ? _mm512_setzero_ps() : _mm512_loadu_ps(o[r] + 16 * c);
  for (int64_t j = j0; j < j1; ++j) {
    __m512 x[NV];
    const float* vr = v + j * v_stride;
    for (int c = 0; c < NV; ++c) x[c] = _mm512_loadu_ps(vr + 16 * c);
    for (int r = 0; r < kRows; ++r) {
      const __m512 pr = _mm512_set1_ps(p[r][j]);
      for (int c = 0; c < NV; ++c) acc[r][c] = _mm512_fmadd_ps(pr, x[c], acc[r][c]);
    }
  }
  for (int r = 0; r < nr; ++r) {
    const __m512 sc = _mm512_set1_ps(last ? inv[r] : 1.f);
    for (int c = 0; c < NV; ++c) _mm512_storeu_ps(o[r] + 16 * c, last ? _mm512_mul_ps(acc[r][c], sc) : acc[r][c]);
  }
}

}  // namespace

void dense_attn_pack_k(const float* k, int64_t k_stride, int64_t n_kv, int hd, int64_t b0, int64_t b1, float* kt) {
  // Block b of 64 keys: kt[b][d][j] = K row 64 b + j, element d; keys past n_kv are zeros
  // (their scores are never read). 16 x 16 squares go through a buffer, column by column.
  for (int64_t b = b0; b < b1; ++b) {
    float* o = kt + (size_t)b * hd * kKeyBlk;
    for (int j0 = 0; j0 < kKeyBlk; j0 += 16) {
      const int64_t nj = std::max<int64_t>(0, std::min<int64_t>(16, n_kv - (kKeyBlk * b + j0)));
      for (int d0 = 0; d0 < hd; d0 += 16) {
        alignas(64) float blk[16][16];
        for (int j = 0; j < 16; ++j)
          _mm512_store_ps(blk[j], j < nj ? _mm512_loadu_ps(k + (kKeyBlk * b + j0 + j) * k_stride + d0)
                                         : _mm512_setzero_ps());
        for (int d = 0; d < 16; ++d) {
          alignas(64) float col[16];
          for (int j = 0; j < 16; ++j) col[j] = blk[j][d];
          _mm512_storeu_ps(o + (d0 + d) * kKeyBlk + j0, _mm512_load_ps(col));
        }
      }
    }
  }
}

size_t dense_attn_scratch(int64_t n_rows, int64_t n_kv, int hd) {
  const int64_t npad = (n_kv + kKeyBlk - 1) / kKeyBlk * kKeyBlk;
  return (size_t)(n_rows * npad + n_rows + (n_rows + kRows) * hd + (n_rows + kRows) * 16 + 16);
}

void dense_attn_rows(const DenseAttn& a) {
  const int hd = a.head_dim;
  const int64_t nr = a.n_rows, nkv = a.n_kv;
  const int64_t npad = (nkv + kKeyBlk - 1) / kKeyBlk * kKeyBlk;
  float* S = a.scratch;        // [nr][npad] scores, then probabilities
  float* inv = S + nr * npad;  // [nr] 1 / softmax denominators
  float* qp = inv + nr;        // [row tile][kRows][hd] the query rows, scaled
  float* rmax = qp + (nr + kRows) * hd;  // [nr][16] each row's running max, lane by lane
  for (int64_t i = 0; i < nr * 16; i += 16) _mm512_storeu_ps(rmax + i, _mm512_set1_ps(-INFINITY));
  // Row r of a tile beyond the block repeats the block's last row (computed, not stored).
  auto rows_of = [&](int64_t r0, float** s, float** o, int& n) {
    n = (int)std::min<int64_t>(kRows, nr - r0);
    for (int r = 0; r < kRows; ++r) {
      const int64_t rr = r0 + std::min(r, n - 1);
      if (s) s[r] = S + rr * npad;
      if (o) o[r] = a.out + rr * a.out_stride;
    }
  };
  for (int64_t r0 = 0; r0 < nr; r0 += kRows) {
    const int n = (int)std::min<int64_t>(kRows, nr - r0);
    float* t = qp + r0 * hd;
    const __m512 sc = _mm512_set1_ps(a.scale);
    for (int r = 0; r < kRows; ++r) {
      const float* q = a.q + (r0 + std::min(r, n - 1)) * a.q_stride;
      for (int d = 0; d < hd; d += 16) _mm512_storeu_ps(t + r * hd + d, _mm512_mul_ps(_mm512_loadu_ps(q + d), sc));
    }
  }
  // Scores: a block of 64 keys' K (16 KB at hd 64) stays in L1 while every row tile reads it.
  for (int64_t j0 = 0; j0 < npad; j0 += kKeyBlk) {
    const float* kt = a.kt + (size_t)j0 * hd;
    for (int64_t r0 = 0; r0 < nr; r0 += kRows) {
      float* s[kRows];
      int n;
      rows_of(r0, s, nullptr, n);
      for (int r = 0; r < kRows; ++r) s[r] += j0;
      if (hd == 64)
        score_tile<64>(qp + r0 * hd, kt, hd, s, n, nkv - j0, rmax + r0 * 16);
      else
        score_tile<0>(qp + r0 * hd, kt, hd, s, n, nkv - j0, rmax + r0 * 16);
    }
  }
  // Softmax of each row over its n_kv keys (the scores are scaled, their max known).
  for (int64_t r = 0; r < nr; ++r) {
    float* s = S + r * npad;
    const __m512 vmax = _mm512_set1_ps(_mm512_reduce_max_ps(_mm512_loadu_ps(rmax + 16 * r)));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < nkv; j += 16) {
      const __mmask16 m = tail_mask(nkv - j);
      const __m512 e = exp_neg16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + j), vmax));
      _mm512_mask_storeu_ps(s + j, m, e);
      sum = _mm512_mask_add_ps(sum, m, sum, e);
    }
    inv[r] = 1.f / _mm512_reduce_add_ps(sum);
  }
  // P.V over 64-key blocks: the block's V rows (16 KB at hd 64) stay in L1 for every row tile;
  // the outputs are the accumulators between blocks.
  for (int64_t j0 = 0; j0 < nkv; j0 += kKeyBlk) {
    const int64_t j1 = std::min(nkv, j0 + kKeyBlk);
    const bool first = j0 == 0, last = j1 == nkv;
    for (int64_t r0 = 0; r0 < nr; r0 += kRows) {
      const float* p[kRows];
      float* o[kRows];
      int n;
      rows_of(r0, nullptr, o, n);
      for (int r = 0; r < kRows; ++r) p[r] = S + (r0 + std::min(r, n - 1)) * npad;
      int dc = 0;
      for (; dc + 64 <= hd; dc += 64) {
        float* od[kRows];
        for (int r = 0; r < kRows; ++r) od[r] = o[r] + dc;
        pv_tile<4>(a.v + dc, a.v_stride, j0, j1, p, od, inv + r0, n, first, last);
      }
      for (; dc < hd; dc += 16) {
        float* od[kRows];
        for (int r = 0; r < kRows; ++r) od[r] = o[r] + dc;
        pv_tile<1>(a.v + dc, a.v_stride, j0, j1, p, od, inv + r0, n, first, last);
      }
    }
  }
}

#else

void dense_attn_pack_k(const float*, int64_t, int64_t, int, int64_t, int64_t, float*) {}
size_t dense_attn_scratch(int64_t, int64_t, int) { return 0; }
void dense_attn_rows(const DenseAttn&) {}

#endif

}  // namespace dl::cpu::DL_ISA
