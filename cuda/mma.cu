// Tensor-core matmul in q8 mode: int8 mma.sync (m16n8k32) over the split q8_0 / q4_0
// layouts and the 8-bit activations quantize_act makes. One mma is one 32-block of one
// 16-row x 8-token tile, so its int32 sums are the CPU's per-block integer dot products,
// scaled per block by d_w * d_x (less 8 * the activation's quant sum for q4_0) into f32,
// as the GEMV does. Used for batched decode (a warp per 16 rows, four warps splitting k,
// the weights streamed once) and prefill (four warps of 16 rows over 64 tokens a block,
// token tiles of one row block adjacent in the grid so the weights come from L2).
#include <cstdlib>
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
template <uint32_t T, int WM, int WK, int NT>
__global__ void __launch_bounds__(WM * WK * 32) mma_q8_k(GemvJob j) {
  pdl_wait();
  pdl_trigger();
  constexpr int UB = WK > 1 ? 8 : 4;  // blocks whose weights are loaded before their mmas (decode: more in flight)
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
  const int8_t* xr[NT];
  int64_t tc[NT][2];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    xr[nt] = j.xq + lmin(t0 + nt * 8 + g, j.n - 1) * cols;
    tc[nt][0] = lmin(t0 + nt * 8 + 2 * c, j.n - 1) * nb;
    tc[nt][1] = lmin(t0 + nt * 8 + 2 * c + 1, j.n - 1) * nb;
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
        load_b<T>(xr[nt], b, c, x0, x1);
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

// ---- Prefill: shared-memory tiles ----
// Past 64 tokens a block takes 64 weight rows x 64 tokens; each stage of KB 32-blocks of k
// (weights, activations and both sides' block scales) is copied into shared memory with
// cp.async while the previous stage is computed, and fragments come from it through
// ldmatrix. Every weight and activation byte is read from L2 once per block, not once per
// warp and mma. Four warps each own 32 rows x 32 tokens (2 x 4 mma tiles). The per-block
// scaling is the same expression, in the same order of k, as mma_q8_k's.
__device__ __forceinline__ void cp_async(void* s, const void* g, int bytes, bool ok) {
  const unsigned sa = (unsigned)__cvta_generic_to_shared(s);
  const int src = ok ? bytes : 0;  // 0: nothing is read, the destination is zero-filled
  if (bytes == 16) asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(sa), "l"(g), "r"(src));
  else if (bytes == 8) asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(sa), "l"(g), "r"(src));
  else asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(sa), "l"(g), "r"(src));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
__device__ __forceinline__ void ldsm4(uint32_t (&r)[4], const void* p) {
  const unsigned a = (unsigned)__cvta_generic_to_shared(p);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}

constexpr int kTileM = 64, kTileN = 64, kTileKB = 4;

template <uint32_t T>
__global__ void __launch_bounds__(128) mma_tile_k(GemvJob j) {
  constexpr bool Q4 = T == T_Q4_0S;
  constexpr int BM = kTileM, BN = kTileN, KB = kTileKB;
  constexpr int QB = Q4 ? 16 : 32;      // bytes of one 32-block of a weight row
  constexpr int AS = KB * QB + 16;      // shared row strides: 16 bytes of padding keep the
  constexpr int XS = KB * 32 + 16;      // eight rows an ldmatrix reads on distinct banks
  __shared__ __align__(16) uint8_t sa[2][BM * AS];
  __shared__ __align__(16) uint8_t sx[2][BN * XS];
  __shared__ __align__(8) uint16_t sdw[2][BM][KB];
  __shared__ float sdx[2][BN][KB];
  __shared__ int sxs[2][Q4 ? BN : 1][KB];

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, c = lane & 3;
  const int wm = warp & 1, wn = warp >> 1;
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
    if (tid < BM) cp_async(&sdw[st][tid][0], W + lmin(r0 + tid, rows - 1) * rb + soff + 2 * kb0, 8, true);
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

  float acc[2][4][4];
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) acc[mt][nt][0] = acc[mt][nt][1] = acc[mt][nt][2] = acc[mt][nt][3] = 0.f;

  load_w(0, 0);  // constant: in flight before the wait for the activations
  pdl_wait();
  pdl_trigger();
  load_x(0, 0);
  cp_commit();
  const int64_t stages = (nb + KB - 1) / KB;
  for (int64_t s = 0; s < stages; ++s) {
    const int st = (int)(s & 1);
    if (s + 1 < stages) {
      load_w(st ^ 1, (s + 1) * KB), load_x(st ^ 1, (s + 1) * KB);
      cp_commit();
      cp_wait<1>();
    } else {
      cp_wait<0>();
    }
    __syncthreads();
#pragma unroll
    for (int u = 0; u < KB; ++u) {
      if (s * KB + u >= nb) break;
      uint32_t a[2][4];
      if constexpr (Q4) {  // one ldmatrix: rows wm*32 + lane's packed block; nibbles are k and k + 16
        uint32_t q[4];
        ldsm4(q, &sa[st][(wm * 32 + lane) * AS + u * 16]);
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
          const uint32_t lo = q[2 * mt], hi = q[2 * mt + 1];
          a[mt][0] = lo & 0x0F0F0F0Fu, a[mt][1] = hi & 0x0F0F0F0Fu;
          a[mt][2] = (lo >> 4) & 0x0F0F0F0Fu, a[mt][3] = (hi >> 4) & 0x0F0F0F0Fu;
        }
      } else {
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
          ldsm4(a[mt], &sa[st][(wm * 32 + mt * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * AS + u * 32 + (lane >> 4) * 16]);
      }
      uint32_t b[4][2];
#pragma unroll
      for (int np = 0; np < 2; ++np) {
        uint32_t r[4];
        ldsm4(r, &sx[st][(wn * 32 + np * 16 + (lane & 7) + (lane >> 4) * 8) * XS + u * 32 + ((lane >> 3) & 1) * 16]);
        b[2 * np][0] = r[0], b[2 * np][1] = r[1], b[2 * np + 1][0] = r[2], b[2 * np + 1][1] = r[3];
      }
      float dw[2][2], dx[4][2];
      int o[4][2];
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
        dw[mt][0] = h2f(sdw[st][wm * 32 + mt * 16 + g][u]), dw[mt][1] = h2f(sdw[st][wm * 32 + mt * 16 + g + 8][u]);
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        const int t = wn * 32 + nt * 8 + 2 * c;
        dx[nt][0] = sdx[st][t][u], dx[nt][1] = sdx[st][t + 1][u];
        if constexpr (Q4) o[nt][0] = 8 * sxs[st][t][u], o[nt][1] = 8 * sxs[st][t + 1][u];
      }
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
          int sm[4] = {0, 0, 0, 0};
          mma_s8(sm, a[mt][0], a[mt][1], a[mt][2], a[mt][3], b[nt][0], b[nt][1]);
          if constexpr (Q4) sm[0] -= o[nt][0], sm[1] -= o[nt][1], sm[2] -= o[nt][0], sm[3] -= o[nt][1];
          acc[mt][nt][0] += (float)sm[0] * __fmul_rn(dw[mt][0], dx[nt][0]);
          acc[mt][nt][1] += (float)sm[1] * __fmul_rn(dw[mt][0], dx[nt][1]);
          acc[mt][nt][2] += (float)sm[2] * __fmul_rn(dw[mt][1], dx[nt][0]);
          acc[mt][nt][3] += (float)sm[3] * __fmul_rn(dw[mt][1], dx[nt][1]);
        }
    }
    __syncthreads();  // this stage's buffers are refilled by the next iteration's copies
  }
  float* y = j.y[mi];
  auto put = [&](int64_t r, int64_t t, float v) {
    if (r >= rows || t >= n) return;
    float* p = y + t * rows + r;
    *p = j.accumulate ? *p + v : v;
  };
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      const int64_t r = r0 + wm * 32 + mt * 16 + g, t = t0 + wn * 32 + nt * 8 + 2 * c;
      put(r, t, acc[mt][nt][0]), put(r, t + 1, acc[mt][nt][1]);
      put(r + 8, t, acc[mt][nt][2]), put(r + 8, t + 1, acc[mt][nt][3]);
    }
}

// Whether the tiles' 8-byte reads of a stage's block scales stay inside every row.
bool tile_fits(const GemvJob& j) {
  const int64_t nb = j.cols / 32, q = j.type == T_Q4_0S ? j.cols / 2 : j.cols;
  for (int i = 0; i < j.count; ++i)
    if ((int64_t)j.rb[i] < q + 2 * ceil_div(nb, kTileKB) * kTileKB) return false;
  return true;
}

bool tiles_on() {
  static const bool on = [] {
    const char* e = std::getenv("DASLLAMA_CUDA_MMA_TILE");
    return !(e && e[0] == '0');
  }();
  return on;
}

template <uint32_t T>
void launch_tile(GemvJob j, cudaStream_t st) {
  int64_t b = 0;
  for (int i = 0; i < j.count; ++i) j.first_block[i] = b, b += ceil_div(j.rows[i], kTileM);
  j.first_block[j.count] = b;
  const dim3 grid((unsigned)ceil_div(j.n, kTileN), (unsigned)b);
  launch(mma_tile_k<T>, grid, 128, 0, st, j);
}

template <uint32_t T, int WM, int WK, int NT>
void launch_mma(GemvJob j, cudaStream_t st) {
  int64_t b = 0;
  for (int i = 0; i < j.count; ++i) j.first_block[i] = b, b += ceil_div(j.rows[i], 16 * WM);
  j.first_block[j.count] = b;
  const dim3 grid((unsigned)ceil_div(j.n, 8 * NT), (unsigned)b);
  launch(mma_q8_k<T, WM, WK, NT>, grid, WM * WK * 32, 0, st, j);
}

template <uint32_t T>
void run_mma(const GemvJob& j, cudaStream_t st) {
  // Up to 64 tokens: one pass over the weights, eight warps splitting each row tile's k
  // (16 rows a warp leave too few warps to keep the memory busy otherwise).
  if (j.n <= 16) launch_mma<T, 1, 8, 2>(j, st);
  else if (j.n <= 32) launch_mma<T, 1, 8, 4>(j, st);
  else if (j.n <= 64) launch_mma<T, 1, 8, 8>(j, st);
  else if (tiles_on() && tile_fits(j)) launch_tile<T>(j, st);
  else launch_mma<T, 4, 1, 8>(j, st);
}

}  // namespace

bool mma_q8_fits(const GemvJob& j) {
  if (!j.xq || j.n < 1 || j.count < 1 || j.count > 3 || j.cols <= 0 || j.cols % 32 != 0 || j.norm) return false;
  if (j.type != T_Q8_0S && j.type != T_Q4_0S) return false;
  for (int i = 0; i < j.count; ++i)
    if (j.rows[i] <= 0 || j.rb[i] % 16 != 0 || ((uintptr_t)j.w[i] & 15) != 0) return false;  // the split layouts'
  return true;
}

void mma_q8(const GemvJob& j, cudaStream_t st) {
  if (!mma_q8_fits(j)) throw Error("cuda: a matmul the int8 mma kernel does not take");
  if (j.type == T_Q8_0S) run_mma<T_Q8_0S>(j, st);
  else run_mma<T_Q4_0S>(j, st);
  check_launch("matmul (int8 mma)");
}

}  // namespace dl::cuda
