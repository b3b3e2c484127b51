// Repacked weight layouts made once at load (Backend::prepare), and the matmul that reads them.
//
// q8_0 in groups of 16 rows (AVX-512 VNNI only; other ISAs keep the file layout): per group,
// per block column b, 576 bytes:
//   float dw[16]          the 16 rows' block scales, already f32
//   uint8 q[8][16][4]     chunk j holds elements 4j..4j+3 of block b of each row (lane = row),
//                         shifted to unsigned (q ^ 0x80, i.e. q + 128)
// One broadcast of 4 activation bytes and one VNNI product advance 16 rows at once, and the
// 16 outputs of a group land in one register: no unpacking, no horizontal sums. Decode and
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
constexpr size_t kBlockBytes = 64 + 512;

// Output groups [g, g + G) (rows g*16 ...) x tokens [t0, t0 + T). Independent (group, token)
// chains keep the VNNI unit busy; the arithmetic of each output does not depend on G or T.
template <int G, int T>
void q8p_tile(const MatmulArgs& a, int64_t g, int64_t t0) {
  const int64_t nb = a.k / 32, kp = act_a8_padded_k(a.k);
  const uint8_t* A[T];
  const float* da[T];
  const float* sa[T];
  for (int t = 0; t < T; ++t) {
    A[t] = static_cast<const uint8_t*>(a.act) + (size_t)(t0 + t) * a.act_row_bytes;
    da[t] = reinterpret_cast<const float*>(A[t] + kp);
    sa[t] = da[t] + kp / 32;
  }
  const uint8_t* P[G];
  for (int i = 0; i < G; ++i) P[i] = static_cast<const uint8_t*>(a.wpack) + (size_t)(g + i) * nb * kBlockBytes;
  __m512 acc[G][T];
  for (int i = 0; i < G; ++i)
    for (int t = 0; t < T; ++t) acc[i][t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m512i is[G][T];
    for (int i = 0; i < G; ++i)
      for (int t = 0; t < T; ++t) is[i][t] = _mm512_setzero_si512();
    for (int i = 0; i < G; ++i) _mm_prefetch(reinterpret_cast<const char*>(P[i] + (b + 3) * kBlockBytes), _MM_HINT_T0);
    for (int j = 0; j < 8; ++j) {
      __m512i x[T];
      for (int t = 0; t < T; ++t) {
        int32_t v;
        std::memcpy(&v, A[t] + b * 32 + j * 4, 4);
        x[t] = _mm512_set1_epi32(v);
      }
      for (int i = 0; i < G; ++i) {
        const __m512i wq = _mm512_load_si512(P[i] + b * kBlockBytes + 64 + j * 64);
        for (int t = 0; t < T; ++t) is[i][t] = _mm512_dpbusd_epi32(is[i][t], wq, x[t]);
      }
    }
    for (int i = 0; i < G; ++i) {
      const __m512 dw = _mm512_load_ps(reinterpret_cast<const float*>(P[i] + b * kBlockBytes));
      for (int t = 0; t < T; ++t) {
        // sum (u - 128) qa dw da = dw da sum(u qa) - 128 dw (da sum qa); sa = da sum qa.
        acc[i][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is[i][t]), _mm512_mul_ps(dw, _mm512_set1_ps(da[t][b])), acc[i][t]);
        acc[i][t] = _mm512_fmadd_ps(dw, _mm512_set1_ps(-128.0f * sa[t][b]), acc[i][t]);
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

template <int G>
void q8p_groups(const MatmulArgs& a, int64_t g, int64_t n_tok) {
  for (int64_t t = 0; t < n_tok; t += 4) {
    switch (std::min<int64_t>(4, n_tok - t)) {
      case 1: q8p_tile<G, 1>(a, g, t); break;
      case 2: q8p_tile<G, 2>(a, g, t); break;
      case 3: q8p_tile<G, 3>(a, g, t); break;
      default: q8p_tile<G, 4>(a, g, t); break;
    }
  }
}

}  // namespace

size_t pack_bytes(uint32_t wtype, int64_t rows, int64_t k) {
  if (wtype != (uint32_t)GGMLType::Q8_0 || k % 32 != 0 || rows <= 0) return 0;
  return (size_t)((rows + kRowsPerGroup - 1) / kRowsPerGroup) * (size_t)(k / 32) * kBlockBytes;
}

void pack_rows(uint32_t wtype, const void* w, size_t row_bytes, int64_t rows, int64_t k, int64_t g0, int64_t g1,
               void* out) {
  if (wtype != (uint32_t)GGMLType::Q8_0) return;
  const int64_t nb = k / 32;
  for (int64_t g = g0; g < g1; ++g) {
    uint8_t* P = static_cast<uint8_t*>(out) + (size_t)g * nb * kBlockBytes;
    for (int64_t b = 0; b < nb; ++b) {
      float* dw = reinterpret_cast<float*>(P + b * kBlockBytes);
      uint8_t* q = P + b * kBlockBytes + 64;
      for (int l = 0; l < kRowsPerGroup; ++l) {
        const int64_t r = g * kRowsPerGroup + l;
        if (r >= rows) {  // padding rows: zero weights and scale; their outputs are never stored
          dw[l] = 0.0f;
          for (int j = 0; j < 8; ++j) std::memset(q + j * 64 + l * 4, 0x80, 4);
          continue;
        }
        const block_q8_0* blk = reinterpret_cast<const block_q8_0*>(static_cast<const uint8_t*>(w) + (size_t)r * row_bytes) + b;
        dw[l] = _cvtsh_ss(blk->d);
        for (int j = 0; j < 8; ++j) std::memcpy(q + j * 64 + l * 4, blk->qs + j * 4, 4);
      }
      const __m512i x80 = _mm512_set1_epi8(-128);  // signed -> unsigned (pad rows end up 0)
      for (int j = 0; j < 8; ++j) {
        __m512i* v = reinterpret_cast<__m512i*>(q + j * 64);
        _mm512_store_si512(v, _mm512_xor_si512(_mm512_load_si512(v), x80));
      }
    }
  }
}

bool matmul_packed(const MatmulArgs& a, int64_t r0, int64_t r1) {
  if (a.wpack == nullptr || a.wtype != (uint32_t)GGMLType::Q8_0) return false;
  // Row ranges start on a group (the backend cuts chunks in multiples of 16).
  int64_t g = r0 / kRowsPerGroup;
  const int64_t g1 = (r1 + kRowsPerGroup - 1) / kRowsPerGroup;
  if (a.n_tok == 1)
    for (; g + 4 <= g1; g += 4) q8p_groups<4>(a, g, 1);
  for (; g + 2 <= g1; g += 2) q8p_groups<2>(a, g, a.n_tok);
  for (; g < g1; ++g) q8p_groups<1>(a, g, a.n_tok);
  return true;
}

#else  // no repacked layouts on this ISA: weights stay in their file layout

size_t pack_bytes(uint32_t, int64_t, int64_t) { return 0; }
void pack_rows(uint32_t, const void*, size_t, int64_t, int64_t, int64_t, int64_t, void*) {}
bool matmul_packed(const MatmulArgs&, int64_t, int64_t) { return false; }

#endif

}  // namespace dl::cpu::DL_ISA
