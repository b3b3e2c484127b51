// Attention of a block of query rows against one KV head, per ISA: scores for
// 16 keys at a time from a transposed K tile (no horizontal sums), softmax per
// row, then the value rows accumulated into the outputs. Rows are read through
// a page table (contiguous rows are one page), in the same order either way.
// f16 rows are converted as they are read (exactly), so no pass decodes the
// cache first and the bits are those of an f32 copy of it.
#pragma GCC optimize("fp-contract=fast")  // FMA where the ISA has it; results stay within the reference bars
#include <algorithm>
#include <cmath>
#include <cstring>

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

template <typename E>
void attn_block_t(const AttnBlock& b) {
  const int G = b.group, hd = b.head_dim;
  const int64_t nq = b.n_rows;
  // Keys any row of the block may see.
  int32_t pmin = b.pos[0], pmax = b.pos[0];
  for (int64_t t = 1; t < nq; ++t) {
    pmin = std::min(pmin, b.pos[t]);
    pmax = std::max(pmax, b.pos[t]);
  }
  const int64_t j_hi = std::min<int64_t>(b.n_kv, (int64_t)pmax + 1);
  const int64_t j_lo = b.window > 0 ? std::max<int64_t>(0, (int64_t)pmin - b.window + 1) : 0;
  const int64_t nj = std::max<int64_t>(0, j_hi - j_lo);
  const int64_t nqg = nq * G;
  const int sh = b.page_shift;
  const int64_t mask = (int64_t(1) << sh) - 1;
  auto krow = [&](int64_t j) { return (const E*)(b.k_pages[j >> sh] + b.k_off) + (j & mask) * b.kv_stride; };
  auto vrow = [&](int64_t j) { return (const E*)(b.v_pages[j >> sh] + b.v_off) + (j & mask) * b.kv_stride; };
  // Rows of V from key j to the end of its page (or to `end`).
  auto vrun = [&](int64_t j, int64_t end) { return std::min<int64_t>(end - j, (mask + 1) - (j & mask)); };
  float* S = b.scratch;            // [nq*G][nj] scores, then probabilities
  float* Kt = S + nqg * nj;        // [hd][16] one transposed K tile
  float* cbuf = Kt + hd * 16;      // [hd] one converted f16 K row or V segment
  constexpr int TJ = 16;
  for (int64_t jb = 0; jb < nj; jb += TJ) {
    const int64_t tj = std::min<int64_t>(TJ, nj - jb);
    for (int64_t j = 0; j < TJ; ++j) {
      const float* kr = row_f32(krow(j_lo + jb + std::min<int64_t>(j, tj - 1)), cbuf, hd);
      for (int d = 0; d < hd; ++d) Kt[d * TJ + j] = kr[d];
    }
    // Four query rows per pass: four independent FMA chains share each K tile row.
    constexpr int QR = 4;
    for (int64_t r0 = 0; r0 < nqg; r0 += QR) {
      const float* q[QR];
      for (int i = 0; i < QR; ++i) {
        const int64_t r = std::min(r0 + i, nqg - 1);
        q[i] = b.q + (r / G) * b.q_stride + (r % G) * hd;
      }
      float acc[QR][TJ] = {};
      for (int d = 0; d < hd; ++d) {
        const float* kt = Kt + d * TJ;
        for (int i = 0; i < QR; ++i) {
          const float qd = q[i][d];
          for (int j = 0; j < TJ; ++j) acc[i][j] += qd * kt[j];
        }
      }
      for (int i = 0; i < QR && r0 + i < nqg; ++i) std::memcpy(S + (r0 + i) * nj + jb, acc[i], (size_t)tj * 4);
    }
  }
  for (int64_t r = 0; r < nqg; ++r) {
    float* s = S + r * nj;
    const int64_t p = b.pos[r / G];
    // Row r sees keys j <= p inside the window; the rest of the block's range is masked.
    const int64_t lo = (b.window > 0 ? std::max<int64_t>(0, p - b.window + 1) : 0) - j_lo;
    const int64_t hi = std::min<int64_t>(j_hi, p + 1) - j_lo;
    if (b.softcap > 0) {
      for (int64_t j = lo; j < hi; ++j) s[j] = b.softcap * std::tanh(s[j] * b.scale / b.softcap);
    } else {
      for (int64_t j = lo; j < hi; ++j) s[j] *= b.scale;
    }
    float mxl[TJ];
    std::fill(mxl, mxl + TJ, -INFINITY);
    int64_t j = lo;
    for (; j + TJ <= hi; j += TJ)
      for (int e = 0; e < TJ; ++e) mxl[e] = mxl[e] > s[j + e] ? mxl[e] : s[j + e];
    float mx = -INFINITY;
    for (; j < hi; ++j) mx = std::max(mx, s[j]);
    for (int e = 0; e < TJ; ++e) mx = std::max(mx, mxl[e]);
    float suml[TJ] = {0};
    for (j = lo; j + TJ <= hi; j += TJ)
      for (int e = 0; e < TJ; ++e) suml[e] += s[j + e] = exp_neg(s[j + e] - mx);
    float sum = 0;
    for (; j < hi; ++j) sum += s[j] = exp_neg(s[j] - mx);
    for (int e = 0; e < TJ; ++e) sum += suml[e];
    const float inv = sum > 0 ? 1.f / sum : 0.f;
    float* o = b.out + (r / G) * b.out_stride + (r % G) * hd;
    for (int64_t j = lo; j < hi; ++j) s[j] *= inv;
    // 16 output dims at a time stay in one register across all keys (accumulating
    // in memory would chain every key through a store and a reload).
    // 64 dims per pass: four registers, four independent chains.
    constexpr int TD = 64;
    int dc = 0;
    for (; dc + TD <= hd; dc += TD) {
      float acc[TD] = {0};
      for (int64_t j = lo; j < hi;) {
        const int64_t run = vrun(j_lo + j, j_lo + hi);
        const E* vr = vrow(j_lo + j) + dc;
        for (int64_t i = 0; i < run; ++i, ++j, vr += b.kv_stride) {
          const float pj = s[j];
          const float* v = row_f32(vr, cbuf, TD);
          for (int e = 0; e < TD; ++e) acc[e] += pj * v[e];
        }
      }
      std::memcpy(o + dc, acc, sizeof(acc));
    }
    for (; dc + TJ <= hd; dc += TJ) {
      float acc[TJ] = {0};
      for (int64_t j = lo; j < hi;) {
        const int64_t run = vrun(j_lo + j, j_lo + hi);
        const E* vr = vrow(j_lo + j) + dc;
        for (int64_t i = 0; i < run; ++i, ++j, vr += b.kv_stride) {
          const float pj = s[j];
          const float* v = row_f32(vr, cbuf, TJ);
          for (int e = 0; e < TJ; ++e) acc[e] += pj * v[e];
        }
      }
      std::memcpy(o + dc, acc, sizeof(acc));
    }
    for (; dc < hd; ++dc) {
      float acc = 0;
      for (int64_t j = lo; j < hi; ++j) acc += s[j] * *row_f32(vrow(j_lo + j) + dc, cbuf, 1);
      o[dc] = acc;
    }
  }
}

}  // namespace

void attn_block(const AttnBlock& b) {
  if (b.kv_f16)
    attn_block_t<uint16_t>(b);
  else
    attn_block_t<float>(b);
}

size_t attn_block_scratch(int64_t n_rows, int group, int head_dim, int64_t n_kv) {
  return (size_t)(n_rows * group * n_kv + (int64_t)head_dim * 17);
}

}  // namespace dl::cpu::DL_ISA
