// Attention of a block of query rows against one KV head, per ISA: scores for
// 16 keys at a time, softmax per row, then the value rows accumulated into the
// outputs. Many query rows (a prefill block) score against a transposed K tile
// (no horizontal sums); a few (a decode step) score the K rows where they lie and
// add lanes with shuffles, in the same order, so a row is the same bits either way.
// Rows are read through a page table (contiguous rows are one page), in the same
// order either way. f16 rows are converted as they are read (exactly), so no pass
// decodes the cache first and the bits are those of an f32 copy of it.
#pragma GCC optimize("fp-contract=fast")  // FMA where the ISA has it; results stay within the reference bars
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "cpu/isa_kernels.h"
#include "cpu/vmath.h"

namespace dl::cpu::DL_ISA {

namespace {

// n elements of a cache row as f32: the row itself (f32), or converted into buf (f16).
template <typename E>
inline const float* row_f32(const E* src, float* buf, int64_t n) {
  if constexpr (sizeof(E) == 4) {
    (void)buf;
    (void)n;
    return reinterpret_cast<const float*>(src);
  } else {
    f16_to_f32(src, buf, n);
    return buf;
  }
}

#if defined(__AVX512F__)
// Explicit registers where the compiler's vectorizer kept the accumulators on the stack.
template <typename E>
inline __m512 load16(const E* p) {
  if constexpr (sizeof(E) == 4)
    return _mm512_loadu_ps(reinterpret_cast<const float*>(p));
  else
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// In-register transpose of 16 rows of 16 floats (unpack, 4x4 shuffles, then 128-bit lanes).
inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int h = 0; h < 16; h += 8)
    for (int i = 0; i < 4; ++i) {
      t[h + i] = _mm512_shuffle_f32x4(r[h + i], r[h + i + 4], 0x88);
      t[h + i + 4] = _mm512_shuffle_f32x4(r[h + i], r[h + i + 4], 0xdd);
    }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
  }
}

// Kt[d][j] = K row j, element d, for 16 key rows and hd a multiple of 16.
template <typename E>
inline void k_tile(const E* const* rows, int hd, float* Kt) {
  for (int d0 = 0; d0 < hd; d0 += 16) {
    __m512 r[16];
    for (int j = 0; j < 16; ++j) r[j] = load16(rows[j] + d0);
    transpose16(r);
    for (int i = 0; i < 16; ++i) _mm512_storeu_ps(Kt + (d0 + i) * 16, r[i]);
  }
}

// Scores of QR query rows against a transposed K tile of 16 keys, any head_dim: one
// FMA chain over d per key.
template <int QR>
inline void score_rows_seq(const float* const* q, const float* Kt, int hd, float (*out)[16]) {
  __m512 acc[QR];
  for (int i = 0; i < QR; ++i) acc[i] = _mm512_setzero_ps();
  for (int d = 0; d < hd; ++d) {
    const __m512 kt = _mm512_loadu_ps(Kt + d * 16);
    for (int i = 0; i < QR; ++i) acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(q[i][d]), kt, acc[i]);
  }
  for (int i = 0; i < QR; ++i) _mm512_storeu_ps(out[i], acc[i]);
}

// head_dim a multiple of 16: a score is summed in the order a dot product of whole
// vectors gives without any transpose. Element d goes to partial sum l = d % 16 (one
// FMA chain each, from zero); the 16 partials then add as
//   s_g = (p[4g] + p[4g+2]) + (p[4g+1] + p[4g+3]),  score = (s_0 + s_1) + (s_2 + s_3).
// score_tile (many query rows, K transposed: partials are vectors over keys) and
// score_direct_rows (a few rows, K rows as they lie: partials are lanes, reduce16 adds them)
// both sum in exactly this order, so a row's scores are the same bits on either path.
// Scores go straight into the rows' score arrays (out[i], the first `keep` lanes; rows i >= nr
// are computed, not stored). HD: head_dim fixed at compile time (the c loop unrolled), or 0.
template <int QR, int HD = 0>
inline void score_tile(const float* const* q, const float* Kt, int hd_rt, float* const* out, int nr, __mmask16 keep) {
  const int hd = HD ? HD : hd_rt;
  __m512 t01[QR], s0[QR];
  for (int g = 0; g < 4; ++g) {
    __m512 p[QR][4];
    for (int i = 0; i < QR; ++i)
      for (int e = 0; e < 4; ++e) p[i][e] = _mm512_setzero_ps();
    for (int c = 0; c < hd; c += 16)
      for (int e = 0; e < 4; ++e) {
        const int d = c + 4 * g + e;
        const __m512 kt = _mm512_loadu_ps(Kt + d * 16);
        for (int i = 0; i < QR; ++i) p[i][e] = _mm512_fmadd_ps(_mm512_set1_ps(q[i][d]), kt, p[i][e]);
      }
    for (int i = 0; i < QR; ++i) {
      const __m512 sg = _mm512_add_ps(_mm512_add_ps(p[i][0], p[i][2]), _mm512_add_ps(p[i][1], p[i][3]));
      if (g == 0 || g == 2) {
        s0[i] = sg;
      } else if (g == 1) {
        t01[i] = _mm512_add_ps(s0[i], sg);
      } else if (i < nr) {
        _mm512_mask_storeu_ps(out[i], keep, _mm512_add_ps(t01[i], _mm512_add_ps(s0[i], sg)));
      }
    }
  }
}

// a[j]'s 16 lanes summed in score_tile's order, into lane j of the result.
inline __m512 reduce16(const __m512* a) {
  __m512 x[8], y[4];
  // Lanes l and l + 2 of each group of four: [a(0+2), b(0+2), a(1+3), b(1+3)] per 128 bits.
  for (int k = 0; k < 8; ++k)
    x[k] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * k], a[2 * k + 1]), _mm512_unpackhi_ps(a[2 * k], a[2 * k + 1]));
  // The group sums s_g of keys 4k .. 4k + 3, group g in 128-bit lane g.
  for (int k = 0; k < 4; ++k)
    y[k] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * k], x[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(x[2 * k], x[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // s_0 + s_1 and s_2 + s_3, then their sum; key j ends in lane j.
  const __m512 z0 = _mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], 0x88), _mm512_shuffle_f32x4(y[0], y[1], 0xdd));
  const __m512 z1 = _mm512_add_ps(_mm512_shuffle_f32x4(y[2], y[3], 0x88), _mm512_shuffle_f32x4(y[2], y[3], 0xdd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(z0, z1, 0x88), _mm512_shuffle_f32x4(z0, z1, 0xdd));
}

// Scores of NQ query rows against 16 key rows read where they lie (no transpose), into out[i].
// Each K vector is loaded (and converted from f16) once for all the rows (a decode step's
// query heads of one KV head); each (row, key) is one FMA chain of lane partials, then reduce16.
template <typename E, int NQ>
inline void score_direct_rows(const float* const* q, const E* const* rows, int hd, __m512* out) {
  __m512 part[NQ][16];
  for (int j0 = 0; j0 < 16; j0 += 4) {
    __m512 a[NQ][4];
    for (int i = 0; i < NQ; ++i)
      for (int j = 0; j < 4; ++j) a[i][j] = _mm512_setzero_ps();
    for (int c = 0; c < hd; c += 16) {
      __m512 k[4];
      for (int j = 0; j < 4; ++j) k[j] = load16(rows[j0 + j] + c);
      for (int i = 0; i < NQ; ++i) {
        const __m512 qv = _mm512_loadu_ps(q[i] + c);
        for (int j = 0; j < 4; ++j) a[i][j] = _mm512_fmadd_ps(qv, k[j], a[i][j]);
      }
    }
    for (int i = 0; i < NQ; ++i)
      for (int j = 0; j < 4; ++j) part[i][j0 + j] = a[i][j];
  }
  for (int i = 0; i < NQ; ++i) out[i] = reduce16(part[i]);
}

// out[i][dc .. dc + 16 NV) = sum over keys j in [lo[i], hi[i]) of s[i][j] * V[j], keys in order.
// Row j + 1 of a page lies vstride elements after row j; page_end(j) is one past j's page's last key.
// resume: the sums go on from what o holds (the keys before jmin, summed by an earlier call in
// the same order: a store and a load change no bits). pf_bytes > 0: the first pass over a block
// of keys asks for that many bytes of the row kPfRows keys ahead (the later passes read them from cache).
constexpr int kPfRows = 16;
template <typename E, int RR, int NV, class VRow, class PageEnd>
__attribute__((always_inline)) inline void accumulate_v(const VRow& vrow, const PageEnd& page_end, int64_t vstride, int64_t jmin, int64_t jmax,
                         const int64_t* lo, const int64_t* hi, const float* const* s, float* const* o, int nr, int dc,
                         bool paged, bool resume = false, int pf_bytes = 0) {
  __m512 acc[RR][NV];
  for (int i = 0; i < RR; ++i)
    for (int c = 0; c < NV; ++c)
      acc[i][c] = resume && i < nr ? _mm512_loadu_ps(o[i] + dc + 16 * c) : _mm512_setzero_ps();
  auto load = [&](int64_t j, __m512* v) {
    const E* vr = vrow(j) + dc;
    // Rows come from pages far apart in memory; ask for one a few keys ahead. (Rows of one
    // page are evenly spaced: the hardware prefetcher follows them, and the hints cost more.)
    if (paged && j + 8 < jmax) {
      const char* pf = reinterpret_cast<const char*>(vrow(j + 8) + dc);
      for (int l = 0; l < NV * 16 * (int)sizeof(E); l += 64) _mm_prefetch(pf + l, _MM_HINT_T0);
    }
    for (int c = 0; c < NV; ++c) v[c] = load16(vr + 16 * c);
  };
  // Keys every row of the group sees, [jall_lo, jall_hi): no per-row tests there, whose
  // compares and branches would take ports the FMAs need (a chunk wholly before a prefill
  // block is all of it; the block's own chunk most of it). Same sums in the same order.
  int64_t jall_lo = jmin, jall_hi = jmax;
  for (int i = 0; i < RR; ++i) {
    jall_lo = std::max(jall_lo, lo[i]);
    jall_hi = std::min(jall_hi, hi[i]);
  }
  if (nr < RR || jall_lo >= jall_hi) jall_lo = jall_hi = jmax;
  auto checked = [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j) {
      __m512 v[NV];
      load(j, v);
      for (int i = 0; i < RR; ++i) {
        if (j < lo[i] || j >= hi[i]) continue;
        const __m512 p = _mm512_set1_ps(s[i][j]);
        for (int c = 0; c < NV; ++c) acc[i][c] = _mm512_fmadd_ps(p, v[c], acc[i][c]);
      }
    }
  };
  checked(jmin, jall_lo);
  // Page by page, a row pointer stepped by the stride: a page lookup per key took registers
  // enough that an accumulator was kept on the stack, its FMA chain through a store and load.
  for (int64_t j = jall_lo; j < jall_hi;) {
    const int64_t je = std::min(jall_hi, page_end(j));
    if (paged)  // the next page lies elsewhere in memory: its first rows are asked for now
      for (int64_t k = je; k < std::min(jmax, je + (pf_bytes ? kPfRows : 8)); ++k) {
        const char* pf = reinterpret_cast<const char*>(vrow(k) + dc);
        for (int l = 0; l < (pf_bytes ? pf_bytes : NV * 16 * (int)sizeof(E)); l += 64) _mm_prefetch(pf + l, _MM_HINT_T0);
      }
    const int64_t pf_end = pf_bytes ? page_end(j) - kPfRows : j;  // rows ahead in this page
    for (const E* vr = vrow(j) + dc; j < je; ++j, vr += vstride) {
      if (j < pf_end)
        for (int l = 0; l < pf_bytes; l += 64) _mm_prefetch(reinterpret_cast<const char*>(vr + kPfRows * vstride) + l, _MM_HINT_T0);
      __m512 v[NV];
      for (int c = 0; c < NV; ++c) v[c] = load16(vr + 16 * c);
      for (int i = 0; i < RR; ++i) {
        const __m512 p = _mm512_set1_ps(s[i][j]);
        for (int c = 0; c < NV; ++c) acc[i][c] = _mm512_fmadd_ps(p, v[c], acc[i][c]);
      }
    }
  }
  checked(jall_hi, jmax);
  for (int i = 0; i < nr; ++i)
    for (int c = 0; c < NV; ++c) _mm512_storeu_ps(o[i] + dc + 16 * c, acc[i][c]);
}
#endif

// The portable accumulate_v: TD dims per pass in an array the compiler vectorizes.
template <typename E, int RR, int TD, class VRow>
inline void accumulate_v_generic(const VRow& vrow, int64_t jmin, int64_t jmax, const int64_t* lo, const int64_t* hi,
                                 const float* const* s, float* const* o, int nr, int dc, float* cbuf) {
  float acc[RR][TD] = {};
  for (int64_t j = jmin; j < jmax; ++j) {
    const float* v = row_f32(vrow(j) + dc, cbuf, TD);
    for (int i = 0; i < RR; ++i) {
      if (j < lo[i] || j >= hi[i]) continue;
      const float pj = s[i][j];
      for (int e = 0; e < TD; ++e) acc[i][e] += pj * v[e];
    }
  }
  for (int i = 0; i < nr; ++i) std::memcpy(o[i] + dc, acc[i], sizeof(acc[i]));
}

// One key chunk [k0, k1) (inside chunk c of kAttnChunk keys) for every row of the block:
// row r's partial at part + r * part_stride is [m, l, o[hd]]: the max of its visible scores
// in the chunk (-inf if none), the sum of exp(s - m), and the sum of exp(s - m) * V rows.
// What a row gets depends only on its position and the chunk, not on the other rows.
template <typename E>
void attn_chunk(const AttnBlock& b, int64_t k0, int64_t k1, float* part, int64_t part_stride) {
  const int G = b.group, hd = b.head_dim;
  const int64_t nq = b.n_rows;
  const int64_t j_lo = k0, j_hi = k1;
  const int64_t nj = std::max<int64_t>(0, j_hi - j_lo);
  const int64_t nqg = nq * G;
  const int sh = b.page_shift;
  const int64_t mask = (int64_t(1) << sh) - 1;
  auto krow = [&](int64_t j) { return (const E*)(b.k_pages[j >> sh] + b.k_off) + (j & mask) * b.kv_stride; };
  auto vrow = [&](int64_t j) { return (const E*)(b.v_pages[j >> sh] + b.v_off) + (j & mask) * b.kv_stride; };
  float* S = b.scratch;            // [nq*G][nj] scores, then probabilities
  float* Kt = S + nqg * nj;        // [hd][16] one transposed K tile
  float* cbuf = Kt + hd * 16;      // [hd] one converted f16 K row or V segment
  constexpr int TJ = 16;
  // Query row addresses, worked out once here: a division by G per row and pass cost about
  // as much as the pass's FMAs.
  constexpr int64_t kQRows = 256;
  const float* qrows[kQRows];
  for (int64_t r = 0, t = 0, h = 0; r < std::min(nqg, kQRows); ++r) {
    qrows[r] = b.q + t * b.q_stride + h * hd;
    if (++h == G) h = 0, ++t;
  }
  auto qrow = [&](int64_t r) { return r < kQRows ? qrows[r] : b.q + (r / G) * b.q_stride + (r % G) * hd; };
  // The same, padded with the last row to a multiple of 4 (a score pass's rows).
  const float* qpad[kQRows + 4];
  for (int64_t r = 0; r < std::min(nqg, kQRows) + 4; ++r) qpad[r] = qrows[std::min(r, std::min(nqg, kQRows) - 1)];
  // The call's converted rows, when they cover this chunk and its tiles line up with them.
  const bool conv = b.kt32 && nj > 0 && j_lo >= b.kv32_lo && j_hi <= b.kv32_hi;
  const float* kt32 = conv && (j_lo - b.kv32_lo) % TJ == 0 ? b.kt32 + (j_lo - b.kv32_lo) * hd : nullptr;
  const float* v32 = conv ? b.v32 + (j_lo - b.kv32_lo) * hd : nullptr;
  auto range = [&](int64_t r, int64_t& lo, int64_t& hi) {
    // Row r sees keys j <= p inside the window; the rest of the chunk is masked.
    const int64_t p = b.pos[r / G];
    lo = std::max<int64_t>(b.window > 0 ? std::max<int64_t>(0, p - b.window + 1) : 0, j_lo) - j_lo;
    hi = std::min<int64_t>(std::min<int64_t>(b.n_kv, p + 1), j_hi) - j_lo;
    hi = std::max(hi, lo);
  };
  // Row r's scores scaled, their max, exp and sum into its partial. One copy of the code (not
  // inlined) serves every path, so a row's softmax is the same instructions however it was scored.
  auto softmax_row = [&](int64_t r) __attribute__((noinline)) {
    float* s = S + r * nj;
    float* pr = part + r * part_stride;
    int64_t lo, hi;
    range(r, lo, hi);
    // The max is exact in any order.
    float mx = -INFINITY;
    int64_t j = lo;
#if defined(__AVX512F__)
    if (!(b.softcap > 0)) {
      // Scaled and their max in one pass, in two max chains (one chain waited out every max).
      const __m512 sc = _mm512_set1_ps(b.scale);
      __m512 m0 = _mm512_set1_ps(-INFINITY), m1 = m0;
      for (; j + 2 * TJ <= hi; j += 2 * TJ) {
        const __m512 x0 = _mm512_mul_ps(_mm512_loadu_ps(s + j), sc), x1 = _mm512_mul_ps(_mm512_loadu_ps(s + j + TJ), sc);
        _mm512_storeu_ps(s + j, x0);
        _mm512_storeu_ps(s + j + TJ, x1);
        m0 = _mm512_max_ps(m0, x0);
        m1 = _mm512_max_ps(m1, x1);
      }
      if (j < hi) {
        const __mmask16 k = (__mmask16)(hi - j >= TJ ? 0xFFFF : (1u << (hi - j)) - 1);
        const __m512 x = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, s + j), sc);
        _mm512_mask_storeu_ps(s + j, k, x);
        m0 = _mm512_mask_max_ps(m0, k, m0, x);
        j += TJ;
      }
      if (j < hi) {  // a last 16 or fewer after a full 16
        const __mmask16 k = (__mmask16)(hi - j >= TJ ? 0xFFFF : (1u << (hi - j)) - 1);
        const __m512 x = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, s + j), sc);
        _mm512_mask_storeu_ps(s + j, k, x);
        m1 = _mm512_mask_max_ps(m1, k, m1, x);
      }
      j = hi;
      mx = _mm512_reduce_max_ps(_mm512_max_ps(m0, m1));
    } else {
      for (; j < hi; ++j) s[j] = b.softcap * std::tanh(s[j] * b.scale / b.softcap);
      j = lo;
      __m512 mv = _mm512_set1_ps(-INFINITY);
      for (; j + TJ <= hi; j += TJ) mv = _mm512_max_ps(mv, _mm512_loadu_ps(s + j));
      mx = _mm512_reduce_max_ps(mv);
    }
#else
    if (b.softcap > 0) {
      for (int64_t i = lo; i < hi; ++i) s[i] = b.softcap * std::tanh(s[i] * b.scale / b.softcap);
    } else {
      for (int64_t i = lo; i < hi; ++i) s[i] *= b.scale;
    }
    float mxl[TJ];
    std::fill(mxl, mxl + TJ, -INFINITY);
    for (; j + TJ <= hi; j += TJ)
      for (int e = 0; e < TJ; ++e) mxl[e] = mxl[e] > s[j + e] ? mxl[e] : s[j + e];
    for (int e = 0; e < TJ; ++e) mx = std::max(mx, mxl[e]);
#endif
    for (; j < hi; ++j) mx = std::max(mx, s[j]);
    pr[0] = mx;
    if (hi == lo) {
      pr[1] = 0.f;
      return;
    }
    float suml[TJ] = {0};
    for (j = lo; j + TJ <= hi; j += TJ)
      for (int e = 0; e < TJ; ++e) suml[e] += s[j + e] = exp_neg(s[j + e] - mx);
    float sum = 0;
    for (; j < hi; ++j) sum += s[j] = exp_neg(s[j] - mx);
    for (int e = 0; e < TJ; ++e) sum += suml[e];
    pr[1] = sum;
  };
  bool soft_done = false;
#if defined(__AVX512F__)
  // A few query rows (a decode step): score K rows where they lie, no transposed tile.
  if (hd % 16 == 0 && nqg <= 4) {
    for (int64_t jb = 0; jb < nj; jb += TJ) {
      const int64_t tj = std::min<int64_t>(TJ, nj - jb);
      const E* rows[TJ];
      for (int64_t j = 0; j < TJ; ++j) rows[j] = krow(j_lo + jb + std::min<int64_t>(j, tj - 1));
      // The next tile's rows, into L2: T0 prefetches held the L1's miss buffers that the
      // loads need and stalled there (the 3 global layers' K at depth 16384: 4.4 -> 2.3 ms).
      for (int64_t j = jb + TJ; j < std::min(nj, jb + 2 * TJ); ++j) {
        const char* pf = reinterpret_cast<const char*>(krow(j_lo + j));
        for (int l = 0; l < hd * (int)sizeof(E); l += 64) _mm_prefetch(pf + l, _MM_HINT_T1);
      }
      const float* q[4];
      for (int64_t r = 0; r < nqg; ++r) q[r] = qrow(r);
      __m512 sc[4];
      switch (nqg) {
        case 1: score_direct_rows<E, 1>(q, rows, hd, sc); break;
        case 2: score_direct_rows<E, 2>(q, rows, hd, sc); break;
        case 3: score_direct_rows<E, 3>(q, rows, hd, sc); break;
        default: score_direct_rows<E, 4>(q, rows, hd, sc); break;
      }
      for (int64_t r = 0; r < nqg; ++r) _mm512_mask_storeu_ps(S + r * nj + jb, (__mmask16)((1u << tj) - 1), sc[r]);
    }
  } else if (kt32 && hd % 16 == 0 && nqg <= kQRows && nj * hd <= 65536) {
    // The call's converted K tiles (the chunk's, up to 256 KB: L2): row group by row group, each
    // streaming the chunk's tiles from L2 with its 4 query rows in L1 (tile by tile over all the
    // rows, those rows and the tile outgrew L1). Each score is the same sum as below.
    constexpr int QR = 4;
    for (int64_t r0 = 0; r0 < nqg; r0 += QR) {
      float* out[QR];
      for (int i = 0; i < QR; ++i) out[i] = S + std::min(r0 + i, nqg - 1) * nj;
      const int nr = (int)std::min<int64_t>(QR, nqg - r0);
      for (int64_t jb = 0; jb < nj; jb += TJ) {
        const __mmask16 keep = (__mmask16)((1u << std::min<int64_t>(TJ, nj - jb)) - 1);
        if (hd == 64)
          score_tile<QR, 64>(qpad + r0, kt32 + jb * hd, hd, out, nr, keep);
        else
          score_tile<QR>(qpad + r0, kt32 + jb * hd, hd, out, nr, keep);
        for (int i = 0; i < QR; ++i) out[i] += TJ;
      }
      // Its rows' softmax now, while their scores are in L1.
      for (int i = 0; i < nr; ++i) softmax_row(r0 + i);
    }
    soft_done = true;
  } else
#endif
  for (int64_t jb = 0; jb < nj; jb += TJ) {
    const int64_t tj = std::min<int64_t>(TJ, nj - jb);
    // Past the last key, the tile repeats it (its scores are not stored).
    const float* kt = Kt;
#if defined(__AVX512F__)
    if (kt32) {
      kt = kt32 + jb * hd;  // the call's converted tile
    } else if (hd % 16 == 0) {
      const E* rows[TJ];
      for (int64_t j = 0; j < TJ; ++j) rows[j] = krow(j_lo + jb + std::min<int64_t>(j, tj - 1));
      k_tile(rows, hd, Kt);
    } else
#endif
      for (int64_t j = 0; j < TJ; ++j) {
        const float* kr = row_f32(krow(j_lo + jb + std::min<int64_t>(j, tj - 1)), cbuf, hd);
        for (int d = 0; d < hd; ++d) Kt[d * TJ + j] = kr[d];
      }
    // QR query rows per pass: independent FMA chains share each K tile row.
    constexpr int QR = 4;
#if defined(__AVX512F__)
    if (hd % 16 == 0 && nqg <= kQRows) {
      // Row addresses from the padded table (no division per pass), scores stored in place.
      const __mmask16 keep = (__mmask16)((1u << tj) - 1);
      for (int64_t r0 = 0; r0 < nqg; r0 += QR) {
        float* out[QR];
        for (int i = 0; i < QR; ++i) out[i] = S + std::min(r0 + i, nqg - 1) * nj + jb;
        const int nr = (int)std::min<int64_t>(QR, nqg - r0);
        if (hd == 64)
          score_tile<QR, 64>(qpad + r0, kt, hd, out, nr, keep);
        else
          score_tile<QR>(qpad + r0, kt, hd, out, nr, keep);
      }
      continue;
    }
#endif
    for (int64_t r0 = 0; r0 < nqg; r0 += QR) {
      const float* q[QR];
      for (int i = 0; i < QR; ++i) q[i] = qrow(std::min(r0 + i, nqg - 1));
      float acc[QR][TJ];
#if defined(__AVX512F__)
      if (hd % 16 == 0) {
        float* out[QR];
        for (int i = 0; i < QR; ++i) out[i] = acc[i];
        score_tile<QR>(q, kt, hd, out, QR, (__mmask16)0xFFFF);
      } else {
        score_rows_seq<QR>(q, kt, hd, acc);
      }
#else
      std::memset(acc, 0, sizeof(acc));
      for (int d = 0; d < hd; ++d) {
        const float* ktd = kt + d * TJ;
        for (int i = 0; i < QR; ++i) {
          const float qd = q[i][d];
          for (int j = 0; j < TJ; ++j) acc[i][j] += qd * ktd[j];
        }
      }
#endif
#if defined(__AVX512F__)
      // A masked vector store: memcpy of a variable length became `rep movs`, a tenth of the time.
      const __mmask16 keep = (__mmask16)((1u << tj) - 1);
      for (int i = 0; i < QR && r0 + i < nqg; ++i) _mm512_mask_storeu_ps(S + (r0 + i) * nj + jb, keep, _mm512_loadu_ps(acc[i]));
#else
      for (int i = 0; i < QR && r0 + i < nqg; ++i) std::memcpy(S + (r0 + i) * nj + jb, acc[i], (size_t)tj * 4);
#endif
    }
  }
  if (!soft_done)
    for (int64_t r = 0; r < nqg; ++r) softmax_row(r);
  // Values: four rows at a time share each V row they read (and its conversion from
  // f16); each output element still sums its row's keys in key order.
  constexpr int RR = 4;
  int64_t lo[RR], hi[RR];
  const float* s[RR];
  float* o[RR];
  int64_t jmin, jmax;
  auto rows_of = [&](int64_t r0, int nr) {
    jmin = nj;
    jmax = 0;
    for (int i = 0; i < RR; ++i) {
      const int64_t r = r0 + std::min(i, nr - 1);
      range(r, lo[i], hi[i]);
      if (i >= nr) hi[i] = lo[i];  // padding rows take no keys
      jmin = std::min(jmin, lo[i]);
      jmax = std::max(jmax, hi[i]);
      s[i] = S + r * nj;
      o[i] = part + r * part_stride + 2;
    }
  };
#if defined(__AVX512F__)
  if constexpr (sizeof(E) == 2) {
    if (hd % 16 == 0 && nqg > RR) {
      // Many row groups (a prefill block) each read every V row of the chunk: 64 columns of
      // the chunk's rows are converted to f32 once (exact, so the sums are the same bits),
      // then every group reads them as contiguous f32 rows: no conversion, page lookup or
      // prefetch per group and key.
      int64_t ulo = nj, uhi = 0;
      for (int64_t r = 0; r < nqg; ++r) {
        int64_t l, h;
        range(r, l, h);
        if (h > l) {
          ulo = std::min(ulo, l);
          uhi = std::max(uhi, h);
        }
      }
      float* vf = cbuf + hd;  // [nj][w]
      for (int dc = 0; dc < hd;) {
        const int w = hd - dc >= 64 ? 64 : 16;
        // The call's converted rows (v32: whole rows of hd) or this chunk's columns, converted here.
        const float* vbase = v32 ? v32 + dc : vf;
        const int64_t vs = v32 ? hd : w;
        if (!v32)
          for (int64_t j = ulo; j < uhi; ++j) {
            const E* src = vrow(j_lo + j) + dc;
            for (int c = 0; c < w; c += 16) _mm512_storeu_ps(vf + j * w + c, load16(src + c));
          }
        auto vf_row = [&](int64_t j) { return vbase + j * vs; };
        auto vf_end = [](int64_t) { return INT64_MAX; };
        for (int64_t r0 = 0; r0 < nqg; r0 += RR) {
          const int nr = (int)std::min<int64_t>(RR, nqg - r0);
          rows_of(r0, nr);
          float* od[RR];
          for (int i = 0; i < RR; ++i) od[i] = o[i] + dc;
          if (w == 64)
            accumulate_v<float, RR, 4>(vf_row, vf_end, vs, jmin, jmax, lo, hi, s, od, nr, 0, false);
          else
            accumulate_v<float, RR, 1>(vf_row, vf_end, vs, jmin, jmax, lo, hi, s, od, nr, 0, false);
        }
        dc += w;
      }
      return;
    }
  }
#endif
  for (int64_t r0 = 0; r0 < nqg; r0 += RR) {
    const int nr = (int)std::min<int64_t>(RR, nqg - r0);
    rows_of(r0, nr);
    int dc = 0;
    auto vr_of = [&](int64_t j) { return vrow(j_lo + j); };
#if defined(__AVX512F__)
    const bool paged = b.page_shift < 62;
    auto page_end = [&](int64_t j) { return (((j_lo + j) >> sh) + 1 << sh) - j_lo; };
    // Keys in blocks of 64 KB of V: every 64-column pass over a block after the first reads
    // it from cache, the first having asked for whole rows ahead. Passes over the whole chunk
    // each read a 128-byte slice of every row from memory (3.4-4.1 -> 2.2-2.4 ms for the 3 global
    // layers' V at depth 16384). Each output still sums its keys in order, in one chain.
    const int64_t kb_keys = std::max<int64_t>(16, 65536 / (hd * (int64_t)sizeof(E)));
    const int pf = hd > 64 && nqg <= RR ? hd * (int)sizeof(E) : 0;  // many row groups: later groups read from cache
    for (int64_t kb = jmin;; kb += kb_keys) {
      const int64_t ke = std::min(jmax, kb + kb_keys);
      const bool more = kb > jmin;
      dc = 0;
    // As many accumulator rows as there are rows (a decode task's one to three query heads):
    // no padding rows tested at every key.
#define DL_ACC_V(R)                                                                                           \
  for (; dc + 64 <= hd; dc += 64)                                                                            \
    accumulate_v<E, R, 4>(vr_of, page_end, b.kv_stride, kb, ke, lo, hi, s, o, nr, dc, paged, more, dc ? 0 : pf); \
  for (; dc + 16 <= hd; dc += 16)                                                                            \
    accumulate_v<E, R, 1>(vr_of, page_end, b.kv_stride, kb, ke, lo, hi, s, o, nr, dc, paged, more, dc ? 0 : pf);
      switch (nr) {
        case 1: DL_ACC_V(1) break;
        case 2: DL_ACC_V(2) break;
        case 3: DL_ACC_V(3) break;
        default: DL_ACC_V(RR) break;
      }
#undef DL_ACC_V
      if (ke >= jmax) break;
    }
#else
    for (; dc + 32 <= hd; dc += 32) accumulate_v_generic<E, RR, 32>(vr_of, jmin, jmax, lo, hi, s, o, nr, dc, cbuf);
    for (; dc + 16 <= hd; dc += 16) accumulate_v_generic<E, RR, 16>(vr_of, jmin, jmax, lo, hi, s, o, nr, dc, cbuf);
#endif
    for (; dc < hd; ++dc)
      for (int i = 0; i < nr; ++i) {
        float acc = 0;
        for (int64_t j = lo[i]; j < hi[i]; ++j) acc += s[i][j] * *row_f32(vrow(j_lo + j) + dc, cbuf, 1);
        o[i][dc] = acc;
      }
  }
}

// Chunk partials, or (part == nullptr) the whole attention: every chunk's partials into the
// scratch, then attn_combine per row, the same function the backend calls on partials from
// tasks split over keys, so a row is the same bits however its keys were split.
template <typename E>
void attn_block_t(const AttnBlock& b) {
  const int G = b.group, hd = b.head_dim;
  const int64_t nqg = b.n_rows * G;
  int32_t pmin = b.pos[0], pmax = b.pos[0];
  for (int64_t t = 1; t < b.n_rows; ++t) {
    pmin = std::min(pmin, b.pos[t]);
    pmax = std::max(pmax, b.pos[t]);
  }
  // Keys any row of the block may see, and their chunks.
  const int64_t j_hi = std::min<int64_t>(b.n_kv, (int64_t)pmax + 1);
  const int64_t j_lo = b.window > 0 ? std::max<int64_t>(0, (int64_t)pmin - b.window + 1) : 0;
  const int64_t pw = hd + 2;
  if (b.part) {
    const int64_t stride = b.part_stride > 0 ? b.part_stride : (b.c_hi - b.c_lo) * pw;
    for (int64_t c = b.c_lo; c < b.c_hi; ++c) {
      const int64_t k0 = std::max(j_lo, c * kAttnChunk), k1 = std::min(j_hi, (c + 1) * kAttnChunk);
      attn_chunk<E>(b, k0, std::max(k0, k1), b.part + (c - b.c_lo) * pw, stride);
    }
    return;
  }
  const int64_t c_lo = j_lo / kAttnChunk, c_hi = std::max(c_lo + 1, (j_hi + kAttnChunk - 1) / kAttnChunk);
  const int64_t nch = c_hi - c_lo;
  float* part = b.scratch + attn_block_scratch(b.n_rows, G, hd, 0);
  for (int64_t c = c_lo; c < c_hi; ++c) {
    const int64_t k0 = std::max(j_lo, c * kAttnChunk), k1 = std::min(j_hi, (c + 1) * kAttnChunk);
    attn_chunk<E>(b, k0, std::max(k0, k1), part + (c - c_lo) * pw, nch * pw);
  }
  for (int64_t r = 0; r < nqg; ++r)
    attn_combine(part + r * nch * pw, nch, hd, b.sinks ? b.sinks + r % G : nullptr,
                 b.out + (r / G) * b.out_stride + (r % G) * hd);
}

}  // namespace

void attn_block(const AttnBlock& b) {
  if (b.kv_f16)
    attn_block_t<uint16_t>(b);
  else
    attn_block_t<float>(b);
}

#if defined(__AVX512F__)
void attn_kv_f32(const AttnBlock& b, int64_t j0, int64_t j1, float* kt, float* v) {
  const int hd = b.head_dim;
  const int sh = b.page_shift;
  const int64_t mask = (int64_t(1) << sh) - 1;
  auto krow = [&](int64_t j) { return (const uint16_t*)(b.k_pages[j >> sh] + b.k_off) + (j & mask) * b.kv_stride; };
  auto vrow = [&](int64_t j) { return (const uint16_t*)(b.v_pages[j >> sh] + b.v_off) + (j & mask) * b.kv_stride; };
  for (int64_t t = j0; t < j1; t += 16) {
    // Past the last key the tile repeats it, as attn_chunk's own tiles do (never stored).
    const uint16_t* rows[16];
    for (int j = 0; j < 16; ++j) rows[j] = krow(std::min(t + j, b.n_kv - 1));
    k_tile(rows, hd, kt + (t - b.kv32_lo) * hd);
    for (int64_t j = t; j < std::min(t + 16, std::min(j1, b.n_kv)); ++j) {
      const uint16_t* src = vrow(j);
      float* dst = v + (j - b.kv32_lo) * hd;
      for (int c = 0; c < hd; c += 16) _mm512_storeu_ps(dst + c, load16(src + c));
    }
  }
}
#else
void attn_kv_f32(const AttnBlock&, int64_t, int64_t, float*, float*) {}
#endif

// Chunks in key order: a running max M, the sum L of l * exp(m - M) and the outputs
// o * exp(m - M) rescaled as M grows; a chunk the row sees nothing of is skipped. The
// sink's logit joins the denominator last.
void attn_combine(const float* part, int64_t n_chunks, int hd, const float* sink, float* out) {
  float M = -INFINITY, L = 0.f;
  for (int64_t c = 0; c < n_chunks; ++c) {
    const float* p = part + c * (hd + 2);
    if (p[0] == -INFINITY) continue;
    if (M == -INFINITY) {
      M = p[0];
      L = p[1];
      std::memcpy(out, p + 2, sizeof(float) * (size_t)hd);
      continue;
    }
    const float m = std::max(M, p[0]), a = exp_neg(M - m), e = exp_neg(p[0] - m);
    L = L * a + p[1] * e;
    for (int d = 0; d < hd; ++d) out[d] = out[d] * a + p[2 + d] * e;
    M = m;
  }
  if (M == -INFINITY) {  // no key visible (only a sink): nothing to average
    std::fill(out, out + hd, 0.f);
    return;
  }
  if (sink) {
    const float m = std::max(M, *sink), a = exp_neg(M - m);
    L = L * a + exp_neg(*sink - m);
    for (int d = 0; d < hd; ++d) out[d] *= a;
  }
  const float inv = L > 0 ? 1.f / L : 0.f;
  for (int d = 0; d < hd; ++d) out[d] *= inv;
}

size_t attn_block_scratch(int64_t n_rows, int group, int head_dim, int64_t n_kv) {
  // Scores of one chunk, a K tile, a converted row and 64 converted columns of a chunk's V
  // rows, then (whole attention) every chunk's partials.
  const int64_t nqg = n_rows * group;
  const int64_t n_chunks = n_kv > 0 ? (n_kv + kAttnChunk - 1) / kAttnChunk + 1 : 0;
  return (size_t)(nqg * kAttnChunk + (int64_t)head_dim * 17 + kAttnChunk * 64 + nqg * n_chunks * (head_dim + 2));
}

}  // namespace dl::cpu::DL_ISA
