// Tensor-core matmul in q8 mode: int8 mma.sync (m16n8k32) over the split q8_0 / q4_0
// layouts and the 8-bit activations quantize_act makes. One mma is one 32-block of one
// 16-row x 8-token tile, so its int32 sums are the CPU's per-block integer dot products,
// scaled per block by d_w * d_x (less 8 * the activation's quant sum for q4_0) into f32,
// as the GEMV does. Used for prefill (mma_tile_k: shared-memory tiles of 64 rows x 64 tokens,
// token tiles of one row block adjacent in the grid so the weights come from L2) and batched
// decode from 9 tokens (tiles 16 / 32 / 64 tokens wide, k split over a cluster where the tiles
// are few); 8 tokens, or where the tiles do not fit, take mma_q8_k (a warp per 16 rows, eight
// warps splitting k, the weights streamed once). K-quant batched steps of 5-32 tokens take
// mma_k_i8_k, the same shape over gemv_k_i8_k's pairs of sub-blocks.
// The prefill of f16 weights runs on f16 mmas here too (mma_f16h_k), of bf16 on TF32 (mma_f16_k).
#include <cooperative_groups.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>

#include "common.cuh"
#include "dequant.cuh"
#include "kernels.h"

namespace dl::cuda {
namespace {

__device__ __host__ __forceinline__ int64_t lmin(int64_t a, int64_t b) { return a < b ? a : b; }

// C += A (16x32, rows) * B (32x8, cols), int8 in, int32 out. Fragments (PTX ISA, lane =
// 4 g + c): a0 / a1 hold k 4c..4c+3 of rows g / g+8, a2 / a3 k 16+4c.. of the same rows;
// b0 / b1 k 4c.. / 16+4c.. of token g; C: rows g (c0, c1) and g+8 (c2, c3), tokens 2c, 2c+1.
// Any order of k taken alike by A and B gives the same sums: q8_0 feeds bytes 8c..8c+7 as
// (a0, a2) and (b0, b1), one 8-byte load each.
__device__ __forceinline__ void mma_s8(int (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                       uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#endif
}

// D = A * B + C with C given apart from D (the tiles pass a constant bias as C).
__device__ __forceinline__ void mma_s8c(int (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                        uint32_t b1, int c0, int c1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%11,%10,%11};\n"
      : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "r"(c0), "r"(c1));
#endif
}

// One 32-block of two rows (g, g+8) as A fragments, and the rows' block scales.
template <uint32_t T>
__device__ __forceinline__ void load_a(const uint8_t* r0, const uint8_t* r1, int64_t cols, int64_t b, int c,
                                       uint32_t (&a)[4], float (&d)[2]) {
  if constexpr (T == T_Q8_0S) {
    const uint2 u = __ldg(reinterpret_cast<const uint2*>(r0 + b * 32 + c * 8));
    const uint2 v = __ldg(reinterpret_cast<const uint2*>(r1 + b * 32 + c * 8));
    a[0] = u.x, a[1] = v.x, a[2] = u.y, a[3] = v.y;
    d[0] = h2f(__ldg(reinterpret_cast<const uint16_t*>(r0 + cols) + b));
    d[1] = h2f(__ldg(reinterpret_cast<const uint16_t*>(r1 + cols) + b));
  } else {  // q4_0: byte i holds element i (low nibble) and i + 16 (high): k 4c.. and 16+4c..
    const uint32_t u = __ldg(reinterpret_cast<const uint32_t*>(r0 + b * 16 + c * 4));
    const uint32_t v = __ldg(reinterpret_cast<const uint32_t*>(r1 + b * 16 + c * 4));
    a[0] = u & 0x0F0F0F0Fu, a[1] = v & 0x0F0F0F0Fu, a[2] = (u >> 4) & 0x0F0F0F0Fu, a[3] = (v >> 4) & 0x0F0F0F0Fu;
    d[0] = h2f(__ldg(reinterpret_cast<const uint16_t*>(r0 + cols / 2) + b));
    d[1] = h2f(__ldg(reinterpret_cast<const uint16_t*>(r1 + cols / 2) + b));
  }
}

// Token row xr's block b as B fragments, in A's order of k.
template <uint32_t T>
__device__ __forceinline__ void load_b(const int8_t* xr, int64_t b, int c, uint32_t& b0, uint32_t& b1) {
  if constexpr (T == T_Q8_0S) {
    const uint2 u = __ldg(reinterpret_cast<const uint2*>(xr + b * 32 + c * 8));
    b0 = u.x, b1 = u.y;
  } else {
    b0 = __ldg(reinterpret_cast<const uint32_t*>(xr + b * 32 + c * 4));
    b1 = __ldg(reinterpret_cast<const uint32_t*>(xr + b * 32 + 16 + c * 4));
  }
}

// A block of WM x WK warps: WM row tiles of 16, each k range split WK ways (partials meet
// in shared memory); NT token tiles of 8 from token blockIdx.x * 8 NT; blockIdx.y picks the
// row block (matrix j.first_block[i] on).
// MINB = 2 asks for two blocks an SM (128 registers; for 64 tokens the default takes ~240, so one
// block of 8 warps an SM), with 4 blocks of weights in flight a warp instead of 8: the same bytes
// in flight an SM, twice the warps to hide the activations' loads (DASLLAMA_CUDA_MMA_MINB=2).
template <uint32_t T, int WM, int WK, int NT, int MINB = 1>
__global__ void __launch_bounds__(WM * WK * 32, MINB) mma_q8_k(GemvJob j) {
  pdl_wait();
  pdl_trigger();
  constexpr int UB = WK > 1 && MINB == 1 ? 8 : 4;  // blocks whose weights are loaded before their mmas (decode: more in flight)
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
  const int wm = warp % WM, wk = warp / WM;
  int mi = 0;
  while (mi + 1 < j.count && (int64_t)blockIdx.y >= j.first_block[mi + 1]) ++mi;
  const int64_t rows = j.rows[mi], cols = j.cols, nb = cols / 32;
  const int64_t r0 = ((int64_t)blockIdx.y - j.first_block[mi]) * (16 * WM) + wm * 16;
  const int64_t t0 = (int64_t)blockIdx.x * (8 * NT);
  const size_t rb = j.rb[mi];
  const uint8_t* wa = j.w[mi] + lmin(r0 + g, rows - 1) * rb;
  const uint8_t* wb = j.w[mi] + lmin(r0 + g + 8, rows - 1) * rb;
  // Token rows past n read the last one (their sums are dropped).
  // (32-bit offsets: 64-bit pointers and indices for NT = 8 cost 32 registers, the difference
  // between one and two blocks an SM.)
  int32_t xo[NT], tc[NT][2];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    xo[nt] = (int32_t)(lmin(t0 + nt * 8 + g, j.n - 1) * cols);
    tc[nt][0] = (int32_t)(lmin(t0 + nt * 8 + 2 * c, j.n - 1) * nb);
    tc[nt][1] = (int32_t)(lmin(t0 + nt * 8 + 2 * c + 1, j.n - 1) * nb);
  }
  const int64_t per = (nb + WK - 1) / WK, kb0 = wk * per, kb1 = lmin(nb, kb0 + per);
  float acc[NT][4];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
  for (int64_t b0 = kb0; b0 < kb1; b0 += UB) {
    uint32_t a[UB][4];
    float d[UB][2];
#pragma unroll
    for (int u = 0; u < UB; ++u) {
      if (b0 + u < kb1) {
        load_a<T>(wa, wb, cols, b0 + u, c, a[u], d[u]);
      } else {
        a[u][0] = a[u][1] = a[u][2] = a[u][3] = 0u;
        d[u][0] = d[u][1] = 0.f;
      }
    }
#pragma unroll
    for (int u = 0; u < UB; ++u) {
      const int64_t b = b0 + u;
      if (b >= kb1) break;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        uint32_t x0, x1;
        load_b<T>(j.xq + xo[nt], b, c, x0, x1);
        int s[4] = {0, 0, 0, 0};
        mma_s8(s, a[u][0], a[u][1], a[u][2], a[u][3], x0, x1);
        const float dx0 = __ldg(j.xd + tc[nt][0] + b), dx1 = __ldg(j.xd + tc[nt][1] + b);
        if constexpr (T == T_Q4_0S) {  // the nibbles are q + 8: take 8 * the quant sum off
          const int o0 = 8 * __ldg(j.xs + tc[nt][0] + b), o1 = 8 * __ldg(j.xs + tc[nt][1] + b);
          s[0] -= o0, s[1] -= o1, s[2] -= o0, s[3] -= o1;
        }
        acc[nt][0] += (float)s[0] * __fmul_rn(d[u][0], dx0);
        acc[nt][1] += (float)s[1] * __fmul_rn(d[u][0], dx1);
        acc[nt][2] += (float)s[2] * __fmul_rn(d[u][1], dx0);
        acc[nt][3] += (float)s[3] * __fmul_rn(d[u][1], dx1);
      }
    }
  }
  float* y = j.y[mi];
  auto put = [&](int64_t r, int64_t t, float v) {
    if (r >= rows || t >= j.n) return;
    float* p = y + t * rows + r;
    *p = j.accumulate ? *p + v : v;
  };
  if constexpr (WK == 1) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const int64_t t = t0 + nt * 8 + 2 * c;
      put(r0 + g, t, acc[nt][0]), put(r0 + g, t + 1, acc[nt][1]);
      put(r0 + g + 8, t, acc[nt][2]), put(r0 + g + 8, t + 1, acc[nt][3]);
    }
  } else {
    __shared__ float red[WK][WM][NT][32][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) red[wk][wm][nt][lane][i] = acc[nt][i];
    __syncthreads();
    if (wk != 0) return;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      float v[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        v[i] = red[0][wm][nt][lane][i];
#pragma unroll
        for (int p = 1; p < WK; ++p) v[i] += red[p][wm][nt][lane][i];
      }
      const int64_t t = t0 + nt * 8 + 2 * c;
      put(r0 + g, t, v[0]), put(r0 + g, t + 1, v[1]);
      put(r0 + g + 8, t, v[2]), put(r0 + g + 8, t + 1, v[3]);
    }
  }
}

// ---- K-quants (q4_K, q5_K, q6_K) of 2-32 tokens on int8 mmas (k_mma_on: 5-32 by default) ----
// gemv_k_i8_k's pairs of sub-blocks (matmul.cu: q4_K / q5_K sub-blocks 2k and 2k + 1, the low
// and high nibbles of the same 32 bytes; q6_K sub-blocks s and s + 2 of half h) as A fragments:
// lane (g, c) holds the words of elements 4c.. and 16 + 4c.. of rows g and g + 8, and x's block
// of the sub-block gives the B fragments in the same order of k, so one m16n8k32 is one
// sub-block's integer dot products for 16 rows x 8 tokens. q4_K / q5_K scale a sub-block's sum by
// d * sc and take dmin * m * (x's quant sum) off; q6_K's 16-element scales take two mmas a
// sub-block, each with the other half's words zero. A block is 8 warps over one 16-row tile,
// splitting its pairs; their partial sums meet in shared memory.
template <uint32_t T> struct KmRaw {  // one pair of rows g, g + 8 (index 0, 1) as lane (g, c) reads it
  uint4 h[2];                         // q4_K / q5_K: the block header
  uint32_t q[2][2], e[2][2];          // the quant words of elements 4c.., 16 + 4c..; q5_K's high-bit words
};
template <> struct KmRaw<T_Q6_K> {
  uint32_t l[2][4], m[2][4];  // the aligned words around ql's / qh's two words (shifted at decoding)
  uint32_t sc[2][2], d[2];    // the two 2-byte scale pairs, the f16 d
};

template <uint32_t T>
__device__ __forceinline__ void km_load(const uint8_t* const (&row)[2], int p, int c, KmRaw<T>& r) {
  const int sb = p >> 2, k = p & 3;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const uint8_t* b = row[i] + (int64_t)sb * Blk<T>::bytes;
    if constexpr (T == T_Q6_K) {
      const int h = k >> 1, s = k & 1;
      const auto* l = reinterpret_cast<const uint32_t*>(reinterpret_cast<uintptr_t>(b + h * 64 + s * 32) & ~uintptr_t(3));
      const auto* m = reinterpret_cast<const uint32_t*>(reinterpret_cast<uintptr_t>(b + 128 + h * 32) & ~uintptr_t(3));
      r.l[i][0] = __ldg(l + c), r.l[i][1] = __ldg(l + c + 1), r.l[i][2] = __ldg(l + c + 4), r.l[i][3] = __ldg(l + c + 5);
      r.m[i][0] = __ldg(m + c), r.m[i][1] = __ldg(m + c + 1), r.m[i][2] = __ldg(m + c + 4), r.m[i][3] = __ldg(m + c + 5);
      r.sc[i][0] = ld16(b + 192 + h * 8 + s * 2), r.sc[i][1] = ld16(b + 196 + h * 8 + s * 2), r.d[i] = ld16(b + 208);
    } else {
      constexpr int qs_off = T == T_Q4_K ? 16 : 48;
      r.h[i] = __ldg(reinterpret_cast<const uint4*>(b));
      const auto* q = reinterpret_cast<const uint32_t*>(b + qs_off + 32 * k);
      r.q[i][0] = __ldg(q + c), r.q[i][1] = __ldg(q + 4 + c);
      if constexpr (T == T_Q5_K) {
        const auto* e = reinterpret_cast<const uint32_t*>(b + 16);
        r.e[i][0] = __ldg(e + c), r.e[i][1] = __ldg(e + 4 + c);
      }
    }
  }
}

// Pair p's two sub-blocks u (0, 1): A fragments a[u], the rows' scales w[u][row][half] (q4_K /
// q5_K: both halves d * sc), mins n[u][row] (q6_K: 0), x's block of each sub-block xb[u].
template <uint32_t T>
__device__ __forceinline__ void km_dec(const KmRaw<T>& r, const uint8_t* const (&row)[2], int p, uint32_t (&a)[2][4],
                                       float (&w)[2][2][2], float (&n)[2][2], int64_t (&xb)[2]) {
  const int sb = p >> 2, k = p & 3;
  if constexpr (T == T_Q6_K) {
    const int h = k >> 1, s = k & 1;
    xb[0] = (int64_t)sb * 8 + h * 4 + s, xb[1] = xb[0] + 2;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const uint32_t sh = (uint32_t)(reinterpret_cast<uintptr_t>(row[i] + (int64_t)sb * 210) & 2) * 8;  // (mod 4)
      uint32_t ql[2], qh[2];
      ql[0] = __funnelshift_r(r.l[i][0], r.l[i][1], sh), ql[1] = __funnelshift_r(r.l[i][2], r.l[i][3], sh);
      qh[0] = __funnelshift_r(r.m[i][0], r.m[i][1], sh), qh[1] = __funnelshift_r(r.m[i][2], r.m[i][3], sh);
#pragma unroll
      for (int v = 0; v < 2; ++v) {
        a[0][v * 2 + i] = __vsub4((ql[v] & 0x0F0F0F0Fu) | ((qh[v] >> (2 * s)) & 0x03030303u) << 4, 0x20202020u);
        a[1][v * 2 + i] = __vsub4(((ql[v] >> 4) & 0x0F0F0F0Fu) | ((qh[v] >> (2 * s + 4)) & 0x03030303u) << 4, 0x20202020u);
      }
      const float d = h2f((uint16_t)r.d[i]);
      w[0][i][0] = d * (float)(int8_t)(r.sc[i][0] & 0xFFu), w[0][i][1] = d * (float)(int8_t)(r.sc[i][0] >> 8);
      w[1][i][0] = d * (float)(int8_t)(r.sc[i][1] & 0xFFu), w[1][i][1] = d * (float)(int8_t)(r.sc[i][1] >> 8);
      n[0][i] = n[1][i] = 0.f;
    }
  } else {
    xb[0] = (int64_t)sb * 8 + 2 * k, xb[1] = xb[0] + 1;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const float d = h2f((uint16_t)(r.h[i].x & 0xFFFFu)), dmin = h2f((uint16_t)(r.h[i].x >> 16));
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        int sc, mn;
        k_scale_min_r(r.h[i], 2 * k + u, sc, mn);
        w[u][i][0] = w[u][i][1] = d * (float)sc, n[u][i] = dmin * (float)mn;
      }
#pragma unroll
      for (int v = 0; v < 2; ++v) {
        uint32_t lo = r.q[i][v] & 0x0F0F0F0Fu, hi = (r.q[i][v] >> 4) & 0x0F0F0F0Fu;
        if constexpr (T == T_Q5_K) {
          lo |= ((r.e[i][v] >> (2 * k)) & 0x01010101u) << 4;
          hi |= ((r.e[i][v] >> (2 * k + 1)) & 0x01010101u) << 4;
        }
        a[0][v * 2 + i] = lo, a[1][v * 2 + i] = hi;  // (a0, a1: rows g, g + 8 at 4c..; a2, a3 at 16 + 4c..)
      }
    }
  }
}

template <uint32_t T, int NT>
__global__ void __launch_bounds__(256) mma_k_i8_k(GemvJob j) {
  constexpr int WK = 8, UB = 2;  // warps splitting a tile's pairs; pairs a lane has in flight
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
  int mi = 0;
  while (mi + 1 < j.count && (int64_t)blockIdx.y >= j.first_block[mi + 1]) ++mi;
  const int64_t rows = j.rows[mi], cols = j.cols, nb = cols / 32;
  const int64_t r0 = ((int64_t)blockIdx.y - j.first_block[mi]) * 16;
  const int64_t t0 = (int64_t)blockIdx.x * (8 * NT);
  const size_t rb = j.rb[mi];
  const uint8_t* const row[2] = {j.w[mi] + lmin(r0 + g, rows - 1) * rb, j.w[mi] + lmin(r0 + g + 8, rows - 1) * rb};
  const int pairs = (int)(cols / 64), per = (pairs + WK - 1) / WK, p0 = warp * per, p1 = (int)lmin(pairs, p0 + per);
  KmRaw<T> raw[UB];
  auto load = [&](int pb) {
#pragma unroll
    for (int u = 0; u < UB; ++u)
      if (pb + u < p1) km_load<T>(row, pb + u, c, raw[u]);
  };
  load(p0);  // the weights are constant: in flight before x (the step before) is ready
  pdl_wait();
  pdl_trigger();
  // Token rows past n read the last one (their sums are dropped).
  int64_t xo[NT], tc[NT][2];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    xo[nt] = lmin(t0 + nt * 8 + g, j.n - 1) * cols;
    tc[nt][0] = lmin(t0 + nt * 8 + 2 * c, j.n - 1) * nb;
    tc[nt][1] = lmin(t0 + nt * 8 + 2 * c + 1, j.n - 1) * nb;
  }
  float acc[NT][4];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
  for (int pb = p0; pb < p1; pb += UB) {
    if (pb != p0) load(pb);
#pragma unroll
    for (int u = 0; u < UB; ++u) {
      const int p = pb + u;
      if (p >= p1) break;
      uint32_t a[2][4];
      float w[2][2][2], mn[2][2];
      int64_t xb[2];
      km_dec<T>(raw[u], row, p, a, w, mn, xb);
#pragma unroll
      for (int sub = 0; sub < 2; ++sub)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          const int8_t* xr = j.xq + xo[nt] + xb[sub] * 32;
          const uint32_t b0 = __ldg(reinterpret_cast<const uint32_t*>(xr) + c);
          const uint32_t b1 = __ldg(reinterpret_cast<const uint32_t*>(xr) + 4 + c);
          const float dx0 = __ldg(j.xd + tc[nt][0] + xb[sub]), dx1 = __ldg(j.xd + tc[nt][1] + xb[sub]);
          float v[4];
          if constexpr (T == T_Q6_K) {
            int lo[4] = {0, 0, 0, 0}, hi[4] = {0, 0, 0, 0};
            mma_s8(lo, a[sub][0], a[sub][1], 0u, 0u, b0, b1);
            mma_s8(hi, 0u, 0u, a[sub][2], a[sub][3], b0, b1);
#pragma unroll
            for (int q = 0; q < 4; ++q) v[q] = w[sub][q >> 1][0] * (float)lo[q] + w[sub][q >> 1][1] * (float)hi[q];
          } else {
            int sm[4] = {0, 0, 0, 0};
            mma_s8(sm, a[sub][0], a[sub][1], a[sub][2], a[sub][3], b0, b1);
            const float xs0 = (float)__ldg(j.xs + tc[nt][0] + xb[sub]), xs1 = (float)__ldg(j.xs + tc[nt][1] + xb[sub]);
#pragma unroll
            for (int q = 0; q < 4; ++q) v[q] = w[sub][q >> 1][0] * (float)sm[q] - mn[sub][q >> 1] * ((q & 1) ? xs1 : xs0);
          }
          acc[nt][0] += dx0 * v[0], acc[nt][1] += dx1 * v[1];
          acc[nt][2] += dx0 * v[2], acc[nt][3] += dx1 * v[3];
        }
    }
  }
  __shared__ float red[WK][NT][32][4];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int i = 0; i < 4; ++i) red[warp][nt][lane][i] = acc[nt][i];
  __syncthreads();
  if (warp != 0) return;
  float* y = j.y[mi];
  auto put = [&](int64_t r, int64_t t, float v) {
    if (r >= rows || t >= j.n) return;
    float* o = y + t * rows + r;
    *o = j.accumulate ? *o + v : v;
  };
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    float v[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      v[i] = red[0][nt][lane][i];
#pragma unroll
      for (int q = 1; q < WK; ++q) v[i] += red[q][nt][lane][i];
    }
    const int64_t t = t0 + nt * 8 + 2 * c;
    put(r0 + g, t, v[0]), put(r0 + g, t + 1, v[1]);
    put(r0 + g + 8, t, v[2]), put(r0 + g + 8, t + 1, v[3]);
  }
}

// ---- Prefill: shared-memory tiles ----
// Past 64 tokens a block takes 64 weight rows x 64 tokens; each stage of KB 32-blocks of k
// (weights, activations and both sides' block scales) is copied into shared memory with
// cp.async while the previous stage is computed, and fragments come from it through
// ldmatrix. Every weight and activation byte is read from L2 once per block, not once per
// warp and mma. Four warps each own 32 rows x 32 tokens (2 x 4 mma tiles). The per-block
// scaling is the same expression, in the same order of k, as mma_q8_k's. (Tried: four stages
// of 2 blocks, slower on the H200; 128-row tiles, no faster.)
// (sm_80+, as the mmas: below it these compile to nothing and the hosts never launch the tiles,
// so the compute_75 PTX still assembles for the module's other kernels.)
__device__ __forceinline__ void cp_async(void* s, const void* g, int bytes, bool ok) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned sa = (unsigned)__cvta_generic_to_shared(s);
  const int src = ok ? bytes : 0;  // 0: nothing is read, the destination is zero-filled
  if (bytes == 16) asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(sa), "l"(g), "r"(src));
  else if (bytes == 8) asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(sa), "l"(g), "r"(src));
  else asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(sa), "l"(g), "r"(src));
#endif
}
__device__ __forceinline__ void cp_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}
template <int N>
__device__ __forceinline__ void cp_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
#endif
}
__device__ __forceinline__ void ldsm4(uint32_t (&r)[4], const void* p) {
  const unsigned a = (unsigned)__cvta_generic_to_shared(p);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}

// The tile kernels' copy pipeline, S stages of `step` k units each: stages_begin issues the
// first S - 1 (their weights before the wait for the activations: weights are constant), one
// commit group a stage, empty past the end so the waits count right; stage_ready(s) waits for
// stage s, then refills the buffer stage s - 1 used (every thread is past it) with stage
// s + S - 1.
template <int S, class LW, class LX>
__device__ __forceinline__ void stages_begin(int64_t stages, int64_t step, LW load_w, LX load_x) {
#pragma unroll
  for (int p = 0; p < S - 1; ++p)
    if (p < stages) load_w(p, p * step);
  pdl_wait();
  pdl_trigger();
#pragma unroll
  for (int p = 0; p < S - 1; ++p) {
    if (p < stages) load_x(p, p * step);
    cp_commit();
  }
}
template <int S, class LW, class LX>
__device__ __forceinline__ void stage_ready(int64_t s, int64_t stages, int64_t step, LW load_w, LX load_x) {
  cp_wait<S - 2>();
  __syncthreads();
  if (s + S - 1 < stages) {
    const int nx = (int)((s + S - 1) % S);
    load_w(nx, (s + S - 1) * step), load_x(nx, (s + S - 1) * step);
  }
  cp_commit();
}

constexpr int kTileM = 64, kTileKB = 4, kStages = 2;

// This block's stages of k when the grid's z splits `all` of them: all, or its split's share
// (ceil(all / z) a split, the last ones short or empty); `first` its first stage.
__device__ __forceinline__ int64_t split_share(int64_t all, int64_t& first) {
  const int64_t per = (all + gridDim.z - 1) / gridDim.z;
  first = (int64_t)blockIdx.z * per;
  return lmin(all, first + per) - first > 0 ? lmin(all, first + per) - first : 0;
}

// Split k (gridDim.z > 1, batched decode's small matrices): the blocks of one tile over k form
// a thread-block cluster (sm_90); each leaves its 64 x 64 partial sums in its shared memory and,
// after a cluster barrier, each sums a share of the tile over all ranks in rank order through
// distributed shared memory (the same bits every run), then stores it.
// BN tokens a tile: 64 (prefill, 64-token batched steps; warps of 32 rows x 32 tokens) or 16 / 32
// (smaller batched steps: four warps of 16 rows x BN tokens, no token slots wasted on padding).
template <uint32_t T, int BN = 64>
__global__ void __launch_bounds__(128, 4) mma_tile_k(GemvJob j) {
  constexpr bool Q4 = T == T_Q4_0S;
  constexpr int BM = kTileM, KB = kTileKB, S = kStages;
  constexpr int WMW = BN == 64 ? 2 : 4, MT = 4 / WMW, NT = BN / 8 / (4 / WMW);  // warps along m; a warp's tiles
  constexpr int WR = MT * 16, WC = NT * 8;                                         // a warp's rows, tokens
  constexpr int QB = Q4 ? 16 : 32;      // bytes of one 32-block of a weight row
  constexpr int AS = KB * QB + 16;      // shared row strides: 16 bytes of padding keep the
  constexpr int XS = KB * 32 + 16;      // eight rows an ldmatrix reads on distinct banks
  __shared__ __align__(16) uint8_t sa[S][BM * AS];
  __shared__ __align__(16) uint8_t sx[S][BN * XS];
  __shared__ __align__(8) uint16_t sdw[S][BM][KB];
  __shared__ float sdx[S][BN][KB];
  __shared__ int sxs[S][Q4 ? BN : 1][KB];

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, c = lane & 3;
  const int wm = warp % WMW, wn = warp / WMW;
  int mi = 0;
  while (mi + 1 < j.count && (int64_t)blockIdx.y >= j.first_block[mi + 1]) ++mi;
  const int64_t rows = j.rows[mi], cols = j.cols, nb = cols / 32, n = j.n;
  const int64_t r0 = ((int64_t)blockIdx.y - j.first_block[mi]) * BM, t0 = (int64_t)blockIdx.x * BN;
  const size_t rb = j.rb[mi];
  const uint8_t* W = j.w[mi];
  const int64_t soff = Q4 ? cols / 2 : cols;  // the row's f16 block scales follow its quants

  // Rows and tokens past the end read the last one (their sums are not stored); blocks past
  // nb are zero-filled and skipped.
  auto load_w = [&](int st, int64_t kb0) {
    constexpr int CH = KB * QB / 16;
    for (int i = tid; i < BM * CH; i += 128) {
      const int r = i / CH, ch = i % CH;
      const bool ok = kb0 + ch * 16 / QB < nb;
      const uint8_t* src = W + lmin(r0 + r, rows - 1) * rb + (ok ? kb0 * QB + ch * 16 : 0);
      cp_async(&sa[st][r * AS + ch * 16], src, 16, ok);
    }
    if (tid < BM) cp_async(&sdw[st][tid][0], W + lmin(r0 + tid, rows - 1) * rb + soff + 2 * kb0, 2 * KB, true);
  };
  auto load_x = [&](int st, int64_t kb0) {
    for (int i = tid; i < BN * KB * 2; i += 128) {
      const int t = i / (KB * 2), ch = i % (KB * 2);
      const bool ok = kb0 + ch / 2 < nb;
      const int8_t* src = j.xq + lmin(t0 + t, n - 1) * cols + (ok ? kb0 * 32 + ch * 16 : 0);
      cp_async(&sx[st][t * XS + ch * 16], src, 16, ok);
    }
    for (int i = tid; i < BN * KB; i += 128) {
      const int t = i / KB, u = i % KB;
      const bool ok = kb0 + u < nb;
      const int64_t at = lmin(t0 + t, n - 1) * nb + (ok ? kb0 + u : 0);
      cp_async(&sdx[st][t][u], j.xd + at, 4, ok);
      if constexpr (Q4) cp_async(&sxs[st][t][u], j.xs + at, 4, ok);
    }
  };

  float acc[MT][NT][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) acc[mt][nt][0] = acc[mt][nt][1] = acc[mt][nt][2] = acc[mt][nt][3] = 0.f;

  int64_t sb;
  const int64_t stages = split_share((nb + KB - 1) / KB, sb), kb_base = sb * KB;
  auto lw = [&](int st, int64_t kb) { load_w(st, kb_base + kb); };
  auto lx = [&](int st, int64_t kb) { load_x(st, kb_base + kb); };
  stages_begin<S>(stages, KB, lw, lx);
  for (int64_t s = 0; s < stages; ++s) {
    const int st = (int)(s % S);
    stage_ready<S>(s, stages, KB, lw, lx);
#pragma unroll 1
    for (int u = 0; u < KB; ++u) {
      if (kb_base + s * KB + u >= nb) break;
      uint32_t a[MT][4];
      if constexpr (Q4) {  // one ldmatrix: rows wm*WR + lane's packed block; nibbles are k and k + 16
        uint32_t q[4];
        ldsm4(q, &sa[st][(wm * WR + (lane & (WR - 1))) * AS + u * 16]);  // WR = 16: lanes 16-31 repeat
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          const uint32_t lo = q[2 * mt], hi = q[2 * mt + 1];
          a[mt][0] = lo & 0x0F0F0F0Fu, a[mt][1] = hi & 0x0F0F0F0Fu;
          a[mt][2] = (lo >> 4) & 0x0F0F0F0Fu, a[mt][3] = (hi >> 4) & 0x0F0F0F0Fu;
        }
      } else {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
          ldsm4(a[mt], &sa[st][(wm * WR + mt * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * AS + u * 32 + (lane >> 4) * 16]);
      }
      uint32_t b[NT][2];
#pragma unroll
      for (int np = 0; np < NT / 2; ++np) {
        uint32_t r[4];
        ldsm4(r, &sx[st][(wn * WC + np * 16 + (lane & 7) + (lane >> 4) * 8) * XS + u * 32 + ((lane >> 3) & 1) * 16]);
        b[2 * np][0] = r[0], b[2 * np][1] = r[1], b[2 * np + 1][0] = r[2], b[2 * np + 1][1] = r[3];
      }
      // The int32 sums leave the mma biased by 1.5 * 2^23 (less 8 * the quant sum for q4_0): as
      // float bits that is 1.5 * 2^23 + sum exactly (|sum| < 2^22), so one subtraction gives
      // (float)sum without the quarter-rate integer-to-float conversion.
      constexpr int kMagic = 0x4B400000;
      float dw[MT][2], dx[NT][2];
      int o[NT][2];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
        dw[mt][0] = h2f(sdw[st][wm * WR + mt * 16 + g][u]), dw[mt][1] = h2f(sdw[st][wm * WR + mt * 16 + g + 8][u]);
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const int t = wn * WC + nt * 8 + 2 * c;
        dx[nt][0] = sdx[st][t][u], dx[nt][1] = sdx[st][t + 1][u];
        if constexpr (Q4) o[nt][0] = kMagic - 8 * sxs[st][t][u], o[nt][1] = kMagic - 8 * sxs[st][t + 1][u];
        else o[nt][0] = o[nt][1] = kMagic;
      }
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          int sm[4];
          mma_s8c(sm, a[mt][0], a[mt][1], a[mt][2], a[mt][3], b[nt][0], b[nt][1], o[nt][0], o[nt][1]);
          constexpr float kBias = 12582912.0f;  // 1.5 * 2^23
          acc[mt][nt][0] += (__int_as_float(sm[0]) - kBias) * __fmul_rn(dw[mt][0], dx[nt][0]);
          acc[mt][nt][1] += (__int_as_float(sm[1]) - kBias) * __fmul_rn(dw[mt][0], dx[nt][1]);
          acc[mt][nt][2] += (__int_as_float(sm[2]) - kBias) * __fmul_rn(dw[mt][1], dx[nt][0]);
          acc[mt][nt][3] += (__int_as_float(sm[3]) - kBias) * __fmul_rn(dw[mt][1], dx[nt][1]);
        }
    }
  }
  float* y = j.y[mi];
  auto put = [&](int64_t r, int64_t t, float v) {
    if (r >= rows || t >= n) return;
    float* p = y + t * rows + r;
    *p = j.accumulate ? *p + v : v;
  };
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (gridDim.z > 1) {
    // Partials: thread tid's SL sums at part[tid * (SL + 1) + slot] (padded: no bank conflicts
    // between threads), slot = (mt * NT + nt) * 4 + i; the activations' stages are free by now.
    constexpr int SL = MT * NT * 4;
    cp_wait<0>();
    __syncthreads();
    float* part = reinterpret_cast<float*>(&sx[0][0]);
    static_assert(sizeof sx >= 128 * (SL + 1) * sizeof(float), "the partials fit the activations' stages");
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) part[tid * (SL + 1) + (mt * NT + nt) * 4 + i] = acc[mt][nt][i];
    namespace cg = cooperative_groups;
    cg::cluster_group cl = cg::this_cluster();
    cl.sync();
    const int nr = (int)cl.num_blocks(), rank = (int)cl.block_rank();
    for (int e = rank * 128 + tid; e < 128 * SL; e += nr * 128) {
      const int th = e / SL, slot = e % SL;
      float v = 0.f;
      for (int q = 0; q < nr; ++q) v += cl.map_shared_rank(part, q)[th * (SL + 1) + slot];
      const int tl = th & 31, tw = th >> 5, tg = tl >> 2, tc = tl & 3;
      const int mt = slot / (NT * 4), nt = (slot / 4) % NT, i = slot & 3;
      const int64_t r = r0 + (tw % WMW) * WR + mt * 16 + tg + (i >> 1) * 8;
      const int64_t t = t0 + (tw / WMW) * WC + nt * 8 + 2 * tc + (i & 1);
      put(r, t, v);
    }
    cl.sync();  // every rank's partials stay until all have read them
    return;
  }
#endif
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const int64_t r = r0 + wm * WR + mt * 16 + g, t = t0 + wn * WC + nt * 8 + 2 * c;
      put(r, t, acc[mt][nt][0]), put(r, t + 1, acc[mt][nt][1]);
      put(r + 8, t, acc[mt][nt][2]), put(r + 8, t + 1, acc[mt][nt][3]);
    }
}

// Whether the tiles' reads of a stage's block scales (2 * KB bytes) stay inside every row.
bool tile_fits(const GemvJob& j) {
  const int64_t nb = j.cols / 32, q = j.type == T_Q4_0S ? j.cols / 2 : j.cols;
  for (int i = 0; i < j.count; ++i)
    if ((int64_t)j.rb[i] < q + 2 * ceil_div(nb, kTileKB) * kTileKB) return false;
  return true;
}

// Read at each launch (prefill only, never inside a captured step), so A/B runs in one
// process (benchmarks/ab_cuda.py) see each setting.
bool tiles_on() {
  const char* e = std::getenv("DASLLAMA_CUDA_MMA_TILE");
  return !(e && e[0] == '0');
}

// Sets a kernel's dynamic shared memory limit once (per process: see flash.cu), and asks
// for the whole carveout as shared memory.
template <class K>
void smem_limit(K k, int bytes, const char* what) {
  const bool ok = cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes) == cudaSuccess &&
                  cudaFuncSetAttribute(k, cudaFuncAttributePreferredSharedMemoryCarveout,
                                       cudaSharedmemCarveoutMaxShared) == cudaSuccess;
  if (!ok) throw DeviceError(std::string("cuda ") + what + ": the device refuses " + std::to_string(bytes) +
                             " bytes of shared memory");
}

int64_t env_int(const char* name, int64_t dflt);

// How many ways the tiles split k: as many as one wave of four blocks an SM (the kernel's
// occupancy) holds, at most 8 (a portable cluster) and at least two stages a split; 1 below
// sm_90 (no clusters).
// DASLLAMA_CUDA_TILE_SPLIT=N forces N (1: never), read at each launch.
// The SMs of a device with thread-block clusters (sm_90+), else 0.
int cluster_sms() {
  static const int sms = [] {
    int dev = 0, v = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, dev);
    return cc_major() >= 9 ? v : 0;
  }();
  return sms;
}

// Splits fill at most one wave (floor): gate/up's 256 tiles of a batched step took 3 splits by
// the ceiling, 768 blocks for 528 slots (1.45 waves); 2 fill 512. On the H200 (ab_cuda.py, one
// call) Llama-1B Q8_0 B = 16 / 32 / 64 went 9,078 / 12,873 / 14,833 -> 9,599 / 13,962 / 16,746
// t/s, Q4_0 8,295 / 11,829 / 14,022 -> 8,784 / 12,450 / 14,719. (Tried in the same calls and
// lost: 8 blocks an SM for 16-token tiles, the stage's k units unrolled, clusters of 16.)
// Prefill splits by the same rule: pp512's o and down are 256 tiles (half a wave), split in two
// (H200, Llama-1B pp512 Q8_0 52,954 -> 55,466, Q4_0 50,996 -> 52,255 t/s; by the ceiling every
// matrix split and pp512 lost 5%). DASLLAMA_CUDA_TILE_PSPLIT=0: prefill never splits.
int tile_splits(int64_t blocks, int64_t nb) {
  const int sms = cluster_sms();
  if (sms == 0) return 1;
  const int64_t stages = ceil_div(nb, kTileKB), most = std::max<int64_t>(1, std::min<int64_t>(8, stages / 2));
  const int64_t forced = env_int("DASLLAMA_CUDA_TILE_SPLIT", 0);
  if (forced > 0) return (int)std::min<int64_t>(forced, std::min<int64_t>(8, stages));  // tests: empty splits too
  return (int)std::max<int64_t>(1, std::min(most, 4 * (int64_t)sms / blocks));
}

template <uint32_t T, int BN>
void launch_tile_n(GemvJob j, cudaStream_t st) {
  int64_t b = 0;
  for (int i = 0; i < j.count; ++i) j.first_block[i] = b, b += ceil_div(j.rows[i], kTileM);
  j.first_block[j.count] = b;
  const int64_t tn = ceil_div(j.n, BN);
  const int splits = tn == 1 || env_int("DASLLAMA_CUDA_TILE_PSPLIT", 1) == 1 ? tile_splits(b * tn, j.cols / 32) : 1;
  const dim3 grid((unsigned)tn, (unsigned)b, (unsigned)splits);
  // All of the SM's shared memory for blocks (a hint): 4 blocks of 40 KB fit beside L1.
  static const bool carve = cudaFuncSetAttribute(mma_tile_k<T, BN>, cudaFuncAttributePreferredSharedMemoryCarveout,
                                                 cudaSharedmemCarveoutMaxShared) == cudaSuccess;
  (void)carve;
  launch_cluster(mma_tile_k<T, BN>, grid, 128, 0, st, dim3(1, 1, splits), j);
}

// Tiles as narrow as the step (16 / 32 / 64 tokens; prefill: 64).
template <uint32_t T>
void launch_tile(const GemvJob& j, cudaStream_t st) {
  if (j.n <= 16) launch_tile_n<T, 16>(j, st);
  else if (j.n <= 32) launch_tile_n<T, 32>(j, st);
  else launch_tile_n<T, 64>(j, st);
}

// ---- Prefill of f16 / bf16 weights: TF32 tensor cores, f32 activations kept ----
// Such weights are exact in TF32 (at most 11 significant bits, f32's exponent range), and each
// activation is split as x = hi + lo, both TF32 (lo = x - hi is exact in f32 and loses only
// its bits past 22 to the second rounding), so two mmas, W * hi + W * lo, give the f32 dot
// product to about 2^-22 relative (the CPU keeps f32 activations for these weights; an f16 or
// single-TF32 x would miss the f32 bar by orders of magnitude). The products are exact; the
// tensor cores sum them in f32. Tiles as mma_tile_k: 64 rows x 64 tokens, four warps of 32 x
// 32, 32 of k a stage, three stages in flight (128-row tiles of eight warps measured no faster
// on the H200, for this kernel and the int8 one; BM stays a parameter). The k slots c and c + 4 of an m16n8k8 fragment
// take elements 2c and 2c + 1 of each group of 8 (the same for A and B), so a thread reads a
// half2 of weights and a float2 of activations.
constexpr int kFStages = 3;

// A stage's rows r0 .. r0 + BM of an f16 / bf16 matrix, k0 .. k0 + 8 CH (16 CH bytes a row, at
// `stride` bytes apart in shared memory). k past cols is zero-filled (cols % 8 == 0: a 16-byte
// chunk is wholly in or out); rows past the end read the last one (their sums are not stored).
template <int BM, int NTH, int CH = 4>
__device__ __forceinline__ void stage_rows16(uint8_t* dst, int stride, const uint8_t* W, size_t rb, int64_t r0,
                                             int64_t rows, int64_t cols, int64_t k0) {
  for (int i = threadIdx.x; i < BM * CH; i += NTH) {
    const int r = i / CH, ch = i % CH;
    const bool ok = k0 + ch * 8 < cols;
    cp_async(dst + r * stride + ch * 16, W + lmin(r0 + r, rows - 1) * rb + (ok ? (k0 + ch * 8) * 2 : 0), 16, ok);
  }
}

template <uint32_t T, int BM>
__global__ void __launch_bounds__(BM * 2, 512 / (BM * 2)) mma_f16_k(const uint8_t* __restrict__ W, size_t rb,
                                                                   int64_t rows, int64_t cols,
                                                                   const float* __restrict__ x, int64_t n,
                                                                   float* __restrict__ y) {
  constexpr int BN = 64, BK = 32, S = kFStages, NTH = BM * 2;
  constexpr int AS = BK * 2 + 16;  // bytes; 20 words a row: a warp's 8 rows x 4 words on distinct banks
  constexpr int XS = BK + 8;       // floats; 40 words a row: a half-warp's float2 reads on distinct banks
  constexpr int stage = BM * AS + BN * XS * 4;
  extern __shared__ __align__(16) uint8_t smem[];
  auto sa = [&](int st) { return smem + st * stage; };
  auto sx = [&](int st) { return reinterpret_cast<float*>(smem + st * stage + BM * AS); };
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, c = lane & 3;
  const int wm = warp % (BM / 32), wn = warp / (BM / 32);
  const int64_t r0 = (int64_t)blockIdx.y * BM, t0 = (int64_t)blockIdx.x * BN;
  auto load_w = [&](int st, int64_t k0) { stage_rows16<BM, NTH>(sa(st), AS, W, rb, r0, rows, cols, k0); };
  auto load_x = [&](int st, int64_t k0) {
    for (int i = tid; i < BN * 8; i += NTH) {
      const int t = i >> 3, ch = i & 7;
      const bool ok = k0 + ch * 4 < cols;
      cp_async(sx(st) + t * XS + ch * 4, x + lmin(t0 + t, n - 1) * cols + (ok ? k0 + ch * 4 : 0), 16, ok);
    }
  };
  float acc[2][4][4];
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) acc[mt][nt][0] = acc[mt][nt][1] = acc[mt][nt][2] = acc[mt][nt][3] = 0.f;
  const int64_t stages = (cols + BK - 1) / BK;
  stages_begin<S>(stages, BK, load_w, load_x);
  for (int64_t s = 0; s < stages; ++s) {
    const int st = (int)(s % S);
    stage_ready<S>(s, stages, BK, load_w, load_x);
#pragma unroll
    for (int kk = 0; kk < BK / 8; ++kk) {
      uint32_t a[2][4];
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
        const int r = wm * 32 + mt * 16 + g;
        const uint32_t h0 = *reinterpret_cast<const uint32_t*>(sa(st) + r * AS + kk * 16 + c * 4);
        const uint32_t h1 = *reinterpret_cast<const uint32_t*>(sa(st) + (r + 8) * AS + kk * 16 + c * 4);
        if constexpr (T == T_F16) {
          a[mt][0] = __float_as_uint(h2f((uint16_t)h0)), a[mt][2] = __float_as_uint(h2f((uint16_t)(h0 >> 16)));
          a[mt][1] = __float_as_uint(h2f((uint16_t)h1)), a[mt][3] = __float_as_uint(h2f((uint16_t)(h1 >> 16)));
        } else {
          a[mt][0] = h0 << 16, a[mt][2] = h0 & 0xFFFF0000u, a[mt][1] = h1 << 16, a[mt][3] = h1 & 0xFFFF0000u;
        }
      }
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        const float2 v = *reinterpret_cast<const float2*>(sx(st) + (wn * 32 + nt * 8 + g) * XS + kk * 8 + c * 2);
        const uint32_t h0 = to_tf32(v.x), h1 = to_tf32(v.y);
        const uint32_t l0 = to_tf32(v.x - __uint_as_float(h0)), l1 = to_tf32(v.y - __uint_as_float(h1));
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
          mma_tf32(acc[mt][nt], a[mt], l0, l1);
          mma_tf32(acc[mt][nt], a[mt], h0, h1);
        }
      }
    }
  }
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      const int64_t r = r0 + wm * 32 + mt * 16 + g, t = t0 + wn * 32 + nt * 8 + 2 * c;
      if (t < n) {
        if (r < rows) y[t * rows + r] = acc[mt][nt][0];
        if (r + 8 < rows) y[t * rows + r + 8] = acc[mt][nt][2];
      }
      if (t + 1 < n) {
        if (r < rows) y[(t + 1) * rows + r] = acc[mt][nt][1];
        if (r + 8 < rows) y[(t + 1) * rows + r + 8] = acc[mt][nt][3];
      }
    }
}


// ---- Prefill of f16 weights on f16 tensor cores, f32 activations kept ----
// f16 weights are exact f16 mma operands. Each token's activations are scaled by a power of two
// (its largest magnitude to [2^13, 2^14): no overflow, and the small values keep their bits) and
// split x * s = hi + lo, both f16 (lo = x * s - hi, exact in f32, rounded once more), so two
// m16n8k16 mmas, W * lo + W * hi, give the f32 dot product to about 2^-22 relative, as the TF32
// split does, with half the mmas and no conversions in the inner loop; the sums are scaled
// back by 1 / s (exact). A prep kernel writes hi, lo and 1 / s per token. Tiles as mma_tile_k:
// 64 rows x 64 tokens, four warps of 32 x 32, 32 of k a stage in three stages, fragments
// through ldmatrix. LO false (q8 mode, weights not exact): hi alone, one mma a product, the
// activations rounded to f16 as llama.cpp's f16 matmuls round them (each token on its own
// scale, so none underflows); no lo is written or read.
template <bool LO>
__global__ void __launch_bounds__(256) f16_split_k(const float* __restrict__ x, int64_t cols, __half* __restrict__ xh,
                                                   __half* __restrict__ xl, float* __restrict__ inv) {
  pdl_wait();
  pdl_trigger();
  const int64_t t = blockIdx.x;
  const float* xr = x + t * cols;
  __shared__ float red[8];
  float amax = 0.f;
  for (int64_t i = threadIdx.x; i < cols; i += 256) amax = fmaxf(amax, fabsf(xr[i]));
  amax = warp_max(amax);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = amax;
  __syncthreads();
  amax = red[0];
#pragma unroll
  for (int w = 1; w < 8; ++w) amax = fmaxf(amax, red[w]);
  int e = 0;
  if (amax > 0.f && amax <= 3.0e38f) frexpf(amax, &e);  // amax < 2^e
  e = max(-110, min(110, 14 - e));
  const float sc = ldexpf(1.f, e);
  for (int64_t i = threadIdx.x; i < cols; i += 256) {
    const float v = xr[i] * sc;
    const __half h = __float2half_rn(v);
    xh[t * cols + i] = h;
    if (LO) xl[t * cols + i] = __float2half_rn(v - __half2float(h));
  }
  if (threadIdx.x == 0) inv[t] = ldexpf(1.f, -e);
}

// Warps of MT x 16 rows by 32 tokens, WR x WC of them (mma_f16h launches 64 x 64 tiles of 4 for the
// split, 128 x 64 of 4 for one product); BK of k a stage. gridDim.z > 1 (sm_90, DASLLAMA_CUDA_F16H_SPLIT):
// k split over a thread-block cluster of the tile's blocks, their sums joined in rank order
// through distributed shared memory, as mma_tile_k's.
template <int MT, int WR, int WC, bool LO, int BK_ = 32>
struct F16hShape {
  static constexpr int BM = WR * MT * 16, BN = WC * 32, NTH = WR * WC * 32, BK = BK_, S = kFStages;
  static constexpr int RS = BK * 2 + 16;  // bytes a row: 80 (144), eight rows an ldmatrix reads on distinct banks
  static constexpr int XS = LO ? 2 : 1;   // activation halves a stage holds
  static constexpr int smem = S * (BM + XS * BN) * RS;
};

template <int MT, int WR, int WC, bool LO, int BK_>
__global__ void __launch_bounds__(WR * WC * 32, 512 / (WR * WC * 32))
    mma_f16h_k(const uint8_t* __restrict__ W, size_t rb, int64_t rows, int64_t cols, const __half* __restrict__ xh,
               const __half* __restrict__ xl, const float* __restrict__ inv, int64_t n, float* __restrict__ y) {
  using F = F16hShape<MT, WR, WC, LO, BK_>;
  constexpr int BM = F::BM, BN = F::BN, BK = F::BK, S = F::S, RS = F::RS, NTH = F::NTH;
  extern __shared__ __align__(16) uint8_t smem[];
  auto sa = [&](int st) { return smem + st * (BM + F::XS * BN) * RS; };
  auto sh = [&](int st) { return sa(st) + BM * RS; };
  auto sl = [&](int st) { return sa(st) + (BM + BN) * RS; };
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, c = lane & 3;
  const int wm = warp % WR, wn = warp / WR;
  const int64_t r0 = (int64_t)blockIdx.y * BM, t0 = (int64_t)blockIdx.x * BN;
  // Tokens past the end read the last one, as rows do (stage_rows16).
  constexpr int CH = BK / 8;  // 16-byte chunks of a row a stage
  auto load_w = [&](int st, int64_t k0) { stage_rows16<BM, NTH, CH>(sa(st), RS, W, rb, r0, rows, cols, k0); };
  auto load_x = [&](int st, int64_t k0) {
    for (int i = tid; i < BN * CH; i += NTH) {
      const int t = i / CH, ch = i % CH;
      const bool ok = k0 + ch * 8 < cols;
      const int64_t at = lmin(t0 + t, n - 1) * cols + (ok ? k0 + ch * 8 : 0);
      cp_async(sh(st) + t * RS + ch * 16, xh + at, 16, ok);
      if (LO) cp_async(sl(st) + t * RS + ch * 16, xl + at, 16, ok);
    }
  };
  float acc[MT][4][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) acc[mt][nt][0] = acc[mt][nt][1] = acc[mt][nt][2] = acc[mt][nt][3] = 0.f;
  int64_t sb;
  const int64_t stages = split_share((cols + BK - 1) / BK, sb), kbase = sb * BK;
  auto lw = [&](int st, int64_t k0) { load_w(st, kbase + k0); };
  auto lx = [&](int st, int64_t k0) { load_x(st, kbase + k0); };
  stages_begin<S>(stages, BK, lw, lx);
  for (int64_t s = 0; s < stages; ++s) {
    const int st = (int)(s % S);
    stage_ready<S>(s, stages, BK, lw, lx);
#pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk) {
      uint32_t a[MT][4], bh[4][2], bl[4][2];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
        ldsm4(a[mt], sa(st) + (wm * MT * 16 + mt * 16 + (lane & 15)) * RS + kk * 32 + (lane >> 4) * 16);
#pragma unroll
      for (int np = 0; np < 2; ++np) {
        const int off = (wn * 32 + np * 16 + (lane & 7) + (lane >> 4) * 8) * RS + kk * 32 + ((lane >> 3) & 1) * 16;
        uint32_t r[4];
        ldsm4(r, sh(st) + off);
        bh[2 * np][0] = r[0], bh[2 * np][1] = r[1], bh[2 * np + 1][0] = r[2], bh[2 * np + 1][1] = r[3];
        if (LO) {
          ldsm4(r, sl(st) + off);
          bl[2 * np][0] = r[0], bl[2 * np][1] = r[1], bl[2 * np + 1][0] = r[2], bl[2 * np + 1][1] = r[3];
        }
      }
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
          if (LO) mma_f16(acc[mt][nt], a[mt], bl[nt][0], bl[nt][1]);
          mma_f16(acc[mt][nt], a[mt], bh[nt][0], bh[nt][1]);
        }
    }
  }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (gridDim.z > 1) {
    // Thread tid's SL sums at part[tid * (SL + 1) + slot] (padded against bank conflicts), slot =
    // (mt * 4 + nt) * 4 + i; the stages are free once every copy has landed.
    constexpr int SL = MT * 16;
    static_assert(F::smem >= NTH * (SL + 1) * (int)sizeof(float), "the partials fit the stages");
    cp_wait<0>();
    __syncthreads();
    float* part = reinterpret_cast<float*>(smem);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) part[tid * (SL + 1) + (mt * 4 + nt) * 4 + i] = acc[mt][nt][i];
    namespace cg = cooperative_groups;
    cg::cluster_group cl = cg::this_cluster();
    cl.sync();
    const int nr = (int)cl.num_blocks(), rank = (int)cl.block_rank();
    for (int e = rank * NTH + tid; e < NTH * SL; e += nr * NTH) {
      const int th = e / SL, slot = e % SL;
      float v = 0.f;
      for (int q = 0; q < nr; ++q) v += cl.map_shared_rank(part, q)[th * (SL + 1) + slot];
      const int tl = th & 31, tw = th >> 5, mt = slot / 16, nt = (slot / 4) % 4, i = slot & 3;
      const int64_t r = r0 + (tw % WR) * MT * 16 + mt * 16 + (tl >> 2) + (i >> 1) * 8;
      const int64_t t = t0 + (tw / WR) * 32 + nt * 8 + 2 * (tl & 3) + (i & 1);
      if (r < rows && t < n) y[t * rows + r] = v * inv[t];
    }
    cl.sync();  // every rank's partials stay until all have read them
    return;
  }
#endif
#pragma unroll
  for (int nt = 0; nt < 4; ++nt) {
    const int64_t t = t0 + wn * 32 + nt * 8 + 2 * c;
    const float i0 = t < n ? inv[t] : 0.f, i1 = t + 1 < n ? inv[t + 1] : 0.f;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      const int64_t r = r0 + wm * MT * 16 + mt * 16 + g;
      if (t < n) {
        if (r < rows) y[t * rows + r] = acc[mt][nt][0] * i0;
        if (r + 8 < rows) y[t * rows + r + 8] = acc[mt][nt][2] * i0;
      }
      if (t + 1 < n) {
        if (r < rows) y[(t + 1) * rows + r] = acc[mt][nt][1] * i1;
        if (r + 8 < rows) y[(t + 1) * rows + r + 8] = acc[mt][nt][3] * i1;
      }
    }
  }
}

// How many ways the f16 tiles split k (a cluster of a tile's blocks, sm_90): DASLLAMA_CUDA_F16H_SPLIT
// (read at each launch, for A/B runs): 1 none; N that many (at most 8 and one a stage); unset or
// auto as mma_tile_k's rule, as many as one wave of the blocks an SM holds (by shared memory)
// takes, at most 8 and at least two stages a split (pp512's O and ffn down: 128 tiles of 128 x 64,
// two blocks an SM: two splits). On the H100, Llama-1B pp512: F16 +0.6 / +3.1%, Q4_K_M (its f16
// tiles over decoded weights) +2.5 / +2.4% over none in two interleaved runs; 2 everywhere lost
// (-13%).
int f16h_splits(int64_t blocks, int64_t stages, int smem) {
  const char* e = std::getenv("DASLLAMA_CUDA_F16H_SPLIT");
  const int sms = cluster_sms();
  if (sms == 0) return 1;
  if (e && *e && std::strcmp(e, "auto") != 0) return (int)std::max<int64_t>(1, std::min<int64_t>(std::min<int64_t>(std::atoll(e), 8), stages));
  static const int per_sm_bytes = [] {
    int dev = 0, v = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev);
    return v;
  }();
  const int64_t per_sm = std::max(1, per_sm_bytes / (smem + 1024));  // (1 KB a block the runtime keeps)
  const int64_t most = std::max<int64_t>(1, std::min<int64_t>(8, stages / 2));
  return (int)std::max<int64_t>(1, std::min(most, per_sm * sms / std::max<int64_t>(blocks, 1)));
}

template <int MT, int WR, int WC, bool LO, int BK = 32>
void launch_f16h(const Mat& m, const __half* xh, const __half* xl, const float* inv, int64_t n, float* y,
                 cudaStream_t st) {
  using F = F16hShape<MT, WR, WC, LO, BK>;
  static const bool set = (smem_limit(mma_f16h_k<MT, WR, WC, LO, BK>, F::smem, "f16 mma tiles"), true);
  (void)set;
  const int64_t tn = ceil_div(n, F::BN), tm = ceil_div(m.rows, F::BM);
  const int splits = f16h_splits(tn * tm, ceil_div(m.cols, (int64_t)BK), F::smem);
  const dim3 grid((unsigned)tn, (unsigned)tm, (unsigned)splits);
  launch_cluster(mma_f16h_k<MT, WR, WC, LO, BK>, grid, F::NTH, F::smem, st, dim3(1, 1, splits), m.w, m.row_bytes,
                 m.rows, m.cols, xh, xl, inv, n, y);
}

template <uint32_t T, int WM, int WK, int NT, int MINB = 1>
void launch_mma(GemvJob j, cudaStream_t st) {
  int64_t b = 0;
  for (int i = 0; i < j.count; ++i) j.first_block[i] = b, b += ceil_div(j.rows[i], 16 * WM);
  j.first_block[j.count] = b;
  const dim3 grid((unsigned)ceil_div(j.n, 8 * NT), (unsigned)b);
  launch(mma_q8_k<T, WM, WK, NT, MINB>, grid, WM * WK * 32, 0, st, j);
}

// From how many tokens, and from how many rows (the job's matrices together), the shared-memory
// tiles take over from the one-pass warps (DASLLAMA_CUDA_TILE_MIN, default 9 tokens;
// DASLLAMA_CUDA_TILE_ROWS, default 0; without clusters 64 and 8192). Read at each launch, so ab_cuda.py can compare settings in
// one process. On the H200, Llama-1B Q8_0 (ab_cuda.py, one call), B = 16 / 32 / 64: the warps
// 6,331 / 8,916 / 12,178 t/s; tiles from 64 tokens for 8192+ rows (the default until then)
// 6,397 / 8,911 / 12,093; tiles 16, 32 or 64 tokens wide from 9 tokens, every matrix, k split
// over clusters where the tiles are few: 7,103 / 10,419 / 13,825. (Without the split, tiles for
// a 2048-row matrix at 64 tokens made only 32 blocks and lost: B=32 8,482 -> 4,245.)
int64_t env_int(const char* name, int64_t dflt) {
  const char* e = std::getenv(name);
  return e && *e ? std::atoll(e) : dflt;
}

template <uint32_t T>
void run_mma(const GemvJob& j, cudaStream_t st) {
  int64_t rows = 0;
  for (int i = 0; i < j.count; ++i) rows += j.rows[i];
  // Without clusters (before sm_90) k does not split, and the tiles keep their old rule: from 64
  // tokens, for 8192+ rows (a 2048-row matrix alone is too few tiles to fill the GPU).
  const bool split = cluster_sms() > 0;
  if (j.n <= 64 && j.n >= env_int("DASLLAMA_CUDA_TILE_MIN", split ? 9 : 64) &&
      rows >= env_int("DASLLAMA_CUDA_TILE_ROWS", split ? 0 : 8192) && tiles_on() && tile_fits(j))
    return launch_tile<T>(j, st);
  // Up to 64 tokens: one pass over the weights, eight warps splitting each row tile's k
  // (16 rows a warp leave too few warps to keep the memory busy otherwise).
  if (j.n <= 16) launch_mma<T, 1, 8, 2>(j, st);
  else if (j.n <= 32 && env_int("DASLLAMA_CUDA_MMA_MINB", 1) == 2) launch_mma<T, 1, 8, 4, 2>(j, st);
  else if (j.n <= 32) launch_mma<T, 1, 8, 4>(j, st);
  else if (j.n <= 64 && env_int("DASLLAMA_CUDA_MMA_MINB", 1) == 2) launch_mma<T, 1, 8, 8, 2>(j, st);
  else if (j.n <= 64) launch_mma<T, 1, 8, 8>(j, st);
  else if (tiles_on() && tile_fits(j)) launch_tile<T>(j, st);
  else launch_mma<T, 4, 1, 8>(j, st);
}

}  // namespace

bool mma_f16_fits(const Mat& m, const float* x, int64_t n) {
  if (m.type != T_F16 && m.type != T_BF16) return false;
  const char* e = std::getenv("DASLLAMA_CUDA_MMA_F16");  // 0: the f32 FMA tiles (gemm_k)
  if ((e && e[0] == '0') || !tensor_cores()) return false;
  return n > 0 && m.cols % 8 == 0 && m.row_bytes % 16 == 0 && ((uintptr_t)m.w & 15) == 0 && ((uintptr_t)x & 15) == 0;
}

namespace {

template <uint32_t T, int BM>
void launch_f16(const Mat& m, const float* x, int64_t n, float* y, cudaStream_t st) {
  constexpr int bytes = kFStages * (BM * 80 + 64 * 40 * 4);  // mma_f16_k's stages
  static const bool set = (smem_limit(mma_f16_k<T, BM>, bytes, "tf32 mma tiles"), true);
  (void)set;
  const dim3 grid((unsigned)ceil_div(n, 64), (unsigned)ceil_div(m.rows, BM));
  launch(mma_f16_k<T, BM>, grid, BM * 2, bytes, st, m.w, m.row_bytes, m.rows, m.cols, x, n, y);
}

}  // namespace

void mma_f16(const Mat& m, const float* x, int64_t n, float* y, cudaStream_t st) {
  if (!mma_f16_fits(m, x, n)) throw Error("cuda: a matmul the TF32 mma kernel does not take");
  if (m.type == T_F16) launch_f16<T_F16, 64>(m, x, n, y, st);
  else launch_f16<T_BF16, 64>(m, x, n, y, st);
  check_launch("matmul (tf32 mma)");
}

bool mma_f16h_fits(const Mat& m, const float* x, int64_t n) {
  if (m.type != T_F16 || !mma_f16_fits(m, x, n)) return false;
  const char* e = std::getenv("DASLLAMA_CUDA_F16H");  // 0: the TF32 split (mma_f16_k)
  return !(e && e[0] == '0');
}

size_t mma_f16h_scratch(int64_t n, int64_t cols) { return (size_t)n * cols * 4 + (size_t)n * 4; }

void mma_f16h(const Mat& m, const float* x, int64_t n, float* y, void* scratch, bool split, cudaStream_t st) {
  mma_f16h_multi(&m, &y, 1, x, n, scratch, split, st);
}

void mma_f16h_multi(const Mat* ms, float* const* ys, int count, const float* x, int64_t n, void* scratch, bool split,
                    cudaStream_t st) {
  if (count < 1 || count > 3) throw Error("cuda: the f16 mma kernel takes 1 to 3 matrices a call");
  for (int i = 0; i < count; ++i)
    if (!mma_f16h_fits(ms[i], x, n) || ms[i].cols != ms[0].cols)
      throw Error("cuda: a matmul the f16 mma kernel does not take");
  const Mat& m = ms[0];
  __half* xh = static_cast<__half*>(scratch);
  __half* xl = xh + n * m.cols;
  float* inv = reinterpret_cast<float*>(xl + n * m.cols);
  // The split: 64 x 64 tiles of four warps (128 x 128 of eight, MT 4, where they still made two
  // blocks an SM: no faster on the H200, pp512 35,689 -> 35,483). One product: 128 x 64 tiles of
  // four warps of 64 x 32 (H200, Llama-1B F16 pp512, ab_cuda.py: 64x64 44,118, 128x64 48,519,
  // 128x64w8 42,872, 64x128 43,138, 128x128 42,075, four stages 44,086: those are gone).
  // 128x64k64 (64 of k a stage) is one product's default: pp512 45,328 -> 50,412 (H200, two
  // rounds). DASLLAMA_CUDA_F16H_TILE (read at each launch, for A/B runs): 64x64, 128x64, 128x64k64.
  const char* e = std::getenv("DASLLAMA_CUDA_F16H_TILE");
  const std::string tile = e && *e ? e : split ? "64x64" : "128x64k64";
  auto run = [&](auto lo) {
    constexpr bool LO = decltype(lo)::value;
    launch(f16_split_k<LO>, dim3((unsigned)n), 256, 0, st, x, m.cols, xh, xl, inv);
    if (!LO && cublas_on() && cublas_f16(ms, ys, count, xh, inv, n, st)) return;
    for (int i = 0; i < count; ++i) {
      if (tile == "128x64") launch_f16h<4, 2, 2, LO>(ms[i], xh, xl, inv, n, ys[i], st);
      else if (tile == "128x64k64") launch_f16h<4, 2, 2, LO, 64>(ms[i], xh, xl, inv, n, ys[i], st);
      else launch_f16h<2, 2, 2, LO>(ms[i], xh, xl, inv, n, ys[i], st);
    }
  };
  if (split) run(std::true_type{});
  else run(std::false_type{});
  check_launch("matmul (f16 mma)");
}

void mma_f16h_slabs(const Mat& m, void* dq, int64_t slab_rows, const float* x, int64_t n, float* y, void* scratch,
                    cudaStream_t st) {
  __half* xh = static_cast<__half*>(scratch);
  __half* xl = xh + n * m.cols;  // (mma_f16h_scratch's layout; not written: x rounded once)
  float* inv = reinterpret_cast<float*>(xl + n * m.cols);
  launch(f16_split_k<false>, dim3((unsigned)n), 256, 0, st, x, m.cols, xh, xl, inv);
  cublas_f16_slabs(m, dq, slab_rows, xh, inv, n, y, st);
  check_launch("matmul (f16 slabs)");
}

// Where the K-quants' batched steps take mma_k_i8_k (DASLLAMA_CUDA_KMMA: 1 from 2 tokens, 0 never;
// default from 5). H100, Llama-1B, gemv_k_i8_k -> mma_k_i8_k (ab_cuda.py, best of 2), B = 4 / 8 /
// 16: Q4_K_M 2,615 / 2,808 / 4,000 -> 2,569 / 4,721 / 7,147, Q6_K 2,307 / 2,751 / 3,997 -> 2,488 /
// 4,600 / 7,122, Q5_K 2,750 / 2,829 / 4,027 -> 2,469 / 4,469 / 6,722: the mmas' step barely grows
// with the tokens, the GEMV's doubles from 4 to 8. DASLLAMA_CUDA_KMMA_MAX (16 to 32, default 32;
// read at each call): the most tokens they take, past which the decoding to f16 does; the same
// runs at B = 24 / 32, f16 + cuBLAS -> mmas: Q4_K_M 6,445 / 8,280 -> 7,626 / 9,213, Q6_K 6,144 /
// 7,926 -> 7,887 / 9,580.
bool k_mma_on(int64_t n) {
  const char* e = std::getenv("DASLLAMA_CUDA_KMMA");
  if (e && e[0] == '0') return false;
  const int64_t from = e && e[0] == '1' ? 2 : 5;
  const int64_t most = std::min<int64_t>(32, std::max<int64_t>(16, env_int("DASLLAMA_CUDA_KMMA_MAX", 32)));
  return n >= from && n <= most;
}

bool mma_q8_fits(const GemvJob& j) {
  if (!tensor_cores()) return false;  // (the backend checks too: prop_.major)
  if (!j.xq || j.n < 1 || j.count < 1 || j.count > 3 || j.cols <= 0 || j.cols % 32 != 0 || j.norm) return false;
  if (j.type == T_Q4_K || j.type == T_Q5_K || j.type == T_Q6_K) {  // mma_k_i8_k: 2-32 tokens, whole super-blocks
    if (j.n < 2 || j.n > 32) return false;
    for (int i = 0; i < j.count; ++i)
      if (!k_i8_rows_fit(j.type, j.cols, j.rows[i], j.rb[i], j.w[i])) return false;
    return true;
  }
  if (j.type != T_Q8_0S && j.type != T_Q4_0S) return false;
  for (int i = 0; i < j.count; ++i)
    if (j.rows[i] <= 0 || j.rb[i] % 16 != 0 || ((uintptr_t)j.w[i] & 15) != 0) return false;  // the split layouts'
  return true;
}

void mma_q8(const GemvJob& j, cudaStream_t st) {
  if (!mma_q8_fits(j)) throw Error("cuda: a matmul the int8 mma kernel does not take");
  if (j.type == T_Q4_K || j.type == T_Q5_K || j.type == T_Q6_K) {
    GemvJob p = j;
    int64_t b = 0;
    for (int i = 0; i < p.count; ++i) p.first_block[i] = b, b += ceil_div(p.rows[i], (int64_t)16);
    p.first_block[p.count] = b;
    const dim3 grid((unsigned)ceil_div(p.n, p.n <= 8 ? 8 : p.n <= 16 ? 16 : 32), (unsigned)b);
    switch (p.type) {
#define DL_KM(TT)                                                                   \
  case TT:                                                                          \
    if (p.n <= 8) launch(mma_k_i8_k<TT, 1>, grid, 256, 0, st, p);                   \
    else if (p.n <= 16) launch(mma_k_i8_k<TT, 2>, grid, 256, 0, st, p);             \
    else launch(mma_k_i8_k<TT, 4>, grid, 256, 0, st, p);                            \
    break;
      DL_KM(T_Q4_K) DL_KM(T_Q5_K) DL_KM(T_Q6_K)
#undef DL_KM
    }
    check_launch("matmul (K-quant int8 mma)");
    return;
  }
  if (j.type == T_Q8_0S) run_mma<T_Q8_0S>(j, st);
  else run_mma<T_Q4_0S>(j, st);
  check_launch("matmul (int8 mma)");
}

}  // namespace dl::cuda
