// Repacked weight layouts made once at load (Backend::prepare), and the matmul that reads them.
//
// q8_0, q4_0, q4_1 and q5_0 in groups of 16 rows (AVX-512 VNNI only; other ISAs keep the file layout).
// Per group and block column, 64-byte lines of quants, then a tail of f16 scales (and q4_1's
// mins), as many bytes as the 16 file rows' blocks:
//   q8_0  8 lines [16][4]   line j: elements 4j..4j+3 of each row (lane = row), as q ^ 0x80 = q + 128
//   q4    4 lines [16][4]   line c: the file's qs bytes 4c..4c+3 of each row, i.e. elements
//                           4c.. in the low nibbles and 16+4c.. in the high nibbles
//   q5_0  as q4, then line 4 qh[16][4]: byte j of a row holds bit 2c = the fifth bit of element
//         4c+j, bit 2c+1 = that of element 16+4c+j (line c's byte j)
//   tail  f16 d[16]  (q4_1: then f16 m[16])
// q4_K and q6_K (K8 activations) in groups of 16 rows, per super-block of 256:
//   q4_K  32 lines: line 4s+c is sub-block s in the q4 line layout above (its elements in the
//         nibbles); tail u8 sc[8][16], u8 mn[4][16][2] (sub-blocks 2p, 2p+1 as an int16 pair per
//         row for vpdpwssd), f16 d[16], f16 dmin[16] (320 bytes)
//   q6_K  64 lines: line j holds elements 4j..4j+3 of each row as bytes (q, 0..63, unpacked at
//         load: 30% more bytes than the file, no per-token unpacking); tail int8 sc[16][16],
//         f16 d[16], 32 pad bytes (320 bytes)
// Groups go in super-groups of 4 (64 rows; the matrix's last one may hold fewer, ng): a column
// (block or super-block) of a super-group is its groups' lines interleaved, line l of its j-th
// group at (l * ng + j) * 64, then the ng tails (super_pos). A decode tile of 4 groups loads
// line l of each group, then line l + 1, ...: its weights in address order, one stream. With
// each group's column apart (the layout before 2026-12-01), one core read the Gemma-3 decode
// GEMVs at 8-14 GB/s; in address order at 18-23 (benchmarks/bench_decode_gemv.cpp, Zen 4).
// f32 and f16 (f32 activations) in groups of 16 rows: P[k][16] (element kk of each row, lane = row),
// in the file's element type. One weight load (f16: plus one conversion) and one broadcast
// activation per FMA tile advance 16 rows of up to 16 tokens; every output is one FMA chain
// over k in order, whatever the tile, so decode and prefill give the same bits.
// One broadcast of 4 activation bytes and one VNNI product advance 16 rows at once, and the
// 16 outputs of a group land in one register: no unpack buffer, no horizontal sums. Decode and
// prefill run the same per-output arithmetic (block by block, in order), so a token gets the
// same bits whichever way it is evaluated.
#include <algorithm>
#include <array>
#include <cstdlib>
#include <cstring>
#include <utility>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "cpu/act_blocks.h"
#include "cpu/isa_kernels.h"
#include "cpu/kernels.h"
#include "cpu/vmath.h"
#include "quant/blocks.h"
#include "quant/dequant_impl.h"
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

// Where group g of a packed matrix lies. A super-group holds 4 groups (fewer at the matrix's
// end: ng); each block column of it is its groups' quant lines interleaved line by line (line l
// of its j-th group at (l * ng + j) * 64), then each group's tail (scales, mins). Column b of
// group g: line l at line0 + b * stride + l * lstride, tail at tail0 + b * stride. A tile's
// groups lie in one super-group (the callers cut tiles so), so a decode tile of 4 groups reads
// its weights in address order, one stream.
constexpr int64_t kSuper = 4;
struct SuperPos {
  const uint8_t* line0;
  const uint8_t* tail0;
  size_t stride, lstride;
  int j, ng;
};
inline SuperPos super_pos(const void* wpack, int64_t g, int64_t rows, int64_t ncols, int qlines, size_t tail) {
  const int64_t ngroups = (rows + kRowsPerGroup - 1) / kRowsPerGroup, s = g / kSuper;
  const int ng = (int)std::min<int64_t>(kSuper, ngroups - s * kSuper), j = (int)(g % kSuper);
  const size_t rec = (size_t)qlines * 64 + tail;
  const uint8_t* base = static_cast<const uint8_t*>(wpack) + (size_t)(s * kSuper) * (size_t)ncols * rec;
  return {base + (size_t)j * 64, base + (size_t)ng * qlines * 64 + (size_t)j * tail, (size_t)ng * rec, (size_t)ng * 64, j, ng};
}
// Tiles of up to G groups from g that stay inside one super-group.
inline bool tile_fits(int64_t g, int G) { return g % kSuper + G <= kSuper; }

// A decode tile of a layer-sized matrix (a few hundred KB: per thread a stream of 30-900 KB) asks
// for its weights kPfAhead bytes ahead, into L2, up to the matrix's end: the hardware prefetchers
// alone left the Gemma-3-270M layer GEMVs at 11-16 GB/s from DRAM against ~20 for a plain
// stream; 16 KB ahead took 15-30% off their time (1 and 2 threads; 2-8 KB helped less, T0
// hurt). The long output matrix (178 MB) streams faster without: every distance measured 5-30%
// slower there, so matrices of kPfMaxBytes or more get none (benchmarks/RESULTS.md, 2026-12-02).
constexpr size_t kPfAhead = 16384, kPfMaxBytes = size_t(8) << 20;
// Null (no software prefetch) unless a decode tile of 4 groups reads a matrix of under kPfMaxBytes.
inline const uint8_t* prefetch_end(const MatmulArgs& a, size_t group_column_bytes, int64_t ncols) {
  const size_t bytes = (size_t)((a.rows + kRowsPerGroup - 1) / kRowsPerGroup) * (size_t)ncols * group_column_bytes;
  return bytes < kPfMaxBytes ? static_cast<const uint8_t*>(a.wpack) + bytes : nullptr;
}
// The n bytes from p, kPfAhead on, that lie before end.
inline void prefetch_ahead(const uint8_t* p, size_t n, const uint8_t* end) {
  p += kPfAhead;
  if (p >= end) return;
  n = std::min<size_t>(n, (size_t)(end - p));
  for (size_t o = 0; o < n; o += 64) _mm_prefetch(reinterpret_cast<const char*>(p + o), _MM_HINT_T1);
}

// Bit x of every byte of v moved to bit 4 (16-bit shifts: bit 4 of a byte only ever
// receives a bit of the same byte; the other bits are masked off by the caller).
inline __m512i q5_bit4(__m512i v, int x) {
  switch (x) {
    case 0: return _mm512_slli_epi16(v, 4);
    case 1: return _mm512_slli_epi16(v, 3);
    case 2: return _mm512_slli_epi16(v, 2);
    case 3: return _mm512_slli_epi16(v, 1);
    case 4: return v;
    case 5: return _mm512_srli_epi16(v, 1);
    case 6: return _mm512_srli_epi16(v, 2);
    default: return _mm512_srli_epi16(v, 3);
  }
}

// A tile's G x T output registers: group g + i's 16 rows (fewer in a last partial group), token t0 + t.
template <int G, int T>
inline void store_tile(const MatmulArgs& a, int64_t g, int64_t t0, const __m512 (&acc)[G][T]) {
  for (int i = 0; i < G; ++i) {
    const int64_t r = (g + i) * kRowsPerGroup;
    const int64_t nv = std::min<int64_t>(kRowsPerGroup, a.rows - r);
    const __mmask16 m = nv >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << nv) - 1);
    for (int t = 0; t < T; ++t) _mm512_mask_storeu_ps(a.y + (t0 + t) * a.y_stride + r, m, acc[i][t]);
  }
}

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
  // Group g + i's block b: quant line l at Q[i] + b * S + l * LS, scales at D[i] + b * S, mins 32 bytes on.
  const uint8_t* Q[G];
  const uint8_t* D[G];
  size_t S = 0, LS = 0;
  for (int i = 0; i < G; ++i) {
    const SuperPos p = super_pos(a.wpack, g + i, a.rows, nb, kQB / 64, kGB - kQB);
    Q[i] = p.line0, D[i] = p.tail0, S = p.stride, LS = p.lstride;
  }
  const uint8_t* pf_end = T == 1 && G == 4 ? prefetch_end(a, kGB, nb) : nullptr;
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  __m512 acc[G][T];
  for (int i = 0; i < G; ++i)
    for (int t = 0; t < T; ++t) acc[i][t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    if (pf_end) prefetch_ahead(Q[0] + b * S, S, pf_end);  // Q[0]: the super-group's column b
    __m512i is[G][T];
    for (int i = 0; i < G; ++i)
      for (int t = 0; t < T; ++t) is[i][t] = _mm512_setzero_si512();
    // A decode tile (T == 1) reads its super-group's columns in address order, one stream
    // (prefetched far ahead for a small matrix, prefetch_ahead).
    if constexpr (T > 1) {
      // Several tokens per weight: compute and the weight stream must overlap, so every
      // line of the block 32 ahead (and its scales) is requested well before it is used. Only
      // by the first token tile: the later ones find the lines in cache (packed_groups runs
      // every tile of these groups in turn), where a prefetch per line and block only took
      // load slots.
      constexpr int64_t kAhead = 32;
      if (t0 == 0)
        for (int i = 0; i < G; ++i) {
          for (int l = 0; l < kQB / 64; ++l)
            _mm_prefetch(reinterpret_cast<const char*>(Q[i] + (b + kAhead) * S + l * LS), _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(D[i] + (b + kAhead) * S), _MM_HINT_T0);
        }
    }
    if constexpr (kQ8) {
      for (int j = 0; j < 8; ++j) {
        __m512i w[G];
        for (int i = 0; i < G; ++i) w[i] = _mm512_loadu_si512(Q[i] + b * S + j * LS);
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
        for (int i = 0; i < G; ++i) qh[i] = _mm512_loadu_si512(Q[i] + b * S + 4 * LS);
      for (int c = 0; c < 4; ++c) {
        __m512i lo[G], hi[G];
        for (int i = 0; i < G; ++i) {
          const __m512i raw = _mm512_loadu_si512(Q[i] + b * S + c * LS);
          if constexpr (kQ5) {
            // q5_0's fifth bits (pack_rows): bit 2c / 2c+1 of each byte of qh goes with that byte
            // of register c's low / high nibbles. Moved to bit 4 and masked, then OR'ed onto the
            // nibble with one ternlog ((A & C) | B): no per-lane multiply.
            const __m512i b4 = _mm512_set1_epi8(0x10);
            lo[i] = _mm512_ternarylogic_epi32(raw, _mm512_and_si512(q5_bit4(qh[i], 2 * c), b4), m4, 0xEC);
            hi[i] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(raw, 4), _mm512_and_si512(q5_bit4(qh[i], 2 * c + 1), b4),
                                              m4, 0xEC);
          } else {
            lo[i] = _mm512_and_si512(raw, m4);
            hi[i] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), m4);
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
      const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(D[i] + b * S)));
      __m512 mw = _mm512_setzero_ps();
      if constexpr (kMins) mw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(D[i] + b * S + 32)));
      for (int t = 0; t < T; ++t) {
        acc[i][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is[i][t]), _mm512_mul_ps(dw, _mm512_set1_ps(da[t][b])), acc[i][t]);
        if constexpr (kMins)
          acc[i][t] = _mm512_fmadd_ps(mw, _mm512_set1_ps(sa[t][b]), acc[i][t]);
        else
          acc[i][t] = _mm512_fmadd_ps(dw, _mm512_set1_ps(kOff * sa[t][b]), acc[i][t]);
      }
    }
  }
  store_tile<G, T>(a, g, t0, acc);
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
  while (g < g1) {
    if (a.n_tok == 1 && g + 4 <= g1 && tile_fits(g, 4)) {
      packed_groups<W, 4>(a, g, 1);
      g += 4;
    } else if (g + 2 <= g1 && tile_fits(g, 2)) {
      packed_groups<W, 2>(a, g, a.n_tok);
      g += 2;
    } else {
      packed_groups<W, 1>(a, g, a.n_tok);
      g += 1;
    }
  }
}


// ---- k-quants (K8 activations: block_q8_K, d, 256 qs, 16 bsums) --------------------------------

constexpr size_t kQ4KRec = 2048 + 128 + 128 + 32 + 32;  // one super-block of a 16-row group
constexpr size_t kQ6KRec = 4096 + 256 + 32 + 32;

inline const block_q8_K* k8_row(const MatmulArgs& a, int64_t t) {
  return reinterpret_cast<const block_q8_K*>(static_cast<const uint8_t*>(a.act) + (size_t)t * a.act_row_bytes);
}
inline __m512i bcast4(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// q4_K: per super-block and output, exact int32 sums per sub-block s (one VNNI chain over its
// 32 elements), scaled by sc_s in float (|sum| < 2^16, sc < 2^6: exact products); the mins
// are sum_s mn_s * bsum_s in int32 (vpdpwssd over sub-block pairs), so
//   y += (d * da) * sum_s sc_s isum_s - (dmin * da) * sum_s mn_s bsum_s.
template <int G, int T>
void q4k_tile(const MatmulArgs& a, int64_t g, int64_t t0) {
  const int64_t nsb = a.k / QK_K;
  const block_q8_K* A[T];
  for (int t = 0; t < T; ++t) A[t] = k8_row(a, t0 + t);
  // Group g + i's super-block b: quant line l at W[i] + b * S + l * LS, the tail (scales, d) at X[i] + b * S.
  const uint8_t* W[G];
  const uint8_t* X[G];
  size_t S = 0, LS = 0;
  for (int i = 0; i < G; ++i) {
    const SuperPos p = super_pos(a.wpack, g + i, a.rows, nsb, 32, kQ4KRec - 2048);
    W[i] = p.line0, X[i] = p.tail0, S = p.stride, LS = p.lstride;
  }
  const uint8_t* pf_end = T == 1 && G == 4 ? prefetch_end(a, kQ4KRec, nsb) : nullptr;
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  const __m256i ones16 = _mm256_set1_epi16(1);
  __m512 acc[G][T];
  for (int i = 0; i < G; ++i)
    for (int t = 0; t < T; ++t) acc[i][t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nsb; ++b) {
    // Activation sub-block sums as int16 pairs (2p, 2p+1) in words 0, 1, 4, 5 (|sum| <= 32 * 127).
    alignas(32) int32_t bp[T][8];
    float da[T];
    for (int t = 0; t < T; ++t) {
      const block_q8_K* x = A[t] + b;
      std::memcpy(&da[t], &x->d, 4);
      const __m256i s8 = _mm256_madd_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x->bsums)), ones16);
      _mm256_store_si256(reinterpret_cast<__m256i*>(bp[t]), _mm256_packs_epi32(s8, s8));
    }
    const uint8_t* R[G];
    const uint8_t* Y[G];
    for (int i = 0; i < G; ++i) R[i] = W[i] + b * S, Y[i] = X[i] + b * S;
    __m512 fs[G][T];
    for (int i = 0; i < G; ++i)
      for (int t = 0; t < T; ++t) fs[i][t] = _mm512_setzero_ps();
    for (int s = 0; s < 8; ++s) {
      // Prefill: the next super-block's lines stream in while this one computes, its quant lines
      // 4s..4s+3 now, its tail (5 lines) with the first. A decode tile reads its columns in address
      // order: the next column's scales, and a small matrix's stream far ahead (prefetch_ahead;
      // the next super-block only, as prefill does, measured 10-30% slower).
      if constexpr (T > 1) {
        for (int i = 0; i < G; ++i) {
          for (int l = 0; l < 4; ++l) _mm_prefetch(reinterpret_cast<const char*>(R[i] + S + (s * 4 + l) * LS), _MM_HINT_T0);
          if (s < 5) _mm_prefetch(reinterpret_cast<const char*>(Y[i] + S + s * 64), _MM_HINT_T0);
        }
      } else if (s < 5) {
        for (int i = 0; i < G; ++i) _mm_prefetch(reinterpret_cast<const char*>(Y[i] + S + s * 64), _MM_HINT_T0);
      }
      if (pf_end) prefetch_ahead(W[0] + b * S + s * (S / 8), S / 8, pf_end);
      __m512i is[G][T];
      for (int i = 0; i < G; ++i)
        for (int t = 0; t < T; ++t) is[i][t] = _mm512_setzero_si512();
      for (int c = 0; c < 4; ++c) {
        __m512i lo[G], hi[G];
        for (int i = 0; i < G; ++i) {
          const __m512i raw = _mm512_loadu_si512(R[i] + (s * 4 + c) * LS);
          lo[i] = _mm512_and_si512(raw, m4);
          hi[i] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), m4);
        }
        for (int t = 0; t < T; ++t) {
          const __m512i xl = bcast4(A[t][b].qs + s * 32 + c * 4), xh = bcast4(A[t][b].qs + s * 32 + 16 + c * 4);
          for (int i = 0; i < G; ++i) is[i][t] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(is[i][t], lo[i], xl), hi[i], xh);
        }
      }
      for (int i = 0; i < G; ++i) {
        const __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(Y[i] + s * 16))));
        for (int t = 0; t < T; ++t) fs[i][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is[i][t]), sc, fs[i][t]);
      }
    }
    for (int i = 0; i < G; ++i) {
      __m512i im[T];
      for (int t = 0; t < T; ++t) im[t] = _mm512_setzero_si512();
      for (int p = 0; p < 4; ++p) {
        const __m512i mn = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(Y[i] + 128 + p * 32)));
        for (int t = 0; t < T; ++t) im[t] = _mm512_dpwssd_epi32(im[t], mn, _mm512_set1_epi32(bp[t][(p >> 1) * 4 + (p & 1)]));
      }
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(Y[i] + 256)));
      const __m512 dm = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(Y[i] + 288)));
      for (int t = 0; t < T; ++t) {
        const __m512 vda = _mm512_set1_ps(da[t]);
        acc[i][t] = _mm512_fmadd_ps(fs[i][t], _mm512_mul_ps(d, vda), acc[i][t]);
        acc[i][t] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(im[t]), _mm512_mul_ps(dm, vda), acc[i][t]);
      }
    }
  }
  store_tile<G, T>(a, g, t0, acc);
}

// q6_K: per scale group of 16 an exact int32 sum of (q - 32) * qa (the chain starts at
// -32 * bsum), scaled by sc in float (|sum| <= 16 * 32 * 127, |sc| <= 128: exact products):
//   y += (d * da) * sum_g sc_g sum_{16} (q - 32) qa.
template <int G, int T>
void q6k_tile(const MatmulArgs& a, int64_t g, int64_t t0) {
  const int64_t nsb = a.k / QK_K;
  const block_q8_K* A[T];
  for (int t = 0; t < T; ++t) A[t] = k8_row(a, t0 + t);
  // Group g + i's super-block b: quant line l at W[i] + b * S + l * LS, the tail (scales, d) at X[i] + b * S.
  const uint8_t* W[G];
  const uint8_t* X[G];
  size_t S = 0, LS = 0;
  for (int i = 0; i < G; ++i) {
    const SuperPos p = super_pos(a.wpack, g + i, a.rows, nsb, 64, kQ6KRec - 4096);
    W[i] = p.line0, X[i] = p.tail0, S = p.stride, LS = p.lstride;
  }
  const uint8_t* pf_end = T == 1 && G == 4 ? prefetch_end(a, kQ6KRec, nsb) : nullptr;
  __m512 acc[G][T];
  for (int i = 0; i < G; ++i)
    for (int t = 0; t < T; ++t) acc[i][t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nsb; ++b) {
    alignas(64) int32_t off[T][16];  // -32 * bsums
    float da[T];
    for (int t = 0; t < T; ++t) {
      const block_q8_K* x = A[t] + b;
      std::memcpy(&da[t], &x->d, 4);
      const __m512i bs = _mm512_cvtepi16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x->bsums)));
      _mm512_store_si512(off[t], _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(bs, 5)));
    }
    const uint8_t* R[G];
    const uint8_t* Y[G];
    for (int i = 0; i < G; ++i) R[i] = W[i] + b * S, Y[i] = X[i] + b * S;
    __m512 fs[G][T];
    for (int i = 0; i < G; ++i)
      for (int t = 0; t < T; ++t) fs[i][t] = _mm512_setzero_ps();
    for (int q = 0; q < 16; ++q) {
      if constexpr (T > 1) {  // as q4_K: prefill prefetches the next super-block, decode does not
        for (int i = 0; i < G; ++i) {
          for (int l = 0; l < 4; ++l) _mm_prefetch(reinterpret_cast<const char*>(R[i] + S + (q * 4 + l) * LS), _MM_HINT_T0);
          if (q < 5) _mm_prefetch(reinterpret_cast<const char*>(Y[i] + S + q * 64), _MM_HINT_T0);
        }
      } else if (q < 5) {
        for (int i = 0; i < G; ++i) _mm_prefetch(reinterpret_cast<const char*>(Y[i] + S + q * 64), _MM_HINT_T0);
      }
      if (pf_end) prefetch_ahead(W[0] + b * S + q * (S / 16), S / 16, pf_end);
      __m512i is[G][T];
      for (int i = 0; i < G; ++i)
        for (int t = 0; t < T; ++t) is[i][t] = _mm512_set1_epi32(off[t][q]);
      for (int j = 0; j < 4; ++j) {
        __m512i w[G];
        for (int i = 0; i < G; ++i) w[i] = _mm512_loadu_si512(R[i] + (q * 4 + j) * LS);
        for (int t = 0; t < T; ++t) {
          const __m512i x = bcast4(A[t][b].qs + q * 16 + j * 4);
          for (int i = 0; i < G; ++i) is[i][t] = _mm512_dpbusd_epi32(is[i][t], w[i], x);
        }
      }
      for (int i = 0; i < G; ++i) {
        const __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(Y[i] + q * 16))));
        for (int t = 0; t < T; ++t) fs[i][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is[i][t]), sc, fs[i][t]);
      }
    }
    for (int i = 0; i < G; ++i) {
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(Y[i] + 256)));
      for (int t = 0; t < T; ++t) acc[i][t] = _mm512_fmadd_ps(fs[i][t], _mm512_mul_ps(d, _mm512_set1_ps(da[t])), acc[i][t]);
    }
  }
  store_tile<G, T>(a, g, t0, acc);
}

// Tokens [t, t1) of groups [g, g + G): tiles of TM tokens, the rest in halving tiles.
template <template <int, int> class Tile, int G, int TM>
void k_tokens(const MatmulArgs& a, int64_t g, int64_t t, int64_t t1) {
  for (; t + TM <= t1; t += TM) Tile<G, TM>::run(a, g, t);
  if constexpr (TM > 1)
    if (t < t1) k_tokens<Tile, G, TM / 2>(a, g, t, t1);
}
template <int G, int T>
struct Q4KTile {
  static void run(const MatmulArgs& a, int64_t g, int64_t t) { q4k_tile<G, T>(a, g, t); }
};
template <int G, int T>
struct Q6KTile {
  static void run(const MatmulArgs& a, int64_t g, int64_t t) { q6k_tile<G, T>(a, g, t); }
};

// Decode: four groups per token (independent chains, weights stream once). Prefill: two
// groups x 4 tokens, or one group x 8 tokens (the backend's 16-row chunks of a small matrix).
template <template <int, int> class Tile>
void k_rows(const MatmulArgs& a, int64_t r0, int64_t r1) {
  int64_t g = r0 / kRowsPerGroup;
  const int64_t g1 = (r1 + kRowsPerGroup - 1) / kRowsPerGroup;
  while (g < g1) {
    if (a.n_tok == 1 && g + 4 <= g1 && tile_fits(g, 4)) {
      k_tokens<Tile, 4, 1>(a, g, 0, 1);
      g += 4;
    } else if (g + 2 <= g1 && tile_fits(g, 2)) {
      k_tokens<Tile, 2, 4>(a, g, 0, a.n_tok);
      g += 2;
    } else {
      k_tokens<Tile, 1, 8>(a, g, 0, a.n_tok);
      g += 1;
    }
  }
}

// Pack time: q4_K in the layout above.
// Quant line l of super-block b at L + b * stride + l * lstride, its tail at X + b * stride (super_pos).
void pack_q4_K_group(const uint8_t* const* rows, const bool* valid, int64_t nsb, uint8_t* L, uint8_t* X, size_t stride,
                     size_t lstride) {
  for (int64_t b = 0; b < nsb; ++b) {
    uint8_t* Lb = L + b * stride;
    auto line = [&](int l) { return Lb + l * lstride; };
    uint8_t* T = X + b * stride;  // sc[8][16] at 0, mn at 128, d at 256, dmin at 288
    uint16_t* D = reinterpret_cast<uint16_t*>(T + 256);
    for (int l = 0; l < kRowsPerGroup; ++l) {
      if (!valid[l]) {  // padding rows: zero quants and scales; their outputs are never stored
        for (int s = 0; s < 8; ++s) {
          for (int c = 0; c < 4; ++c) std::memset(line(s * 4 + c) + l * 4, 0, 4);
          T[s * 16 + l] = 0;
        }
        for (int p = 0; p < 4; ++p) T[128 + p * 32 + l * 2] = T[128 + p * 32 + l * 2 + 1] = 0;
        D[l] = D[16 + l] = 0;
        continue;
      }
      const block_q4_K* blk = reinterpret_cast<const block_q4_K*>(rows[l]) + b;
      uint8_t sc[8], mn[8];
      k_scale_min(blk->scales, sc, mn);
      const __m256i m4 = _mm256_set1_epi8(0x0F);
      for (int s = 0; s < 8; ++s) {
        // u = the sub-block's 32 quants; the register bytes are u[0..15] | u[16..31] << 4.
        const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk->qs + (s >> 1) * 32));
        const __m256i u = _mm256_and_si256((s & 1) ? _mm256_srli_epi16(q, 4) : q, m4);
        const __m128i v = _mm_or_si128(_mm256_castsi256_si128(u), _mm_slli_epi16(_mm256_extracti128_si256(u, 1), 4));
        // Dwords straight from the register (a 16-byte store read back 4 bytes at a time stalls).
        _mm_storeu_si32(line(s * 4) + l * 4, v);
        _mm_storeu_si32(line(s * 4 + 1) + l * 4, _mm_srli_si128(v, 4));
        _mm_storeu_si32(line(s * 4 + 2) + l * 4, _mm_srli_si128(v, 8));
        _mm_storeu_si32(line(s * 4 + 3) + l * 4, _mm_srli_si128(v, 12));
        T[s * 16 + l] = sc[s];
      }
      for (int p = 0; p < 4; ++p) {
        T[128 + p * 32 + l * 2] = mn[2 * p];
        T[128 + p * 32 + l * 2 + 1] = mn[2 * p + 1];
      }
      D[l] = blk->d;
      D[16 + l] = blk->dmin;
    }
  }
}

void pack_q6_K_group(const uint8_t* const* rows, const bool* valid, int64_t nsb, uint8_t* L, uint8_t* X, size_t stride,
                     size_t lstride) {
  // All 16 rows' quants are decoded first, then interleaved: reading back 4 bytes of a row
  // just stored 32 at a time would stall on store forwarding.
  alignas(32) uint8_t U[kRowsPerGroup][256];
  for (int64_t b = 0; b < nsb; ++b) {
    uint8_t* Lb = L + b * stride;
    uint8_t* T = X + b * stride;  // sc[16][16] at 0, d at 256, 32 pad bytes
    uint16_t* D = reinterpret_cast<uint16_t*>(T + 256);
    std::memset(T + 288, 0, 32);
    for (int l = 0; l < kRowsPerGroup; ++l) {
      uint8_t* u = U[l];
      if (!valid[l]) {
        std::memset(u, 0, 256);
        for (int q = 0; q < 16; ++q) T[q * 16 + l] = 0;
        D[l] = 0;
        continue;
      }
      const block_q6_K* blk = reinterpret_cast<const block_q6_K*>(rows[l]) + b;
      // u[e] = element e of the super-block, 0..63, as dq_q6_K reads it:
      // u[128h + 32s + l] = nibble (s >> 1) of ql[64h + 32(s & 1) + l] | bits 2s, 2s+1 of qh[32h + l] << 4.
      const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(0x03);
      for (int h = 0; h < 2; ++h) {
        const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk->qh + h * 32));
        for (int s = 0; s < 4; ++s) {
          const __m256i ql = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk->ql + h * 64 + (s & 1) * 32));
          const __m256i lo = _mm256_and_si256((s >> 1) ? _mm256_srli_epi16(ql, 4) : ql, m4);
          const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * s), m2);
          _mm256_store_si256(reinterpret_cast<__m256i*>(u + h * 128 + s * 32), _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)));
        }
      }
      for (int q = 0; q < 16; ++q) T[q * 16 + l] = (uint8_t)blk->scales[q];
      D[l] = blk->d;
    }
    for (int j = 0; j < 64; ++j)
      for (int l = 0; l < kRowsPerGroup; ++l) std::memcpy(Lb + j * lstride + l * 4, U[l] + 4 * j, 4);
  }
}

inline size_t k_rec(uint32_t wtype) {
  switch ((GGMLType)wtype) {
    case GGMLType::Q4_K: return kQ4KRec;
    case GGMLType::Q6_K: return kQ6KRec;
    default: return 0;
  }
}

// ---- f32 / f16: 16-row groups of P[k][16] ----------------------------------------------------------
inline size_t fp_esize(uint32_t wtype) {
  switch ((GGMLType)wtype) {
    case GGMLType::F32: return 4;
    case GGMLType::F16: return 2;
    default: return 0;
  }
}

// G groups (16 G rows) x T tokens: acc[g][t] holds rows 16(g0+g).. of token t0+t.
template <bool H, int G, int T>
void fp_tile(const MatmulArgs& a, int64_t g0, int64_t t0) {
  const int64_t k = a.k;
  const size_t gstride = (size_t)k * 16;  // elements per group
  __m512 acc[G][T];
  for (int g = 0; g < G; ++g)
    for (int t = 0; t < T; ++t) acc[g][t] = _mm512_setzero_ps();
  const float* X[T];
  for (int t = 0; t < T; ++t)
    X[t] = reinterpret_cast<const float*>(static_cast<const uint8_t*>(a.act) + (size_t)(t0 + t) * a.act_row_bytes);
  if constexpr (H) {
    const uint16_t* P = static_cast<const uint16_t*>(a.wpack) + (size_t)g0 * gstride;
    for (int64_t kk = 0; kk < k; ++kk) {
      __m512 w[G];
      for (int g = 0; g < G; ++g)
        w[g] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(P + g * gstride + kk * 16)));
      for (int t = 0; t < T; ++t) {
        const __m512 x = _mm512_set1_ps(X[t][kk]);
        for (int g = 0; g < G; ++g) acc[g][t] = _mm512_fmadd_ps(x, w[g], acc[g][t]);
      }
    }
  } else {
    const float* P = static_cast<const float*>(a.wpack) + (size_t)g0 * gstride;
    for (int64_t kk = 0; kk < k; ++kk) {
      __m512 w[G];
      for (int g = 0; g < G; ++g) w[g] = _mm512_loadu_ps(P + g * gstride + kk * 16);
      for (int t = 0; t < T; ++t) {
        const __m512 x = _mm512_set1_ps(X[t][kk]);
        for (int g = 0; g < G; ++g) acc[g][t] = _mm512_fmadd_ps(x, w[g], acc[g][t]);
      }
    }
  }
  for (int g = 0; g < G; ++g) {
    const int64_t r = (g0 + g) * 16;
    const int64_t left = a.rows - r;  // padding rows of the last group are not stored
    const __mmask16 m = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
    // The epilogue in registers: the same roundings as add_bias then gelu_erf over stored rows.
    const __m512 b = a.bias ? _mm512_maskz_loadu_ps(m, a.bias + r) : _mm512_setzero_ps();
    for (int t = 0; t < T; ++t) {
      __m512 v = acc[g][t];
      if (a.bias) v = _mm512_add_ps(v, b);
      if (a.gelu) v = gelu_erf16(v);
      _mm512_mask_storeu_ps(a.y + (t0 + t) * a.y_stride + r, m, v);
    }
  }
}

using FpTileFn = void (*)(const MatmulArgs&, int64_t, int64_t);

// Tokens per tile for G groups: G * T accumulators + G weights + 1 broadcast within 32 registers.
template <int G>
constexpr int fp_max_t() { return G == 1 ? 16 : G == 2 ? 12 : G == 3 ? 8 : 6; }

template <bool H, int G, size_t... I>
constexpr std::array<FpTileFn, sizeof...(I)> fp_row(std::index_sequence<I...>) {
  return {&fp_tile<H, G, (int)I + 1>...};
}

template <bool H, int G>
void fp_groups(const MatmulArgs& a, int64_t g0) {
  static constexpr auto fns = fp_row<H, G>(std::make_index_sequence<fp_max_t<G>()>{});
  constexpr int64_t TM = fp_max_t<G>();
  for (int64_t t0 = 0; t0 < a.n_tok; t0 += TM) fns[(size_t)(std::min(TM, a.n_tok - t0) - 1)](a, g0, t0);
}

template <bool H>
void fp_rows(const MatmulArgs& a, int64_t r0, int64_t r1) {
  const int64_t g_end = (r1 + 15) / 16;
  // Four groups at once: independent FMA chains for decode; for prefill, 4 groups x 6 tokens
  // load 10 values per 24 FMAs where 2 x 12 load 14 (measured ~10% faster on Zen 4, f16 and f32).
  const int64_t gmax = 4;
  for (int64_t g = r0 / 16; g < g_end;) {
    switch (std::min(gmax, g_end - g)) {
      case 4: fp_groups<H, 4>(a, g); g += 4; break;
      case 3: fp_groups<H, 3>(a, g); g += 3; break;
      case 2: fp_groups<H, 2>(a, g); g += 2; break;
      default: fp_groups<H, 1>(a, g); g += 1; break;
    }
  }
}

}  // namespace

size_t pack_bytes(uint32_t wtype, int64_t rows, int64_t k) {
  if (const size_t es = fp_esize(wtype)) return rows <= 0 || k <= 0 ? 0 : (size_t)((rows + 15) / 16) * (size_t)k * 16 * es;
  if (const size_t rec = k_rec(wtype)) {
    if (k % QK_K != 0 || rows <= 0) return 0;
    return (size_t)((rows + kRowsPerGroup - 1) / kRowsPerGroup) * (size_t)(k / QK_K) * rec;
  }
  Fmt f;
  if (!fmt_of(wtype, f) || k % 32 != 0 || rows <= 0) return 0;
  return (size_t)((rows + kRowsPerGroup - 1) / kRowsPerGroup) * group_bytes(f, k / 32);
}

void pack_rows(uint32_t wtype, const void* w, size_t row_bytes, int64_t rows, int64_t k, int64_t g0, int64_t g1,
               void* out) {
  if (const size_t es = fp_esize(wtype)) {
    // Transposed per group: element kk of row l at [kk][l]; padding rows are zeros.
    for (int64_t g = g0; g < g1; ++g) {
      uint8_t* o = static_cast<uint8_t*>(out) + (size_t)g * (size_t)k * 16 * es;
      for (int l = 0; l < kRowsPerGroup; ++l) {
        const int64_t r = g * kRowsPerGroup + l;
        const uint8_t* row = static_cast<const uint8_t*>(w) + (size_t)r * row_bytes;
        for (int64_t kk = 0; kk < k; ++kk) {
          if (r < rows)
            std::memcpy(o + ((size_t)kk * 16 + l) * es, row + (size_t)kk * es, es);
          else
            std::memset(o + ((size_t)kk * 16 + l) * es, 0, es);
        }
      }
    }
    return;
  }
  if (const size_t rec = k_rec(wtype)) {
    const int64_t nsb = k / QK_K;
    for (int64_t g = g0; g < g1; ++g) {
      const uint8_t* rp[kRowsPerGroup];
      bool valid[kRowsPerGroup];
      for (int l = 0; l < kRowsPerGroup; ++l) {
        const int64_t r = g * kRowsPerGroup + l;
        valid[l] = r < rows;
        rp[l] = static_cast<const uint8_t*>(w) + (size_t)std::min(r, rows - 1) * row_bytes;
      }
      const int ql = (int)(rec - 320) / 64;  // both records end in a 320-byte tail
      const SuperPos sp = super_pos(out, g, rows, nsb, ql, 320);
      uint8_t* L = const_cast<uint8_t*>(sp.line0);
      uint8_t* X = const_cast<uint8_t*>(sp.tail0);
      if ((GGMLType)wtype == GGMLType::Q4_K)
        pack_q4_K_group(rp, valid, nsb, L, X, sp.stride, sp.lstride);
      else
        pack_q6_K_group(rp, valid, nsb, L, X, sp.stride, sp.lstride);
    }
    return;
  }
  Fmt f;
  if (!fmt_of(wtype, f)) return;
  const int64_t nb = k / 32;
  const bool q8 = (GGMLType)wtype == GGMLType::Q8_0;
  const size_t gb = group_bytes(f, 1);
  for (int64_t g = g0; g < g1; ++g) {
    // Block b of this group: quant line l at Qg + b * S + l * LS, scales at Dg + b * S (super_pos).
    const SuperPos sp = super_pos(out, g, rows, nb, f.qbytes / 64, gb - f.qbytes);
    uint8_t* Qg = const_cast<uint8_t*>(sp.line0);
    uint8_t* Dg = const_cast<uint8_t*>(sp.tail0);
    uint8_t* Mg = Dg + 32;
    const size_t S = sp.stride, LS = sp.lstride;
    for (int l = 0; l < kRowsPerGroup; ++l) {
      const int64_t r = g * kRowsPerGroup + l;
      const uint8_t* row = static_cast<const uint8_t*>(w) + (size_t)std::min(r, rows - 1) * row_bytes;
      for (int64_t b = 0; b < nb; ++b) {
        uint8_t* q = Qg + b * S;
        uint16_t* D = reinterpret_cast<uint16_t*>(Dg + b * S);
        uint16_t* M = reinterpret_cast<uint16_t*>(Mg + b * S);
        if (r >= rows) {  // padding rows: zero scales; their outputs are never stored
          D[l] = 0;
          if (f.mins) M[l] = 0;
          for (int j = 0; j < f.qbytes / 64; ++j) std::memset(q + j * LS + l * 4, q8 ? 0x80 : 0, 4);
          continue;
        }
        if (q8) {
          const block_q8_0* blk = reinterpret_cast<const block_q8_0*>(row) + b;
          D[l] = blk->d;
          for (int j = 0; j < 8; ++j) std::memcpy(q + j * LS + l * 4, blk->qs + j * 4, 4);
        } else if ((GGMLType)wtype == GGMLType::Q5_0) {
          const block_q5_0* blk = reinterpret_cast<const block_q5_0*>(row) + b;
          D[l] = blk->d;
          for (int c = 0; c < 4; ++c) std::memcpy(q + c * LS + l * 4, blk->qs + c * 4, 4);
          // Byte j of the row's qh word: bit 2c = element 4c+j's fifth bit, bit 2c+1 = element 16+4c+j's.
          uint32_t qh;
          std::memcpy(&qh, blk->qh, 4);
          for (int j = 0; j < 4; ++j)
            q[4 * LS + l * 4 + j] = (uint8_t)(_pdep_u32(_pext_u32(qh, 0x1111u << j), 0x55) |
                                           _pdep_u32(_pext_u32(qh, 0x11110000u << j), 0xAA));
        } else if (f.mins) {
          const block_q4_1* blk = reinterpret_cast<const block_q4_1*>(row) + b;
          D[l] = blk->d;
          M[l] = blk->m;
          for (int c = 0; c < 4; ++c) std::memcpy(q + c * LS + l * 4, blk->qs + c * 4, 4);
        } else {
          const block_q4_0* blk = reinterpret_cast<const block_q4_0*>(row) + b;
          D[l] = blk->d;
          for (int c = 0; c < 4; ++c) std::memcpy(q + c * LS + l * 4, blk->qs + c * 4, 4);
        }
      }
    }
    if (q8) {  // signed -> unsigned (padding rows end up 0)
      const __m512i x80 = _mm512_set1_epi8(-128);
      for (int64_t b = 0; b < nb; ++b)
        for (int j = 0; j < 8; ++j) {
          uint8_t* v = Qg + b * S + j * LS;
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
    case GGMLType::Q4_K: k_rows<Q4KTile>(a, r0, r1); return true;
    case GGMLType::Q6_K: k_rows<Q6KTile>(a, r0, r1); return true;
    case GGMLType::F32: fp_rows<false>(a, r0, r1); return true;
    case GGMLType::F16: fp_rows<true>(a, r0, r1); return true;
    default: return false;
  }
}

#else  // no repacked layouts on this ISA: weights stay in their file layout

size_t pack_bytes(uint32_t, int64_t, int64_t) { return 0; }
void pack_rows(uint32_t, const void*, size_t, int64_t, int64_t, int64_t, int64_t, void*) {}
bool matmul_packed(const MatmulArgs&, int64_t, int64_t) { return false; }

#endif

}  // namespace dl::cpu::DL_ISA
