// Repacked weight layouts made once at load (Backend::prepare), and the matmul that reads them.
//
// q8_0, q4_0, q4_1 and q5_0 in groups of 16 rows (AVX-512 VNNI only; other ISAs keep the file layout).
// Per group: the quants of every block column, then their f16 scales (and q4_1's mins), so a
// group is as many bytes as its 16 file rows:
//   q8_0  Q[nb][8][16][4]   chunk j: elements 4j..4j+3 of each row (lane = row), as q ^ 0x80 = q + 128
//   q4    Q[nb][4][16][4]   register c: the file's qs bytes 4c..4c+3 of each row, i.e. elements
//                           4c.. in the low nibbles and 16+4c.. in the high nibbles
//   q5_0  as q4, then uint32 qh[16] (each row's fifth bits) per block column
//   then  f16 d[nb][16]  (q4_1: and f16 m[nb][16])
// One broadcast of 4 activation bytes and one VNNI product advance 16 rows at once, and the
// 16 outputs of a group land in one register: no unpack buffer, no horizontal sums. Decode and
// prefill run the same per-output arithmetic (block by block, in order), so a token gets the
// same bits whichever way it is evaluated.
#include <algorithm>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "cpu/act_blocks.h"
#include "cpu/isa_kernels.h"
#include "cpu/kernels.h"
#include "quant/blocks.h"
#include "quant/types.h"

namespace dl::cpu::DL_ISA {

#if defined(__AVX512F__) && defined(__AVX512VNNI__)
namespace {
using namespace dl::quant;

constexpr int64_t kRowsPerGroup = 16;

// Per format: quant bytes per block column of a group, and whether a min (q4_1's m) is stored.
struct Fmt {
  int qbytes;
  bool mins;
};
inline bool fmt_of(uint32_t wtype, Fmt& f) {
  switch ((GGMLType)wtype) {
    case GGMLType::Q8_0: f = {512, false}; return true;
    case GGMLType::Q4_0: f = {256, false}; return true;
    case GGMLType::Q4_1: f = {256, true}; return true;
    case GGMLType::Q5_0: f = {320, false}; return true;  // nibbles as q4_0, then the 16 rows' qh words
    default: return false;
  }
}
inline size_t group_bytes(const Fmt& f, int64_t nb) { return (size_t)nb * (f.qbytes + 32 + (f.mins ? 32 : 0)); }

// Output groups [g, g + G) (rows g*16 ...) x tokens [t0, t0 + T). Independent (group, token)
// chains keep the VNNI unit busy; the arithmetic of each output does not depend on G or T.
template <GGMLType W, int G, int T>
void packed_tile(const MatmulArgs& a, int64_t g, int64_t t0) {
  constexpr bool kQ8 = W == GGMLType::Q8_0, kMins = W == GGMLType::Q4_1, kQ5 = W == GGMLType::Q5_0;
  constexpr int kQB = kQ8 ? 512 : (kQ5 ? 320 : 256);
  constexpr size_t kGB = kQB + 32 + (kMins ? 32 : 0);
  // sum w qa dw da with w = u + off (q8_0: u = q + 128, off -128; q4_0: off -8) is
  // dw da sum(u qa) + off dw sa, sa = da sum qa; q4_1 (w = dw u + m) adds m sa instead.
  constexpr float kOff = kQ8 ? -128.0f : (kQ5 ? -16.0f : -8.0f);
  const int64_t nb = a.k / 32, kp = act_a8_padded_k(a.k);
  const uint8_t* A[T];
  const float* da[T];
  const float* sa[T];
  for (int t = 0; t < T; ++t) a8_row(a.act, a.act_row_bytes, t0 + t, kp, A[t], da[t], sa[t]);
  const uint8_t* Q[G];
  const uint16_t* D[G];
  const uint16_t* M[G];
  for (int i = 0; i < G; ++i) {
    Q[i] = static_cast<const uint8_t*>(a.wpack) + (size_t)(g + i) * nb * kGB;
    D[i] = reinterpret_cast<const uint16_t*>(Q[i] + (size_t)nb * kQB);
    M[i] = D[i] + nb * 16;
  }
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  __m512 acc[G][T];
  for (int i = 0; i < G; ++i)
    for (int t = 0; t < T; ++t) acc[i][t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m512i is[G][T];
    for (int i = 0; i < G; ++i)
      for (int t = 0; t < T; ++t) is[i][t] = _mm512_setzero_si512();
    for (int i = 0; i < G; ++i) _mm_prefetch(reinterpret_cast<const char*>(Q[i] + (b + 4) * kQB), _MM_HINT_T0);
    if constexpr (kQ8) {
      for (int j = 0; j < 8; ++j) {
        __m512i w[G];
        for (int i = 0; i < G; ++i) w[i] = _mm512_loadu_si512(Q[i] + b * kQB + j * 64);
        for (int t = 0; t < T; ++t) {
          int32_t v;
          std::memcpy(&v, A[t] + b * 32 + j * 4, 4);
          const __m512i x = _mm512_set1_epi32(v);
          for (int i = 0; i < G; ++i) is[i][t] = _mm512_dpbusd_epi32(is[i][t], w[i], x);
        }
      }
    } else {
      // Register c holds elements 4c..4c+3 (low nibbles) and 16+4c.. (high nibbles) of each row.
      __m512i qh[G];
      if constexpr (kQ5)
        for (int i = 0; i < G; ++i) qh[i] = _mm512_loadu_si512(Q[i] + b * kQB + 256);
      for (int c = 0; c < 4; ++c) {
        __m512i lo[G], hi[G];
        for (int i = 0; i < G; ++i) {
          const __m512i raw = _mm512_loadu_si512(Q[i] + b * kQB + c * 64);
          lo[i] = _mm512_and_si512(raw, m4);
          hi[i] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), m4);
          if constexpr (kQ5) {
            // q5_0's fifth bits: bit j of a row's qh is element j's. Four bits x of a lane go to
            // bit 4 of its four bytes: x * (1 + 2^7 + 2^14 + 2^21) puts bit e at bit 8e (no carries).
            const __m512i spread = _mm512_set1_epi32(0x00204081), ones = _mm512_set1_epi32(0x01010101);
            auto fifth = [&](int shift) {
              const __m512i x = _mm512_and_si512(_mm512_srli_epi32(qh[i], shift), _mm512_set1_epi32(0xF));
              return _mm512_slli_epi32(_mm512_and_si512(_mm512_mullo_epi32(x, spread), ones), 4);
            };
            lo[i] = _mm512_or_si512(lo[i], fifth(4 * c));
            hi[i] = _mm512_or_si512(hi[i], fifth(16 + 4 * c));
          }
        }
        for (int t = 0; t < T; ++t) {
          int32_t vl, vh;
          std::memcpy(&vl, A[t] + b * 32 + c * 4, 4);
          std::memcpy(&vh, A[t] + b * 32 + 16 + c * 4, 4);
          const __m512i xl = _mm512_set1_epi32(vl), xh = _mm512_set1_epi32(vh);
          for (int i = 0; i < G; ++i) is[i][t] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(is[i][t], lo[i], xl), hi[i], xh);
        }
      }
    }
    for (int i = 0; i < G; ++i) {
      const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(D[i] + b * 16)));
      __m512 mw = _mm512_setzero_ps();
      if constexpr (kMins) mw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(M[i] + b * 16)));
      for (int t = 0; t < T; ++t) {
        acc[i][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is[i][t]), _mm512_mul_ps(dw, _mm512_set1_ps(da[t][b])), acc[i][t]);
        if constexpr (kMins)
          acc[i][t] = _mm512_fmadd_ps(mw, _mm512_set1_ps(sa[t][b]), acc[i][t]);
        else
          acc[i][t] = _mm512_fmadd_ps(dw, _mm512_set1_ps(kOff * sa[t][b]), acc[i][t]);
      }
    }
  }
  for (int i = 0; i < G; ++i) {
    const int64_t r = (g + i) * kRowsPerGroup;
    const int64_t nv = std::min<int64_t>(kRowsPerGroup, a.rows - r);
    const __mmask16 m = nv >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << nv) - 1);
    for (int t = 0; t < T; ++t) _mm512_mask_storeu_ps(a.y + (t0 + t) * a.y_stride + r, m, acc[i][t]);
  }
}

template <GGMLType W, int G>
void packed_groups(const MatmulArgs& a, int64_t g, int64_t n_tok) {
  for (int64_t t = 0; t < n_tok; t += 4) {
    switch (std::min<int64_t>(4, n_tok - t)) {
      case 1: packed_tile<W, G, 1>(a, g, t); break;
      case 2: packed_tile<W, G, 2>(a, g, t); break;
      case 3: packed_tile<W, G, 3>(a, g, t); break;
      default: packed_tile<W, G, 4>(a, g, t); break;
    }
  }
}

template <GGMLType W>
void packed_rows(const MatmulArgs& a, int64_t r0, int64_t r1) {
  // Row ranges start on a group (the backend cuts chunks in multiples of 16).
  int64_t g = r0 / kRowsPerGroup;
  const int64_t g1 = (r1 + kRowsPerGroup - 1) / kRowsPerGroup;
  if (a.n_tok == 1)
    for (; g + 4 <= g1; g += 4) packed_groups<W, 4>(a, g, 1);
  for (; g + 2 <= g1; g += 2) packed_groups<W, 2>(a, g, a.n_tok);
  for (; g < g1; ++g) packed_groups<W, 1>(a, g, a.n_tok);
}

}  // namespace

size_t pack_bytes(uint32_t wtype, int64_t rows, int64_t k) {
  Fmt f;
  if (!fmt_of(wtype, f) || k % 32 != 0 || rows <= 0) return 0;
  return (size_t)((rows + kRowsPerGroup - 1) / kRowsPerGroup) * group_bytes(f, k / 32);
}

void pack_rows(uint32_t wtype, const void* w, size_t row_bytes, int64_t rows, int64_t k, int64_t g0, int64_t g1,
               void* out) {
  Fmt f;
  if (!fmt_of(wtype, f)) return;
  const int64_t nb = k / 32;
  const bool q8 = (GGMLType)wtype == GGMLType::Q8_0;
  for (int64_t g = g0; g < g1; ++g) {
    uint8_t* Q = static_cast<uint8_t*>(out) + (size_t)g * group_bytes(f, nb);
    uint16_t* D = reinterpret_cast<uint16_t*>(Q + (size_t)nb * f.qbytes);
    uint16_t* M = D + nb * 16;
    for (int l = 0; l < kRowsPerGroup; ++l) {
      const int64_t r = g * kRowsPerGroup + l;
      const uint8_t* row = static_cast<const uint8_t*>(w) + (size_t)std::min(r, rows - 1) * row_bytes;
      for (int64_t b = 0; b < nb; ++b) {
        uint8_t* q = Q + b * f.qbytes;
        if (r >= rows) {  // padding rows: zero scales; their outputs are never stored
          D[b * 16 + l] = 0;
          if (f.mins) M[b * 16 + l] = 0;
          for (int j = 0; j < f.qbytes / 64; ++j) std::memset(q + j * 64 + l * 4, q8 ? 0x80 : 0, 4);
          continue;
        }
        if (q8) {
          const block_q8_0* blk = reinterpret_cast<const block_q8_0*>(row) + b;
          D[b * 16 + l] = blk->d;
          for (int j = 0; j < 8; ++j) std::memcpy(q + j * 64 + l * 4, blk->qs + j * 4, 4);
        } else if ((GGMLType)wtype == GGMLType::Q5_0) {
          const block_q5_0* blk = reinterpret_cast<const block_q5_0*>(row) + b;
          D[b * 16 + l] = blk->d;
          for (int c = 0; c < 4; ++c) std::memcpy(q + c * 64 + l * 4, blk->qs + c * 4, 4);
          std::memcpy(q + 256 + l * 4, blk->qh, 4);
        } else if (f.mins) {
          const block_q4_1* blk = reinterpret_cast<const block_q4_1*>(row) + b;
          D[b * 16 + l] = blk->d;
          M[b * 16 + l] = blk->m;
          for (int c = 0; c < 4; ++c) std::memcpy(q + c * 64 + l * 4, blk->qs + c * 4, 4);
        } else {
          const block_q4_0* blk = reinterpret_cast<const block_q4_0*>(row) + b;
          D[b * 16 + l] = blk->d;
          for (int c = 0; c < 4; ++c) std::memcpy(q + c * 64 + l * 4, blk->qs + c * 4, 4);
        }
      }
    }
    if (q8) {  // signed -> unsigned (padding rows end up 0)
      const __m512i x80 = _mm512_set1_epi8(-128);
      for (int64_t j = 0; j < nb * 8; ++j) {
        uint8_t* v = Q + j * 64;
        _mm512_storeu_si512(v, _mm512_xor_si512(_mm512_loadu_si512(v), x80));
      }
    }
  }
}

bool matmul_packed(const MatmulArgs& a, int64_t r0, int64_t r1) {
  if (a.wpack == nullptr) return false;
  switch ((GGMLType)a.wtype) {
    case GGMLType::Q8_0: packed_rows<GGMLType::Q8_0>(a, r0, r1); return true;
    case GGMLType::Q4_0: packed_rows<GGMLType::Q4_0>(a, r0, r1); return true;
    case GGMLType::Q4_1: packed_rows<GGMLType::Q4_1>(a, r0, r1); return true;
    case GGMLType::Q5_0: packed_rows<GGMLType::Q5_0>(a, r0, r1); return true;
    default: return false;
  }
}

#else  // no repacked layouts on this ISA: weights stay in their file layout

size_t pack_bytes(uint32_t, int64_t, int64_t) { return 0; }
void pack_rows(uint32_t, const void*, size_t, int64_t, int64_t, int64_t, int64_t, void*) {}
bool matmul_packed(const MatmulArgs&, int64_t, int64_t) { return false; }

#endif

}  // namespace dl::cpu::DL_ISA
