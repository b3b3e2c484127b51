// Matmul and embedding lookup over ggml-format weights: a warp-per-row GEMV for
// decode (n <= 8; 16 tokens a pass up to 64) and a 64x64 shared-memory tiled f32 kernel for prefill;
// matmul_id over stacks of experts (a warp per row and pair for decode, pairs gathered per expert
// for prefill).
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>

#include "act.cuh"
#include "attn.cuh"
#include "common.cuh"
#include "dequant.cuh"
#include "gemv_q8.cuh"
#include "kernels.h"
#include "rope.cuh"

namespace dl::cuda {
namespace {

// 8 consecutive floats of x starting at e0 (guarded past cols unless vec).
__device__ __forceinline__ void ld_x8(const float* __restrict__ x, int64_t e0, int64_t cols, bool vec, float v[8]) {
  if (vec) {
    const float4 a = __ldg(reinterpret_cast<const float4*>(x + e0)), b = __ldg(reinterpret_cast<const float4*>(x + e0) + 1);
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = e0 + i < cols ? x[e0 + i] : 0.f;
  }
}

// Decode: one warp per weight row, lanes over 8-element groups; each group is decoded
// once in registers and dotted with every token's x (NT >= n tokens, read through L1).
template <uint32_t T, int NT>
__global__ void __launch_bounds__(128) gemv_k(const uint8_t* __restrict__ W, size_t rb, int64_t rows, int64_t cols,
                                              const float* __restrict__ x, int n, float* __restrict__ y, bool wvec,
                                              bool xvec) {
  pdl_wait();
  pdl_trigger();
  const int lane = threadIdx.x & 31;
  const int64_t r = (int64_t)blockIdx.x * 4 + (threadIdx.x >> 5);
  if (r >= rows) return;
  const uint8_t* row = W + r * rb;
  const int64_t ng = (cols + 7) / 8;
  float acc[NT];
#pragma unroll
  for (int t = 0; t < NT; ++t) acc[t] = 0.f;
#pragma unroll 2
  for (int64_t g = lane; g < ng; g += 32) {
    float v[8];
    dq8<T>(row, g, cols, wvec, v);
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      if (t < n) {
        float xv[8];
        ld_x8(x + t * cols, g * 8, cols, xvec, xv);
        float s = 0.f;
#pragma unroll
        for (int i = 0; i < 8; ++i) s += v[i] * xv[i];
        acc[t] += s;
      }
    }
  }
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    const float s = warp_sum(acc[t]);
    if (lane == 0 && t < n) y[t * rows + r] = s;
  }
}

// Prefill: a 64-row x 64-token output tile per 256 threads, k in steps of 32. Each
// thread decodes one 8-element group of W into shared memory per step and loads 8 x
// values; then a 4x4 micro-tile (rows ty + 16i, tokens tx + 16j) accumulates in f32.
constexpr int BM = 64, BN = 64, BK = 32;
template <uint32_t T>
__global__ void __launch_bounds__(256) gemm_k(const uint8_t* __restrict__ W, size_t rb, int64_t rows, int64_t cols,
                                              const float* __restrict__ x, int64_t n, float* __restrict__ y, bool wvec,
                                              bool xvec) {
  pdl_wait();
  pdl_trigger();
  __shared__ float Ws[BK][BM + 4];
  __shared__ float Xs[BK][BN + 4];
  const int tid = threadIdx.x;
  const int64_t r0 = (int64_t)blockIdx.x * BM, t0 = (int64_t)blockIdx.y * BN;
  const int lr = tid >> 2, lg = tid & 3;  // loader: row/token lr, group lg of the k-step
  const int ty = tid >> 4, tx = tid & 15;
  const bool wrow_ok = r0 + lr < rows, xrow_ok = t0 + lr < n;
  const uint8_t* wrow = W + (wrow_ok ? r0 + lr : 0) * rb;
  const float* xrow = x + (xrow_ok ? t0 + lr : 0) * cols;
  float acc[4][4] = {};
  for (int64_t k0 = 0; k0 < cols; k0 += BK) {
    float v[8];
    const int64_t g = k0 / 8 + lg;
    if (wrow_ok && g * 8 < cols)
      dq8<T>(wrow, g, cols, wvec, v);
    else
#pragma unroll
      for (int i = 0; i < 8; ++i) v[i] = 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) Ws[lg * 8 + i][lr] = v[i];
    if (xrow_ok && g * 8 < cols)
      ld_x8(xrow, g * 8, cols, xvec, v);
    else
#pragma unroll
      for (int i = 0; i < 8; ++i) v[i] = 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) Xs[lg * 8 + i][lr] = v[i];
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < BK; ++kk) {
      float a[4], b[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) a[i] = Ws[kk][ty + 16 * i], b[i] = Xs[kk][tx + 16 * i];
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] += a[i] * b[j];
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t r = r0 + ty + 16 * i, t = t0 + tx + 16 * j;
      if (r < rows && t < n) y[t * rows + r] = acc[i][j];
    }
}

// ---- Staged GEMV (decode and batched decode) ---------------------------------------
// A warp per weight row, 8 warps a block. The row streams through the warp's slice of
// shared memory in chunks of CE elements, with 16-byte (or 4-byte) async copies two
// chunks deep, so each warp keeps kilobytes of the row in flight whatever the format;
// lanes then decode 8-element groups from shared memory and dot them with every
// token's x (read through L1). One launch serves up to 3 matrices of equal cols (Q/K/V,
// gate/up): the blocks of matrix i start at job.first_block[i].
template <uint32_t T> struct Chunk { static constexpr int ce = 2048; };
template <> struct Chunk<T_F32> { static constexpr int ce = 512; };
template <> struct Chunk<T_F16> { static constexpr int ce = 1024; };
template <> struct Chunk<T_BF16> { static constexpr int ce = 1024; };
template <uint32_t T> __host__ __device__ constexpr int chunk_bytes() { return Chunk<T>::ce / Blk<T>::qk * Blk<T>::bytes; }

// Elements 8g..8g+7 of a chunk in shared memory (16-byte aligned).
template <uint32_t T>
__device__ __forceinline__ void dq8_smem(const uint8_t* c, int g, float v[8]) {
  if constexpr (T == T_F32) {
    const float4 a = reinterpret_cast<const float4*>(c)[2 * g], b = reinterpret_cast<const float4*>(c)[2 * g + 1];
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
  } else if constexpr (T == T_F16 || T == T_BF16) {
    const uint4 u = reinterpret_cast<const uint4*>(c)[g];
    const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if constexpr (T == T_F16) {
        const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&w[i]));
        v[2 * i] = f.x, v[2 * i + 1] = f.y;
      } else {
        v[2 * i] = __uint_as_float(w[i] << 16);
        v[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
      }
    }
  } else {
    dq8<T>(c, g, 0, false, v);
  }
}

// Global -> shared copy of `bytes` (a multiple of VEC) by the warp's lanes, as one async group.
template <int VEC>
__device__ __forceinline__ void stage(uint8_t* dst, const uint8_t* src, int bytes, int lane) {
#if __CUDA_ARCH__ >= 800
  for (int off = lane * VEC; off < bytes; off += 32 * VEC) {
    const unsigned d = (unsigned)__cvta_generic_to_shared(dst + off);
    if constexpr (VEC == 16)
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d), "l"(src + off));
    else
      asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(d), "l"(src + off));
  }
  asm volatile("cp.async.commit_group;\n" ::);
#else
  for (int off = lane * VEC; off < bytes; off += 32 * VEC) {
    if constexpr (VEC == 16)
      *reinterpret_cast<uint4*>(dst + off) = *reinterpret_cast<const uint4*>(src + off);
    else
      *reinterpret_cast<uint32_t*>(dst + off) = *reinterpret_cast<const uint32_t*>(src + off);
  }
#endif
}
template <int N>
__device__ __forceinline__ void stage_wait() {
#if __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
#endif
  __syncwarp();
}

// The matrix (mi), first row (r) and its bytes a warp of an R-rows-a-warp GEMV block takes;
// false past the matrix's rows.
template <int R = 1>
__device__ __forceinline__ bool warp_row(const GemvJob& j, int& mi, int64_t& r, const uint8_t*& row) {
  mi = 0;
  while (mi + 1 < j.count && (int64_t)blockIdx.x >= j.first_block[mi + 1]) ++mi;
  r = (((int64_t)blockIdx.x - j.first_block[mi]) * SW + (threadIdx.x >> 5)) * R;
  row = j.w[mi] + r * j.rb[mi];
  return r < j.rows[mi];
}

template <uint32_t T, int NT, int VEC>
__global__ void __launch_bounds__(SW * 32) gemv_staged_k(GemvJob j) {
  pdl_wait();
  pdl_trigger();
  constexpr int CE = Chunk<T>::ce, CB = chunk_bytes<T>();
  __shared__ __align__(16) uint8_t sm[SW][2][CB];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  int mi;
  int64_t r;
  const uint8_t* row;
  if (!warp_row(j, mi, r, row)) return;
  const int64_t rows = j.rows[mi], cols = j.cols;
  const size_t rb = j.rb[mi];
  const int nchunks = (int)((cols + CE - 1) / CE);
  auto issue = [&](int c) {
    const size_t off = (size_t)c * CB;
    stage<VEC>(sm[warp][c & 1], row + off, (int)(rb - off < (size_t)CB ? rb - off : (size_t)CB), lane);
  };
  issue(0);
  if (nchunks > 1) issue(1);
  float acc[NT], ss[NT];
#pragma unroll
  for (int t = 0; t < NT; ++t) acc[t] = 0.f, ss[t] = 0.f;
  for (int c = 0; c < nchunks; ++c) {
    if (c + 1 < nchunks) stage_wait<1>(); else stage_wait<0>();
    const uint8_t* buf = sm[warp][c & 1];
    const int64_t e0 = (int64_t)c * CE;
    const int ng = (int)((cols - e0 < CE ? cols - e0 : (int64_t)CE) / 8);
    for (int g = lane; g < ng; g += 32) {
      float v[8];
      dq8_smem<T>(buf, g, v);
      float nw[8];
      if (j.norm_w) {
        const float4 a = __ldg(reinterpret_cast<const float4*>(j.norm_w + e0 + 8 * g));
        const float4 b = __ldg(reinterpret_cast<const float4*>(j.norm_w + e0 + 8 * g) + 1);
        nw[0] = a.x, nw[1] = a.y, nw[2] = a.z, nw[3] = a.w, nw[4] = b.x, nw[5] = b.y, nw[6] = b.z, nw[7] = b.w;
      }
#pragma unroll
      for (int t = 0; t < NT; ++t) {
        if (t < j.n) {
          float xv[8];
          ld_x8(j.x + t * cols, e0 + 8 * g, cols, true, xv);
          if (j.norm) {
#pragma unroll
            for (int i = 0; i < 8; ++i) ss[t] += xv[i] * xv[i];
            if (j.norm_w)
#pragma unroll
              for (int i = 0; i < 8; ++i) xv[i] *= nw[i];
          }
          float s = 0.f;
#pragma unroll
          for (int i = 0; i < 8; ++i) s += v[i] * xv[i];
          acc[t] += s;
        }
      }
    }
    __syncwarp();  // every lane is done with this buffer before it is refilled
    if (c + 2 < nchunks) issue(c + 2);
  }
  float* y = j.y[mi];
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    float s = warp_sum(acc[t]);
    if (j.norm) s *= 1.f / sqrtf(warp_sum(ss[t]) / (float)cols + j.eps);
    if (lane == 0 && t < j.n) {
      if (j.accumulate) y[t * rows + r] += s;
      else y[t * rows + r] = s;
    }
  }
}

// The raw words of pair k of one super-block of a K-quant row, loaded apart from their decoding
// (k_dec) so that a lane's loads of several pairs, and the first ones before the kernel waits on
// the step before it, are in flight at once. q6_K's 32-byte runs start at 0 or 2 mod 4: the nine
// aligned words around each, shifted a half-word at decoding (every word holds one of the 32 bytes
// or the block's own bytes after them, so nothing outside the matrix is read).
template <uint32_t T> struct KRaw {  // q4_K / q5_K: the 16-byte header (d, dmin, 12 scale bytes), quants
  uint4 h, q0, q1, e0, e1;           // e0 / e1: q5_K's 32 high-bit bytes (unused for q4_K)
};
template <> struct KRaw<T_Q6_K> {
  uint32_t ql[9], qh[9], sc01, sc45, d;
};

template <uint32_t T>
__device__ __forceinline__ void k_load(const uint8_t* b, int k, KRaw<T>& r) {
  if constexpr (T == T_Q6_K) {
    const int h = k >> 1, s = k & 1;
    const auto* a = reinterpret_cast<const uint32_t*>(reinterpret_cast<uintptr_t>(b + h * 64 + s * 32) & ~uintptr_t(3));
    const auto* c = reinterpret_cast<const uint32_t*>(reinterpret_cast<uintptr_t>(b + 128 + h * 32) & ~uintptr_t(3));
#pragma unroll
    for (int i = 0; i < 9; ++i) r.ql[i] = __ldg(a + i), r.qh[i] = __ldg(c + i);
    r.sc01 = ld16(b + 192 + h * 8 + s * 2), r.sc45 = ld16(b + 196 + h * 8 + s * 2), r.d = ld16(b + 208);
  } else {
    constexpr int qs_off = T == T_Q4_K ? 16 : 48;
    r.h = __ldg(reinterpret_cast<const uint4*>(b));
    r.q0 = __ldg(reinterpret_cast<const uint4*>(b + qs_off + 32 * k));
    r.q1 = __ldg(reinterpret_cast<const uint4*>(b + qs_off + 16 + 32 * k));
    if constexpr (T == T_Q5_K) {
      r.e0 = __ldg(reinterpret_cast<const uint4*>(b + 16));
      r.e1 = __ldg(reinterpret_cast<const uint4*>(b + 32));
    }
  }
}

// Pair k of a super-block (its raw words r; b its bytes' address, for q6_K's shift) as
// gemv_k_i8_k reads it: the two sub-blocks' quants as bytes (q6_K: signed), their scales a 16
// (q4_K / q5_K: the same twice), the mins' factors (q6_K: 0), and the two sub-blocks' indices in
// the super-block.
template <uint32_t T>
__device__ __forceinline__ void k_dec(const KRaw<T>& r, const uint8_t* b, int k, uint32_t qa[8], uint32_t qb[8],
                                      float wa[2], float wb[2], float& na, float& nb, int& sa, int& sbk) {
  if constexpr (T == T_Q6_K) {
    const int h = k >> 1, s = k & 1;
    const uint32_t sh = (uint32_t)(reinterpret_cast<uintptr_t>(b) & 2) * 8;  // b + 64h + 32s, b + 128 + 32h alike
    const float d = h2f(r.d);
    const float s0 = (float)(int8_t)(r.sc01 & 0xFFu), s1 = (float)(int8_t)(r.sc01 >> 8);
    const float s4 = (float)(int8_t)(r.sc45 & 0xFFu), s5 = (float)(int8_t)(r.sc45 >> 8);
    wa[0] = d * s0, wa[1] = d * s1, wb[0] = d * s4, wb[1] = d * s5;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const uint32_t ql = __funnelshift_r(r.ql[i], r.ql[i + 1], sh), qh = __funnelshift_r(r.qh[i], r.qh[i + 1], sh);
      qa[i] = __vsub4((ql & 0x0F0F0F0Fu) | ((qh >> (2 * s)) & 0x03030303u) << 4, 0x20202020u);
      qb[i] = __vsub4(((ql >> 4) & 0x0F0F0F0Fu) | ((qh >> (2 * s + 4)) & 0x03030303u) << 4, 0x20202020u);
    }
    na = nb = 0.f, sa = h * 4 + s, sbk = sa + 2;
  } else {
    const float d = h2f(r.h.x & 0xFFFFu), dmin = h2f(r.h.x >> 16);
    int s0, m0, s1, m1;
    k_scale_min_r(r.h, 2 * k, s0, m0);
    k_scale_min_r(r.h, 2 * k + 1, s1, m1);
    const uint32_t qw[8] = {r.q0.x, r.q0.y, r.q0.z, r.q0.w, r.q1.x, r.q1.y, r.q1.z, r.q1.w};
    const uint32_t hw[8] = {r.e0.x, r.e0.y, r.e0.z, r.e0.w, r.e1.x, r.e1.y, r.e1.z, r.e1.w};
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      qa[i] = qw[i] & 0x0F0F0F0Fu, qb[i] = (qw[i] >> 4) & 0x0F0F0F0Fu;
      if constexpr (T == T_Q5_K) {
        qa[i] |= ((hw[i] >> (2 * k)) & 0x01010101u) << 4;
        qb[i] |= ((hw[i] >> (2 * k + 1)) & 0x01010101u) << 4;
      }
    }
    wa[0] = wa[1] = d * (float)s0, wb[0] = wb[1] = d * (float)s1;
    na = dmin * (float)m0, nb = dmin * (float)m1, sa = 2 * k, sbk = sa + 1;
  }
}

// q8 mode's K-quant GEMVs on int8 dot products (q4_K: DASLLAMA_CUDA_Q4K_I8; q5_K / q6_K:
// DASLLAMA_CUDA_Q56K_I8; both on): x in the A8 blocks of 32 (quantize_act). A lane takes a pair of
// 32-weight sub-blocks a super-block (k_pair), so a 2048-wide row is one pair a lane. Where
// gemv_staged_k reads each token's f32 x once per row and decodes every weight to f32, this reads
// a quarter of the x bytes and multiplies four quants an instruction.
// q4_K / q5_K: pair k is sub-blocks 2k, 2k + 1 (the low and high nibbles of the same 32 bytes,
// q5_K's fifth bits in bits 2k, 2k + 1 of its 32 high bytes); each is d * sc * xd * sum(q * xq) -
// dmin * m * xd * sum(xq), the second sum the block's stored one.
// q6_K: pair k is sub-blocks s and s + 2 of half h (k = 2h + s: low and high nibbles of the same
// 32 ql bytes, two bits each of the half's 32 qh bytes), quants stored + 32 and made signed a byte
// at a time; each 16 weights have their own int8 scale, so d * xd * (sc0 * sum0 + sc1 * sum1).
// A lane's loads of its first U pairs (k_load) go out before the kernel waits on the step before
// (the weights are constant), and U pairs at a time after (k_i8_pairs), decoded apart (k_dec).
// A warp takes R rows (DASLLAMA_CUDA_KI8_R for 2-16 tokens, 1 at one token), each x load then
// serving R rows (H100 Q4_K_M: a 16-token step's q4_K GEMVs took 47 us a launch against 9 at one
// token, every row reading all of x the suspect). A row's sums are the same for any R.
template <uint32_t T, int NT, int R, int U>
__global__ void __launch_bounds__(SW * 32) gemv_k_i8_k(GemvJob j) {
  const int lane = threadIdx.x & 31;
  int mi;
  int64_t r0;
  const uint8_t* row0;
  const bool live = warp_row<R>(j, mi, r0, row0);
  const int64_t rows = j.rows[mi], cols = j.cols, nb = cols / 32;
  const size_t rb = j.rb[mi];
  const int pairs = (int)(cols / 64);
  // Rows of a last warp past the end read the last row (not stored); pairs past the end, nothing.
  KRaw<T> raw[U][R];
  auto load = [&](int p0) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int p = p0 + 32 * u;
      if (p >= pairs) break;
#pragma unroll
      for (int q = 0; q < R; ++q) {
        const int64_t dr = r0 + q < rows ? q : rows - 1 - r0;
        k_load<T>(row0 + dr * rb + (int64_t)(p >> 2) * Blk<T>::bytes, p & 3, raw[u][q]);
      }
    }
  };
  if (live) load(lane);  // the weights are constant: in flight before x (the step before) is ready
  pdl_wait();
  pdl_trigger();
  if (!live) return;
  float acc[NT][R];
#pragma unroll
  for (int t = 0; t < NT; ++t)
#pragma unroll
    for (int q = 0; q < R; ++q) acc[t][q] = 0.f;
  for (int p0 = lane; p0 < pairs; p0 += 32 * U) {
    if (p0 != lane) load(p0);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int p = p0 + 32 * u;
      if (p >= pairs) break;
      const int sb = p >> 2, k = p & 3;
      uint32_t qa[R][8], qb[R][8];
      float wa[R][2], wb[R][2], na[R], nbm[R];
      int sa = 0, sbk = 0;
#pragma unroll
      for (int q = 0; q < R; ++q) {
        const int64_t dr = r0 + q < rows ? q : rows - 1 - r0;
        k_dec<T>(raw[u][q], row0 + dr * rb + (int64_t)sb * Blk<T>::bytes, k, qa[q], qb[q], wa[q], wb[q], na[q], nbm[q],
                 sa, sbk);
      }
      const int64_t xa = (int64_t)sb * 8 + sa, xb = (int64_t)sb * 8 + sbk;  // x's blocks of the two sub-blocks
#pragma unroll
      for (int t = 0; t < NT; ++t) {
        if (t < j.n) {
          const int4* va = reinterpret_cast<const int4*>(j.xq + t * cols + xa * 32);
          const int4* vb = reinterpret_cast<const int4*>(j.xq + t * cols + xb * 32);
          const int4 a0 = va[0], a1 = va[1], c0 = vb[0], c1 = vb[1];
          const int xva[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
          const int xvb[8] = {c0.x, c0.y, c0.z, c0.w, c1.x, c1.y, c1.z, c1.w};
          const float xda = j.xd[t * nb + xa], xdb = j.xd[t * nb + xb];
          float xsa = 0.f, xsb = 0.f;
          if constexpr (T != T_Q6_K) xsa = (float)j.xs[t * nb + xa], xsb = (float)j.xs[t * nb + xb];
#pragma unroll
          for (int q = 0; q < R; ++q) {
            int s[2] = {0, 0}, v[2] = {0, 0};  // the first and second 16 of each sub-block
#pragma unroll
            for (int i = 0; i < 8; ++i) {
              s[i >> 2] = __dp4a((int)qa[q][i], xva[i], s[i >> 2]);
              v[i >> 2] = __dp4a((int)qb[q][i], xvb[i], v[i >> 2]);
            }
            float va_ = wa[q][0] * (float)s[0] + wa[q][1] * (float)s[1];
            float vb_ = wb[q][0] * (float)v[0] + wb[q][1] * (float)v[1];
            if constexpr (T != T_Q6_K) va_ -= na[q] * xsa, vb_ -= nbm[q] * xsb;
            acc[t][q] += xda * va_ + xdb * vb_;
          }
        }
      }
    }
  }
  float* y = j.y[mi];
#pragma unroll
  for (int q = 0; q < R; ++q) {
    const int64_t r = r0 + q;
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      const float v = warp_sum(acc[t][q]);
      if (lane == 0 && t < j.n && r < rows) {
        if (j.accumulate) y[t * rows + r] += v;
        else y[t * rows + r] = v;
      }
    }
  }
}

// One block per id, threads over 8-element groups.
template <uint32_t T>
__global__ void get_rows_k(const uint8_t* __restrict__ W, size_t rb, int64_t cols, const int32_t* __restrict__ ids,
                           float* __restrict__ out, bool wvec) {
  pdl_wait();
  pdl_trigger();
  const int64_t i = blockIdx.x;
  const uint8_t* row = W + (int64_t)ids[i] * rb;
  float* o = out + i * cols;
  for (int64_t g = threadIdx.x; g * 8 < cols; g += blockDim.x) {
    float v[8];
    dq8<T>(row, g, cols, wvec, v);
#pragma unroll
    for (int j = 0; j < 8; ++j)
      if (g * 8 + j < cols) o[g * 8 + j] = v[j];
  }
}

// matmul_id for decode (a few pairs): one warp per (expert row, pair); the pair's expert picks
// the slice of the stack, so a step reads just the k experts each token routes to.
template <uint32_t T>
__global__ void __launch_bounds__(128) gemv_id_k(const uint8_t* __restrict__ W, size_t rb, int64_t R, int64_t cols,
                                                 const float* __restrict__ x, int64_t x_div,
                                                 const int32_t* __restrict__ ids, int64_t p0,
                                                 const float* __restrict__ bias, float* __restrict__ y, bool wvec,
                                                 bool xvec) {
  pdl_wait();
  pdl_trigger();
  const int lane = threadIdx.x & 31;
  const int64_t r = (int64_t)blockIdx.x * 4 + (threadIdx.x >> 5);
  if (r >= R) return;
  const int64_t p = p0 + blockIdx.y;
  const int64_t e = ids[p];
  const uint8_t* row = W + (e * R + r) * rb;
  const float* xr = x + (p / x_div) * cols;
  const int64_t ng = (cols + 7) / 8;
  float acc = 0.f;
#pragma unroll 2
  for (int64_t g = lane; g < ng; g += 32) {
    float v[8], xv[8];
    dq8<T>(row, g, cols, wvec, v);
    ld_x8(xr, g * 8, cols, xvec, xv);
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) s += v[i] * xv[i];
    acc += s;
  }
  const float s = warp_sum(acc);
  if (lane == 0) y[p * R + r] = s + (bias ? bias[e * R + r] : 0.f);
}

// matmul_id for prefill and batched steps: a block per (expert, 4 rows) gathers the pairs routed
// to its expert (a scan of ids into shared memory), then streams each weight row once per 16 of
// them (gemv_k's inner loop over gathered x rows), so an expert is read once per 16 tokens, not
// once per token. Each pair's sums run in the same order as in gemv_id_k.
constexpr int kIdMaxPairs = 4096;
template <uint32_t T>
__global__ void __launch_bounds__(128) gemv_id_grouped_k(const uint8_t* __restrict__ W, size_t rb, int64_t R,
                                                         int64_t cols, const float* __restrict__ x, int64_t x_div,
                                                         const int32_t* __restrict__ ids, int64_t n_pairs,
                                                         const float* __restrict__ bias, float* __restrict__ y,
                                                         bool wvec, bool xvec) {
  pdl_wait();
  pdl_trigger();
  __shared__ int plist[kIdMaxPairs];
  __shared__ int cnt;
  const int e = blockIdx.y;
  if (threadIdx.x == 0) cnt = 0;
  __syncthreads();
  for (int64_t p = threadIdx.x; p < n_pairs; p += blockDim.x)
    if (ids[p] == e) plist[atomicAdd(&cnt, 1)] = (int)p;
  __syncthreads();
  const int n = cnt;
  const int lane = threadIdx.x & 31;
  const int64_t r = (int64_t)blockIdx.x * 4 + (threadIdx.x >> 5);
  if (n == 0 || r >= R) return;  // uniform per warp: no shuffle below is left half-done
  const uint8_t* row = W + ((int64_t)e * R + r) * rb;
  const int64_t ng = (cols + 7) / 8;
  const float b = bias ? bias[(int64_t)e * R + r] : 0.f;
  for (int c0 = 0; c0 < n; c0 += 16) {
    const int nt = min(16, n - c0);
    float acc[16];
#pragma unroll
    for (int t = 0; t < 16; ++t) acc[t] = 0.f;
    for (int64_t g = lane; g < ng; g += 32) {
      float v[8];
      dq8<T>(row, g, cols, wvec, v);
#pragma unroll
      for (int t = 0; t < 16; ++t) {
        if (t < nt) {
          float xv[8];
          ld_x8(x + ((int64_t)plist[c0 + t] / x_div) * cols, g * 8, cols, xvec, xv);
          float s = 0.f;
#pragma unroll
          for (int i = 0; i < 8; ++i) s += v[i] * xv[i];
          acc[t] += s;
        }
      }
    }
#pragma unroll
    for (int t = 0; t < 16; ++t) {
      const float s = warp_sum(acc[t]);
      if (lane == 0 && t < nt) y[(int64_t)plist[c0 + t] * R + r] = s + b;
    }
  }
}

bool aligned16(const void* p) { return ((uintptr_t)p & 15) == 0; }
bool aligned4(const void* p) { return ((uintptr_t)p & 3) == 0; }
// Tokens up to which matmuls take the staged GEMV (in passes of 16); past it the tile kernel.
constexpr int64_t kStagedMax = 32;

// ---- Direct GEMV: layouts whose rows are 16-byte aligned (f16, bf16, split q8_0 / q4_0) --
// A warp takes R consecutive rows; each lane loads 16-byte units straight from global
// memory (U units of each row in flight), so the x values it reads serve R rows. The
// block scale multiplies a partial sum of 8 products (quants converted exactly).
// The block's 8 warps form 8 / KS groups of R rows; the KS warps of a group split the
// row's units, and their partial sums meet in shared memory. KS grows with the row length
// so that short rows still give every lane two units, and long rows many warps.
// Block `bid` of it (gemv_direct_k's grid); wait() runs once the first round of weights is in
// flight, as in gemv_q8_block.
template <uint32_t T, int NT, int R, class Wait, class Out>
__device__ __forceinline__ void gemv_direct_block(const GemvJob& j, int ks, int bid, Wait wait, Out out) {
  constexpr int UE = Unit<T>::e, U = 2;
  constexpr bool scaled = T == T_Q8_0S || T == T_Q4_0S;
  __shared__ float red[SW][R + 1][NT];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  GemvRows<T, NT, R> m(j, ks, bid);
  const int cols = m.cols;
  float acc[R][NT], ss[NT];
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    ss[t] = 0.f;
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r][t] = 0.f;
  }
  uint4 q[U][R];
  float d[U][R];
  const int u_first = m.ub + lane, ue = m.ue;
  const bool live = m.left > 0;
  if (live && u_first < ue) m.load(u_first, q, d);
  wait();
  m.output(j);
  for (int u0 = u_first; live && u0 < ue; u0 += 32 * U) {
    if (u0 != u_first) m.load(u0, q, d);
#pragma unroll
    for (int k = 0; k < U; ++k) {
      const int u = u0 + 32 * k;
      if (u >= ue) break;
#pragma unroll
      for (int h = 0; h < UE / 8; ++h) {
        float wv[R][8];
        int off = 0;
#pragma unroll
        for (int r = 0; r < R; ++r) off = unit_group<T>(q[k][r], h, wv[r]);
        const int e = u * UE + off;
        float nw[8];
        if (j.norm_w) {
          const float4 a = __ldg(reinterpret_cast<const float4*>(j.norm_w + e));
          const float4 b = __ldg(reinterpret_cast<const float4*>(j.norm_w + e) + 1);
          nw[0] = a.x, nw[1] = a.y, nw[2] = a.z, nw[3] = a.w, nw[4] = b.x, nw[5] = b.y, nw[6] = b.z, nw[7] = b.w;
        }
#pragma unroll
        for (int t = 0; t < NT; ++t) {
          if (t < j.n) {
            float xv[8];
            ld_x8(j.x + t * cols, e, cols, true, xv);
            if (j.norm) {
#pragma unroll
              for (int i = 0; i < 8; ++i) ss[t] += xv[i] * xv[i];
              if (j.norm_w)
#pragma unroll
                for (int i = 0; i < 8; ++i) xv[i] *= nw[i];
            }
#pragma unroll
            for (int r = 0; r < R; ++r) {
              float p = 0.f;
#pragma unroll
              for (int i = 0; i < 8; ++i) p += wv[r][i] * xv[i];
              acc[r][t] += scaled ? d[k][r] * p : p;
            }
          }
        }
      }
    }
  }
#pragma unroll
  for (int t = 0; t < NT; ++t) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const float s = warp_sum(acc[r][t]);
      if (lane == 0) red[warp][r][t] = s;
    }
    const float qs = warp_sum(ss[t]);
    if (lane == 0) red[warp][R][t] = qs;
  }
  __syncthreads();
  if (m.part != 0) return;  // (warp-uniform)
  float s = 0.f;
  if (lane < R * NT) {
    float qs = 0.f;
    for (int p = 0; p < ks; ++p) s += red[warp + p][m.my_r][m.my_t], qs += red[warp + p][R][m.my_t];
    if (j.norm) s *= 1.f / sqrtf(qs / (float)cols + j.eps);
  }
  out(j, m, s);
}
template <uint32_t T, int NT, int R, class Out = StoreOut>
__global__ void __launch_bounds__(SW * 32, NT <= 4 ? 3 : 2) gemv_direct_k(GemvJob j, int ks, bool early, Out out) {
  if (!early) pdl_wait(), pdl_trigger();
  gemv_direct_block<T, NT, R>(j, ks, (int)blockIdx.x, [early] {
    if (early) pdl_wait(), pdl_trigger();
  }, out);
}

// ---- Quantized activations (q8 mode): the CPU's A8 rounding, then int8 dot products -----
// Blocks of (token row, 8 quant blocks): each block sums the row's squares itself (the
// row is a few kilobytes, read from L2) so no pass waits for another; the RMS scale as
// rms_norm_k computes it (double sum), then a warp per 32-block: amax, d = amax / 127,
// q = rint(x * (127 / amax)), and the quant sum.
// Rounds token row t of x (xr, cols floats) from 32-block b on, every step-th block, with the
// block's 256 threads (a warp per 32-block). kL2: x was written earlier in this kernel by other
// blocks, so it is read from L2 (L1 may hold stale lines). The norm's loads go out 8 at a time
// before their squares are added, in order (one load in flight a thread had made a 2048-wide row 8
// dependent trips to L2: H100 Llama-1B, 4.0 us a launch).
template <bool kL2>
__device__ __forceinline__ void round_row(const float* xr, int64_t cols, bool norm, const float* nw, float eps,
                                          int64_t t, int64_t b, int64_t step, int8_t* xq, float* xd, int32_t* xs) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t nb = cols / 32;
  float sc = 1.f;
  if (norm) {
    __shared__ double sh[8];
    double ss = 0;
    constexpr int K = 8;
    for (int64_t i0 = threadIdx.x; i0 < cols; i0 += (int64_t)blockDim.x * K) {
      float v[K];
#pragma unroll
      for (int k = 0; k < K; ++k) {
        const int64_t i = i0 + (int64_t)k * blockDim.x;
        v[k] = i < cols ? (kL2 ? __ldcg(xr + i) : __ldg(xr + i)) : 0.f;
      }
#pragma unroll
      for (int k = 0; k < K; ++k)
        if (i0 + (int64_t)k * blockDim.x < cols) ss += (double)v[k] * v[k];
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    if (lane == 0) sh[warp] = ss;
    __syncthreads();
    double tot = 0;
#pragma unroll
    for (int w = 0; w < 8; ++w) tot += sh[w];
    sc = (float)(1.0 / sqrt(tot / cols + eps));
  }
  for (int64_t bb = b; bb < nb; bb += step) {
    const int64_t i = bb * 32 + lane;
    float v = kL2 ? __ldcg(xr + i) : __ldg(xr + i);
    if (norm) v = nw ? __fmul_rn(v, sc) * nw[i] : v * sc;
    quant_store(v, lane, t * cols + i, t * nb + bb, xq, xd, xs);
  }
}

__global__ void __launch_bounds__(256) quantize_act_k(const float* __restrict__ x, int64_t cols, bool norm,
                                                      const float* __restrict__ nw, float eps, int8_t* __restrict__ xq,
                                                      float* __restrict__ xd, int32_t* __restrict__ xs) {
  pdl_wait();
  pdl_trigger();
  const int64_t t = blockIdx.y;
  const int warp = threadIdx.x >> 5;
  const int64_t nb = cols / 32, b = (int64_t)blockIdx.x * 8 + warp;
  // A grid one block wide (normed prefill rows) walks all of the row's blocks: the norm's sum
  // is then formed once a row, not once per 8 blocks (the same sum, the same bits).
  round_row<false>(x + t * cols, cols, norm, nw, eps, t, b, gridDim.x == 1 ? 8 : nb, xq, xd, xs);
}

// The down projection's input in q8 mode: the GLU (written out as the glu op does) and its
// quantization in one pass, a warp per 32-block.
__global__ void __launch_bounds__(256) glu_quantize_k(const float* __restrict__ gate, int64_t gs,
                                                      const float* __restrict__ up, int64_t us, int act, float* out,
                                                      int64_t cols, int8_t* __restrict__ xq, float* __restrict__ xd,
                                                      int32_t* __restrict__ xs) {
  pdl_wait();
  pdl_trigger();
  const int64_t t = blockIdx.y;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t nb = cols / 32, b = (int64_t)blockIdx.x * 8 + warp;
  if (b >= nb) return;
  const int64_t i = b * 32 + lane;
  const float v = glu_value(act, gate[t * gs + i], up[t * us + i]);
  out[t * cols + i] = v;
  quant_store(v, lane, t * cols + i, t * nb + b, xq, xd, xs);
}

// The direct kernel's shape with int8 dot products: a 16-byte unit is 16 q8_0 weights (4
// dp4a against the token's quants) or a whole q4_0 block (8 dp4a, less 8 * its quant sum);
// per unit, the integer sum times the weight and activation scales.
// Four blocks an SM (64 registers) for up to 4 tokens: the profile showed 2 blocks, a
// quarter occupancy, too few loads in flight to reach the memory's bandwidth.
// round_row<true> for one row of cols <= 32 * K with the row held in registers: each thread
// loads all its values (and norm weights) in one round of L2 reads, where the strided loops
// would wait on one read per 256 values twice over. The same values in the same order as
// round_row's loops (thread t takes elements t, t + 256, ...), so the same bits.
template <int K>
__device__ __forceinline__ void round_row_regs(const float* xr, int64_t cols, bool norm, const float* nw, float eps,
                                               int8_t* xq, float* xd, int32_t* xs) {
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int64_t nb = cols / 32;
  float v[K], w[K];
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int64_t i = tid + 256 * k;
    v[k] = i < cols ? __ldcg(xr + i) : 0.f;
    w[k] = norm && nw && i < cols ? __ldg(nw + i) : 1.f;
  }
  float sc = 1.f;
  if (norm) {
    __shared__ double sh[8];
    double ss = 0;
#pragma unroll
    for (int k = 0; k < K; ++k)
      if (tid + 256 * k < cols) ss += (double)v[k] * v[k];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    if (lane == 0) sh[warp] = ss;
    __syncthreads();
    double tot = 0;
#pragma unroll
    for (int q = 0; q < 8; ++q) tot += sh[q];
    sc = (float)(1.0 / sqrt(tot / cols + eps));
  }
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int64_t bb = warp + 8 * k;  // warp-uniform
    if (bb >= nb) break;
    float x = v[k];
    if (norm) x = nw ? __fmul_rn(x, sc) * w[k] : x * sc;
    quant_store(x, lane, bb * 32 + lane, bb, xq, xd, xs);
  }
}

// The GemvTail of a one-token gemv_q8_k block (R rows a warp group), after its outputs.
// The block counts itself in once its stores are fenced (grid-sync style: the barrier, then
// one thread's fence and atomic), so the block that counts last sees every block's outputs.
template <int R>
__device__ __forceinline__ void gemv_tail(const GemvJob& j, int ks, const GemvTail& t) {
  __shared__ int go;
  int64_t chunk = 0;
  unsigned* c = t.cnt;
  unsigned need = gridDim.x;
  if (t.kind == GemvTail::glu) {
    const int64_t bid = blockIdx.x, per_block = (SW / ks) * R;
    const int mi = bid >= j.first_block[1] ? 1 : 0;
    chunk = (bid - j.first_block[mi]) * per_block / 32;
    c += chunk, need = 2 * (unsigned)(32 / per_block);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    go = atomicAdd(c, 1u) == need - 1;
    if (go) atomicExch(c, 0u), __threadfence();  // the last arrival: leave it zeroed for the next launch
  }
  __syncthreads();
  if (!go) return;
  int8_t* xq = static_cast<int8_t*>(t.q);
  float* xd = reinterpret_cast<float*>(xq + t.cols);
  int32_t* xs = reinterpret_cast<int32_t*>(xd + t.cols / 32);
  if (t.kind == GemvTail::round) {
    if (t.cols <= 2048) round_row_regs<8>(t.x, t.cols, t.norm, t.nw, t.eps, xq, xd, xs);
    else if (t.cols <= 4096) round_row_regs<16>(t.x, t.cols, t.norm, t.nw, t.eps, xq, xd, xs);
    else round_row<true>(t.x, t.cols, t.norm, t.nw, t.eps, 0, threadIdx.x >> 5, 8, xq, xd, xs);
  } else if (threadIdx.x < 32) {  // as glu_quantize_k's warp for this 32-block
    const int lane = threadIdx.x;
    const int64_t i = chunk * 32 + lane;
    const float v = glu_value(t.act, __ldcg(j.y[0] + i), __ldcg(j.y[1] + i));
    t.out[i] = v;
    quant_store(v, lane, i, chunk, xq, xd, xs);
  }
}

template <uint32_t T, int NT, int R, bool kTail = false, int MINB = (NT <= 4 ? 4 : 2), bool kXN = false>
__global__ void __launch_bounds__(SW * 32, MINB) gemv_q8_k(GemvJob j, int ks, bool early, GemvTail tail) {
  if (!early) pdl_wait(), pdl_trigger();
  gemv_q8_block<T, NT, R, XLoad::nc, 2, kXN>(j, ks, (int)blockIdx.x, [early] {
    if (early) pdl_wait(), pdl_trigger();
  });
  if constexpr (kTail) gemv_tail<R>(j, ks, tail);
}

// The cluster tails (GemvTail::rms, glu_cluster; sm_90). Cluster c holds the blocks of 32-row
// chunk c of one matrix (rms: the residual row x) or of two (glu: gate's, then up's). A block's
// outputs go to its own shared memory (OwnOut), then to the cluster's rank 0 by st_async, counted
// on rank 0's shared-memory barrier, and to global memory; rank 0's first warp waits on that
// barrier and has the chunk. No counter, no fence (a cluster barrier's release is a GPU-wide
// memory barrier in SASS), no global read: the counted tails' fence and atomic in every block had
// cost more than the launches they replaced (RESULTS.md, thirty-seventh and forty-fourth
// sessions).
struct OwnOut {
  float* own;  // 32 floats: this block's rows at their places in the chunk
  template <class Rows>
  __device__ __forceinline__ void prepare(const GemvJob&, const Rows&) const {}
  template <class Rows>
  __device__ __forceinline__ void operator()(const GemvJob& j, const Rows& m, float s) const {
    if (m.store) own[(m.r0 + m.my_r) & 31] = j.accumulate ? m.res + s : s;
  }
};

// One cluster's GEMV blocks over `P` matrices of the job (the block's rank picks the matrix and
// its blocks' place in the chunk): run(bid, wait, out) runs block bid of the GEMV's grid. True on
// rank 0's first warp only, once the chunk's rows of matrix p are in got[p][0..31]. A matrix
// whose output is `dead` (the GLU's, written in place over up by rank 0) is not stored: another
// block's store could land after rank 0's.
template <int P, class Run>
__device__ __forceinline__ bool cluster_chunk(const GemvJob& j, bool early, float (&got)[P][32], Run run,
                                              const float* dead = nullptr) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  __shared__ float own[32];
  __shared__ __align__(8) uint64_t bar;
  const unsigned rank = cluster_rank(), per = cluster_blocks() / P, mi = rank / per, at = rank % per;
  if (rank == 0 && threadIdx.x == 0) mbar_init_tx(&bar, P * 32 * 4);
  cluster_arrive_relaxed();  // phase 1: this block runs (rank 0: its barrier is set up)
  const int64_t ci = blockIdx.x / cluster_blocks();
  const int bid = (int)((mi ? j.first_block[mi] : 0) + ci * per + at);
  const int per_block = 32 / (int)per;
  if (!early) pdl_wait(), pdl_trigger();
  run(bid,
      [early] {
        if (early) pdl_wait(), pdl_trigger();
        cluster_wait();
      },
      OwnOut{own});
  __syncthreads();
  if ((int)threadIdx.x < per_block) {
    const int slot = (int)at * per_block + (int)threadIdx.x;
    const float v = own[slot];
    st_async(cluster_map(&got[mi][slot], 0), v, cluster_map(&bar, 0));
    float* y = j.y[mi == 2 ? 2 : mi == 1 ? 1 : 0];
    if (y != dead) y[ci * 32 + slot] = v;
  }
  if (rank != 0 || threadIdx.x >= 32) return false;
  mbar_wait(&bar, 0);
  return true;
#else
  return false;
#endif
}

// One token's residual GEMV (O, down) with the rms tail: rank 0 rounds its chunk of x * nw (nw
// read before the wait) and writes the chunk's sum of squares; the next GEMV applies the norm.
template <uint32_t T>
__global__ void __launch_bounds__(SW * 32, 4) gemv_q8_rms_k(GemvJob j, int ks, bool early, GemvTail t) {
  __shared__ float got[1][32];
  const int lane = threadIdx.x & 31;
  const int64_t ci = blockIdx.x / cluster_blocks();
  float w = 1.f;
  if (threadIdx.x < 32 && t.nw && cluster_rank() == 0) w = __ldg(t.nw + ci * 32 + lane);
  const auto run = [&](int bid, auto wait, OwnOut o) { gemv_q8_block<T, 1, 2, XLoad::nc>(j, ks, bid, wait, o); };
  if (!cluster_chunk<1>(j, early, got, run)) return;
  const float v = got[0][lane];
  const double ss = warp_sum_d((double)v * v);
  int8_t* xq = static_cast<int8_t*>(t.q);
  float* xd = reinterpret_cast<float*>(xq + t.cols);
  int32_t* xs = reinterpret_cast<int32_t*>(xd + t.cols / 32);
  quant_store(v * w, lane, ci * 32 + lane, ci, xq, xd, xs);
  if (lane == 0) t.xn[ci] = ss;
}

// One token's gate / up GEMV with the GLU tail on clusters: gate's blocks of chunk c, then up's
// (block ids renumbered; each block's sums as gemv_q8_k's), and rank 0 forms the chunk's GLU and
// its rounding as glu_quantize_k does (the same bits). kXN: its input came from an rms tail.
template <uint32_t T, bool kXN>
__global__ void __launch_bounds__(SW * 32, 4) gemv_q8_gluc_k(GemvJob j, int ks, bool early, GemvTail t) {
  __shared__ float got[2][32];
  const auto run = [&](int bid, auto wait, OwnOut o) {
    gemv_q8_block<T, 1, 2, XLoad::nc, 2, kXN>(j, ks, bid, wait, o);
  };
  if (!cluster_chunk<2>(j, early, got, run, t.out)) return;
  const int lane = threadIdx.x;
  const int64_t ci = blockIdx.x / cluster_blocks(), i = ci * 32 + lane;
  int8_t* xq = static_cast<int8_t*>(t.q);
  float* xd = reinterpret_cast<float*>(xq + t.cols);
  int32_t* xs = reinterpret_cast<int32_t*>(xd + t.cols / 32);
  const float v = glu_value(t.act, got[0][lane], got[1][lane]);
  t.out[i] = v;
  quant_store(v, lane, i, ci, xq, xd, xs);
}

// The same for a float-activation gate / up GEMV (f16, bf16: gemv_direct_k at 4 rows a group):
// rank 0 writes the chunk's GLU as glu_k does (the same bits), and no glu launch follows.
template <uint32_t T>
__global__ void __launch_bounds__(SW * 32, 3) gemv_direct_gluc_k(GemvJob j, int ks, bool early, GemvTail t) {
  __shared__ float got[2][32];
  const auto run = [&](int bid, auto wait, OwnOut o) { gemv_direct_block<T, 1, 4>(j, ks, bid, wait, o); };
  if (!cluster_chunk<2>(j, early, got, run, t.out)) return;
  const int lane = threadIdx.x;
  t.out[blockIdx.x / cluster_blocks() * 32 + lane] = glu_value(t.act, got[0][lane], got[1][lane]);
}

// gemv_q8_k for one token with the rounding of its input in the prologue: each block rounds x
// (RMS-normed times nw when norm) into its shared memory as quantize_act_k would, while its
// first weights are in flight, so a decode matmul is one launch, not two.
template <uint32_t T>
__global__ void __launch_bounds__(SW * 32, 3) gemv_q8_x_k(GemvJob j, int ks, const float* __restrict__ x, bool norm,
                                                          const float* __restrict__ nw, float eps) {
  __shared__ __align__(16) int8_t sq[kQuantMax];
  __shared__ float sd[kQuantMax / 32];
  __shared__ int32_t ss[kQuantMax / 32];
  __shared__ double red[SW];
  j.xq = sq, j.xd = sd, j.xs = ss;
  gemv_q8_block<T, 1, 4, XLoad::shared>(j, ks, (int)blockIdx.x, [&] {
    pdl_wait();
    pdl_trigger();
    quant_smem<XLoad::nc>(x, j.cols, norm, nw, eps, sq, sd, ss, red);
  });
}

// A Q / K / V GEMV's outputs as rope_store_group_k would leave them (gemv_roped): Q's and K's
// rows turned by rope, K's and V's rows also stored into each token's cache row. Normal rope's
// pairs are adjacent rows, so the two lanes of a pair (R even, lanes NT apart) trade values by a
// shuffle and each forms its half of rope_rot's products. The angles (double) are formed after
// the sums: formed while the weights were in flight, they spilled the registers that hold them.
// Or, with r.early_cs, at the block's start, before any weights are live, into shared memory:
// the q8 kernels' prepare() (gemv_q8_block calls it; gemv_direct_k does not: f16's one-token
// kernel spilled). A launch that starts early then forms them while the kernel before still runs.
// (Their inputs are safe to read then: the positions are uploaded before a step's first kernel,
// the frequencies with the model.) The same values as the rope + store launch, so the same bits.
template <int NT>
struct RopeOut {
  GemvRope r;
  template <class Rows>
  __device__ __forceinline__ bool roped(const GemvJob& j, const Rows& m) const {
    return m.part == 0 && m.my_t < j.n && m.mi < 2 && (m.r0 + m.my_r) % r.head_dim < r.p.n_rot;
  }
  __device__ __forceinline__ float2* cs_slot() const {
    __shared__ float2 cs[SW * 32];
    return cs + threadIdx.x;
  }
  template <class Rows>
  __device__ __forceinline__ void prepare(const GemvJob& j, const Rows& m) const {
    if (NT != 1 || !r.early_cs || !roped(j, m)) return;  // (one token: the batched kernels' registers are full)
    float c, s;
    rope_cs(r.p, r.pos[m.my_t], ((m.r0 + m.my_r) % r.head_dim) >> 1, &c, &s);
    *cs_slot() = make_float2(c, s);
  }
  template <class Rows>
  __device__ __forceinline__ void operator()(const GemvJob& j, const Rows& m, float v) const {
    const float w = __shfl_xor_sync(0xffffffffu, v, NT);  // the pair's other row (row ^ 1)
    const int row = m.r0 + m.my_r, hd = r.head_dim;
    float o = v;
    if (m.store && m.mi < 2 && row % hd < r.p.n_rot) {
      float c, s;
      if (NT == 1 && r.early_cs && j.xq) {
        const float2 cs = *cs_slot();
        c = cs.x, s = cs.y;
      } else {
        rope_cs(r.p, r.pos[m.my_t], (row % hd) >> 1, &c, &s);
      }
      o = (m.my_r & 1) == 0 ? __fmul_rn(v, c) - __fmul_rn(w, s) : __fmul_rn(w, s) + __fmul_rn(v, c);
    }
    if (!m.store) return;
    *m.o = o;
    if (m.mi == 0) return;
    const int64_t t = m.my_t;
    for (int e = 0; e < r.count; ++e) {  // the session (descriptor) whose rows hold token t
      const KVStoreDesc& d = r.d[e];
      const int64_t t0 = (d.k - r.x2) / r.stride2;
      if (t < t0 || t >= t0 + d.n) continue;
      uint8_t* dst = const_cast<uint8_t*>(kv_row(d.kv, m.mi == 2 ? d.kv.v_off : d.kv.k_off, d.first + t - t0));
      const int el = m.r0 + m.my_r;
      if (d.kv.type == KVType::f16) reinterpret_cast<__half*>(dst)[el] = __float2half_rn(o);
      else reinterpret_cast<float*>(dst)[el] = o;
      break;
    }
  }
};

template <uint32_t T, int NT, int R, int MINB = 4, bool kXN = false>
__global__ void __launch_bounds__(SW * 32, MINB) gemv_q8_rope_k(GemvJob j, int ks, bool early, RopeOut<NT> out) {
  if (!early) pdl_wait(), pdl_trigger();
  gemv_q8_block<T, NT, R, XLoad::nc, 2, kXN>(j, ks, (int)blockIdx.x, [early] {
    if (early) pdl_wait(), pdl_trigger();
  }, out);
}

// Whether the GEMVs issue their first weight loads before waiting for the kernel before them
// (the weights are constant; DASLLAMA_CUDA_EARLY=0: wait first, as before the tenth session).
bool pdl_early() {
  static const bool on = [] {
    const char* e = std::getenv("DASLLAMA_CUDA_EARLY");
    return !(e && std::strcmp(e, "0") == 0);
  }();
  return on;
}

// Rows a warp group of the direct kernels takes for 2-4 tokens: 2, since 4 spilled registers
// under the four-blocks-an-SM bound (H200, Llama-1B Q8_0 B=4: 1,347 -> 1,634 t/s; the same sums
// either way). DASLLAMA_CUDA_R4=4 for 4; read at each launch, so ab_cuda.py can switch it.
int rows4() {
  const char* e = std::getenv("DASLLAMA_CUDA_R4");
  return e && std::strcmp(e, "4") == 0 ? 4 : 2;
}
// The same for one token: 2 for the q8 kernels (int8 activations), 4 for the float-activation
// ones (f16, bf16; fp32 mode's blocks). DASLLAMA_CUDA_R1=2 or 4 sets both. Once the GLU tail was
// off, 2 gained for q8 (H100 tg256 Q8_0 1,230 -> 1,259, Q4_0 1,615 -> 1,681) and lost for F16
// (886 -> 863), RESULTS.md's forty-fourth session; an earlier build had measured 2 slower for
// q8_0 (779 -> 748).
int rows1(bool q8) {
  const char* e = std::getenv("DASLLAMA_CUDA_R1");
  if (e && std::strcmp(e, "2") == 0) return 2;
  if (e && std::strcmp(e, "4") == 0) return 4;
  return q8 ? 2 : 4;
}
// With DASLLAMA_CUDA_R1=4, the blocks an SM a one-token q8 GEMV of `grid` blocks at 4 rows a
// group is built for (2 rows build for four): at four its 64 registers spill ~100 bytes a thread
// (ncu, H100: the gate / up GEMV stores 491,520 local sectors a launch), at three (80 registers)
// none for q8_0, 20-44 bytes for q4_0. Three by default: H100 Llama-1B tg256 Q8_0 1,155 -> 1,182,
// Q4_0 1,459 -> 1,532 (RESULTS.md, forty-third session), though gate / up and down alone take
// longer at three (more waves). DASLLAMA_CUDA_MINB1=4 for four, `auto` for three only where the
// grid fits one wave of three an SM (Q / K / V, O: Q4_0 1,548, Q8_0 1,159); read at each launch.
int minb1(unsigned grid) {
  static const int sms = [] {
    int dev = 0, v = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, dev);
    return v;
  }();
  const char* e = std::getenv("DASLLAMA_CUDA_MINB1");
  if (e && std::strcmp(e, "4") == 0) return 4;
  if (e && std::strcmp(e, "auto") == 0) return grid <= 3u * (unsigned)sms ? 3 : 4;
  return 3;
}
// The GEMVs' 32-bit offsets (GemvRows): a matrix's rows, a row's bytes, the columns and the grid.
// Real models sit far below; a matrix past them is refused rather than misread.
void gemv_fits(const GemvJob& j, int ks) {
  bool ok = ks >= 1 && ks <= SW && (ks & (ks - 1)) == 0 && j.count >= 1 && j.count <= 3 &&
            j.first_block[j.count] < (int64_t(1) << 31) && j.cols < (int64_t(1) << 31);
  for (int i = 0; ok && i < j.count; ++i) ok = j.rows[i] < (int64_t(1) << 31) && j.rb[i] < (size_t(1) << 32);
  if (!ok) throw Error("cuda: a matrix past the GEMVs' 32-bit offsets");
}
template <uint32_t T>
void launch_q8(const GemvJob& j, int ks, cudaStream_t st, const GemvTail& tail = GemvTail()) {
  gemv_fits(j, ks);
  const unsigned grid = (unsigned)j.first_block[j.count];
  const bool r2 = rows1(true) == 2, tl = tail.kind != GemvTail::none;
  // The cluster tails (gemv_tail_fits: one token, 2 rows a group, clusters of 2-8 blocks).
  const unsigned per_block = (unsigned)(SW / ks * 2);
  if (tail.kind == GemvTail::rms) {
    if (j.xn) throw Error("cuda: an rms tail over an unnormed input");
    launch_cluster(gemv_q8_rms_k<T>, grid, SW * 32, 0, st, dim3(32 / per_block, 1, 1), j, ks, pdl_early(), tail);
    return;
  }
  if (tail.kind == GemvTail::glu_cluster) {
    const dim3 cl(2 * (32 / per_block), 1, 1);
    if (j.xn) launch_cluster(gemv_q8_gluc_k<T, true>, grid, SW * 32, 0, st, cl, j, ks, pdl_early(), tail);
    else launch_cluster(gemv_q8_gluc_k<T, false>, grid, SW * 32, 0, st, cl, j, ks, pdl_early(), tail);
    return;
  }
  if (j.n == 1 && !r2 && minb1(grid) == 3) {
    if (tl) launch(gemv_q8_k<T, 1, 4, true, 3>, grid, SW * 32, 0, st, j, ks, pdl_early(), tail);
    else launch(gemv_q8_k<T, 1, 4, false, 3>, grid, SW * 32, 0, st, j, ks, pdl_early(), tail);
    return;
  }
  if (j.xn) {  // (rms_tail made the input: one token, 2 rows a group; the GLU tail may follow)
    if (j.n != 1 || !r2) throw Error("cuda: an input left unnormed for a GEMV that cannot norm it");
    if (tl) launch(gemv_q8_k<T, 1, 2, true, 4, true>, grid, SW * 32, 0, st, j, ks, pdl_early(), tail);
    else launch(gemv_q8_k<T, 1, 2, false, 4, true>, grid, SW * 32, 0, st, j, ks, pdl_early(), tail);
    return;
  }
  if (j.n == 1 && tl && r2) launch(gemv_q8_k<T, 1, 2, true>, grid, SW * 32, 0, st, j, ks, pdl_early(), tail);
  else if (j.n == 1 && tl) launch(gemv_q8_k<T, 1, 4, true>, grid, SW * 32, 0, st, j, ks, pdl_early(), tail);
  else if (j.n == 1 && r2) launch(gemv_q8_k<T, 1, 2>, grid, SW * 32, 0, st, j, ks, pdl_early(), tail);
  else if (j.n == 1) launch(gemv_q8_k<T, 1, 4>, grid, SW * 32, 0, st, j, ks, pdl_early(), tail);
  else if (j.n <= 4 && rows4() == 2) launch(gemv_q8_k<T, 4, 2>, grid, SW * 32, 0, st, j, ks, pdl_early(), tail);
  else if (j.n <= 4) launch(gemv_q8_k<T, 4, 4>, grid, SW * 32, 0, st, j, ks, pdl_early(), tail);
  else if (j.n <= 8) launch(gemv_q8_k<T, 8, 4>, grid, SW * 32, 0, st, j, ks, pdl_early(), tail);
  else launch(gemv_q8_k<T, 16, 2>, grid, SW * 32, 0, st, j, ks, pdl_early(), tail);
}

// Warps splitting a row of nu units (a power of two <= 8; each lane two units at least).
int direct_ks(int64_t nu) {
  int ks = 1;
  while (ks < SW && nu >= (int64_t)ks * 2 * 64) ks *= 2;
  return ks;
}
template <uint32_t T>
void launch_direct(const GemvJob& j, int ks, cudaStream_t st) {
  gemv_fits(j, ks);
  const unsigned grid = (unsigned)j.first_block[j.count];
  const StoreOut o;
  if (j.n == 1 && rows1(false) == 2) launch(gemv_direct_k<T, 1, 2>, grid, SW * 32, 0, st, j, ks, pdl_early(), o);
  else if (j.n == 1) launch(gemv_direct_k<T, 1, 4>, grid, SW * 32, 0, st, j, ks, pdl_early(), o);
  else if (j.n <= 4 && rows4() == 2) launch(gemv_direct_k<T, 4, 2>, grid, SW * 32, 0, st, j, ks, pdl_early(), o);
  else if (j.n <= 4) launch(gemv_direct_k<T, 4, 4>, grid, SW * 32, 0, st, j, ks, pdl_early(), o);
  else if (j.n <= 8) launch(gemv_direct_k<T, 8, 4>, grid, SW * 32, 0, st, j, ks, pdl_early(), o);
  else launch(gemv_direct_k<T, 16, 2>, grid, SW * 32, 0, st, j, ks, pdl_early(), o);
}
// gemv_roped's launch (1-4 tokens): the q8 kernel where x is rounded (q8), else the direct one.
template <uint32_t T>
void launch_roped(const GemvJob& j, int ks, const GemvRope& r, cudaStream_t st) {
  gemv_fits(j, ks);
  const unsigned grid = (unsigned)j.first_block[j.count];
  const bool one = j.n == 1, r2 = one ? rows1(j.xq != nullptr) == 2 : rows4() == 2;
  if constexpr (T == T_Q8_0S || T == T_Q4_0S) {
    if (j.xq) {
      if (j.xn && !(one && r2)) throw Error("cuda: an input left unnormed for a GEMV that cannot norm it");
      if (one && r2 && j.xn) launch(gemv_q8_rope_k<T, 1, 2, 4, true>, grid, SW * 32, 0, st, j, ks, pdl_early(), RopeOut<1>{r});
      else if (one && r2) launch(gemv_q8_rope_k<T, 1, 2>, grid, SW * 32, 0, st, j, ks, pdl_early(), RopeOut<1>{r});
      else if (one && minb1(grid) == 3) launch(gemv_q8_rope_k<T, 1, 4, 3>, grid, SW * 32, 0, st, j, ks, pdl_early(), RopeOut<1>{r});
      else if (one) launch(gemv_q8_rope_k<T, 1, 4>, grid, SW * 32, 0, st, j, ks, pdl_early(), RopeOut<1>{r});
      else if (r2) launch(gemv_q8_rope_k<T, 4, 2>, grid, SW * 32, 0, st, j, ks, pdl_early(), RopeOut<4>{r});
      else launch(gemv_q8_rope_k<T, 4, 4>, grid, SW * 32, 0, st, j, ks, pdl_early(), RopeOut<4>{r});
      return;
    }
  }
  if (one && r2) launch(gemv_direct_k<T, 1, 2, RopeOut<1>>, grid, SW * 32, 0, st, j, ks, pdl_early(), RopeOut<1>{r});
  else if (one) launch(gemv_direct_k<T, 1, 4, RopeOut<1>>, grid, SW * 32, 0, st, j, ks, pdl_early(), RopeOut<1>{r});
  else if (r2) launch(gemv_direct_k<T, 4, 2, RopeOut<4>>, grid, SW * 32, 0, st, j, ks, pdl_early(), RopeOut<4>{r});
  else launch(gemv_direct_k<T, 4, 4, RopeOut<4>>, grid, SW * 32, 0, st, j, ks, pdl_early(), RopeOut<4>{r});
}
// Rows a warp group of the direct kernels takes for n tokens (as launch_direct and launch_q8
// pick; q8: int8 activations).
int direct_rows(int n, bool q8) { return n <= 1 ? rows1(q8) : n <= 4 ? rows4() : n <= 8 ? 4 : 2; }
bool is_direct(uint32_t t) { return t == T_F16 || t == T_BF16 || t == T_Q8_0S || t == T_Q4_0S; }
int unit_elems(uint32_t t) { return t == T_Q8_0S ? 16 : t == T_Q4_0S ? 32 : 8; }

// The staged kernel's launch for job j over n <= 16 tokens (VEC: the copy width).
template <uint32_t T, int VEC>
void launch_staged(const GemvJob& j, cudaStream_t st) {
  const unsigned grid = (unsigned)j.first_block[j.count];
  if (j.n == 1) launch(gemv_staged_k<T, 1, VEC>, grid, SW * 32, 0, st, j);
  else if (j.n <= 4) launch(gemv_staged_k<T, 4, VEC>, grid, SW * 32, 0, st, j);
  else if (j.n <= 8) launch(gemv_staged_k<T, 8, VEC>, grid, SW * 32, 0, st, j);
  else launch(gemv_staged_k<T, 16, VEC>, grid, SW * 32, 0, st, j);
}

template <uint32_t T>
void run_matmul(const Mat& m, const float* x, int64_t n, float* y, cudaStream_t st) {
  const bool wvec = m.cols % 8 == 0 && m.row_bytes % 16 == 0 && aligned16(m.w);
  const bool xvec = m.cols % 8 == 0 && aligned16(x);
  if (n <= kStagedMax) {
    GemvJob j;
    j.type = T, j.count = 1, j.w[0] = m.w, j.rb[0] = m.row_bytes, j.rows[0] = m.rows, j.y[0] = y;
    j.cols = m.cols, j.x = x, j.n = (int)n;
    if (gemv_staged_fits(j)) return gemv_staged(j, st);
  }
  if (n <= 8) {
    const dim3 grid((unsigned)ceil_div(m.rows, 4));
    const int nn = (int)n;
    if (n == 1)
      launch(gemv_k<T, 1>, grid, 128, 0, st, m.w, m.row_bytes, m.rows, m.cols, x, nn, y, wvec, xvec);
    else if (n == 2)
      launch(gemv_k<T, 2>, grid, 128, 0, st, m.w, m.row_bytes, m.rows, m.cols, x, nn, y, wvec, xvec);
    else if (n <= 4)
      launch(gemv_k<T, 4>, grid, 128, 0, st, m.w, m.row_bytes, m.rows, m.cols, x, nn, y, wvec, xvec);
    else
      launch(gemv_k<T, 8>, grid, 128, 0, st, m.w, m.row_bytes, m.rows, m.cols, x, nn, y, wvec, xvec);
  } else if (n <= 64) {
    // Batched decode: the GEMV over 16 tokens at a time reads W once per 16 rows of x,
    // where the 64x64 tile would do 64-wide f32 work per block for a few real tokens.
    const dim3 grid((unsigned)ceil_div(m.rows, 4));
    for (int64_t t0 = 0; t0 < n; t0 += 16) {
      const float* xc = x + t0 * m.cols;
      const bool xv = m.cols % 8 == 0 && aligned16(xc);
      launch(gemv_k<T, 16>, grid, 128, 0, st, m.w, m.row_bytes, m.rows, m.cols, xc, (int)std::min<int64_t>(16, n - t0),
                                         y + t0 * m.rows, wvec, xv);
    }
  } else if (mma_f16_fits(m, x, n)) {
    mma_f16(m, x, n, y, st);
  } else {
    const dim3 grid((unsigned)ceil_div(m.rows, BM), (unsigned)ceil_div(n, BN));
    launch(gemm_k<T>, grid, 256, 0, st, m.w, m.row_bytes, m.rows, m.cols, x, n, y, wvec, xvec);
  }
}

}  // namespace

bool matmul_type_ok(uint32_t type) { return served_type(type); }

namespace {

// q8 mode's prefill of block formats on the f16 tiles (mma_f16h): the matrix decoded to f16
// (dq8's values rounded to nearest even) once a matmul, 8 elements (16 bytes out) a thread a pass.
template <uint32_t T>
__global__ void dequant_f16_k(const uint8_t* __restrict__ W, size_t rb, int64_t rows, int64_t cols,
                              __half* __restrict__ out) {
  pdl_wait();  // the scratch may still be read by the matmul before
  pdl_trigger();
  const int64_t groups = cols / 8, total = rows * groups;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t r = i / groups, g = i - r * groups;
    float v[8];
    dq8<T>(W + r * rb, g, cols, false, v);
    uint4 u;
    uint32_t* h = &u.x;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const __half2 p = __floats2half2_rn(v[2 * k], v[2 * k + 1]);  // .x (the lower address) first
      h[k] = *reinterpret_cast<const uint32_t*>(&p);
    }
    *reinterpret_cast<uint4*>(out + r * cols + g * 8) = u;
  }
}

}  // namespace

bool dequant_f16_type(uint32_t t) {
  return t == T_Q4_1 || t == T_Q5_0 || t == T_Q5_1 || t == T_Q4_K || t == T_Q5_K || t == T_Q6_K;
}

void dequant_f16(const Mat& m, void* out, cudaStream_t st) {
  if (!dequant_f16_type(m.type) || m.cols % 8 != 0 || ((uintptr_t)out & 15) != 0)
    throw Error("cuda: a matrix dequant_f16 does not take");
  const int64_t total = m.rows * (m.cols / 8);
  const dim3 grid((unsigned)std::min<int64_t>(ceil_div(total, 256), 65535));
  __half* o = static_cast<__half*>(out);
  switch (m.type) {
#define DL_CASE(T) \
  case T: launch(dequant_f16_k<T>, grid, 256, 0, st, m.w, m.row_bytes, m.rows, m.cols, o); break;
    DL_CASE(T_Q4_1) DL_CASE(T_Q5_0) DL_CASE(T_Q5_1) DL_CASE(T_Q4_K) DL_CASE(T_Q5_K) DL_CASE(T_Q6_K)
#undef DL_CASE
    default: break;
  }
  check_launch("dequant_f16");
}

bool gemv_q8_x_fits(const GemvJob& j) {
  if (j.n != 1 || j.cols > kQuantMax || j.cols % 32 != 0 || (j.type != T_Q8_0S && j.type != T_Q4_0S)) return false;
  GemvJob p = j;
  // Past a few blocks per SM the blocks' repeated rounding costs more than the launch it saves.
  return gemv_q8_plan(p) >= 1 && p.first_block[p.count] <= kQuantBlocksMax;
}

void gemv_q8_x(GemvJob j, const float* x, bool norm, const float* nw, float eps, cudaStream_t st) {
  if (!gemv_q8_x_fits(j)) throw Error("cuda: a matmul the rounding GEMV does not take");
  const int ks = gemv_q8_plan(j);
  const unsigned grid = (unsigned)j.first_block[j.count];
  if (j.type == T_Q8_0S) launch(gemv_q8_x_k<T_Q8_0S>, grid, SW * 32, 0, st, j, ks, x, norm, nw, eps);
  else launch(gemv_q8_x_k<T_Q4_0S>, grid, SW * 32, 0, st, j, ks, x, norm, nw, eps);
  check_launch("gemv_q8_x");
}

int gemv_q8_plan(GemvJob& j, int rows) {
  const int ks = direct_ks(j.cols / unit_elems(j.type));
  const int64_t per_block = SW / ks * rows;
  int64_t b = 0;
  for (int i = 0; i < j.count; ++i) j.first_block[i] = b, b += ceil_div(j.rows[i], per_block);
  j.first_block[j.count] = b;
  gemv_fits(j, ks);
  return ks;
}

void point_qact(GemvJob& j, void* q, int64_t n, int64_t cols) {
  j.xq = static_cast<int8_t*>(q);
  j.xd = reinterpret_cast<float*>(static_cast<uint8_t*>(q) + n * cols);
  j.xs = reinterpret_cast<int32_t*>(static_cast<uint8_t*>(q) + n * cols + n * (cols / 32) * 4);
}

void quantize_act(const float* x, int64_t n, int64_t cols, bool norm, const float* norm_w, float eps, void* q,
                  cudaStream_t st) {
  if (n <= 0) return;
  if (cols % 32 != 0) throw Error("cuda quantize_act: cols must be a multiple of 32");
  GemvJob j;
  point_qact(j, q, n, cols);
  // Decode and batched steps keep a row's blocks spread over blocks (latency; each block forms
  // the row's norm sum itself, the same sum); normed prefill rows take one block a row. Rows
  // from which they do: DASLLAMA_CUDA_QACT_ROWS (default 65; 16 until the seventeenth session,
  // when a batched step's 33 quantize_act launches took 8 us each at 16-64 rows on the H200).
  const char* e = std::getenv("DASLLAMA_CUDA_QACT_ROWS");  // read at each call (ab_cuda.py)
  const int64_t one_from = e && *e ? std::max<int64_t>(1, std::atoll(e)) : int64_t(65);
  const unsigned gx = norm && n >= one_from ? 1u : (unsigned)ceil_div(cols / 32, 8);
  launch(quantize_act_k, dim3(gx, (unsigned)n), 256, 0, st, x, cols, norm, norm_w,
         eps, const_cast<int8_t*>(j.xq), const_cast<float*>(j.xd), const_cast<int32_t*>(j.xs));
  check_launch("quantize_act");
}

void glu_quantize(const float* gate, int64_t gs, const float* up, int64_t us, int act, float* out, int64_t n,
                  int64_t cols, void* q, cudaStream_t st) {
  if (n <= 0) return;
  if (cols % 32 != 0) throw Error("cuda glu_quantize: cols must be a multiple of 32");
  GemvJob j;
  point_qact(j, q, n, cols);
  launch(glu_quantize_k, dim3((unsigned)ceil_div(cols / 32, 8), (unsigned)n), 256, 0, st, gate, gs, up, us, act, out,
         cols, const_cast<int8_t*>(j.xq), const_cast<float*>(j.xd), const_cast<int32_t*>(j.xs));
  check_launch("glu_quantize");
}

bool k_i8_type(uint32_t t) { return t == T_Q4_K || t == T_Q5_K || t == T_Q6_K; }

bool k_i8_on(uint32_t type) {
  if (type == T_Q4_K) {
    const char* e = std::getenv("DASLLAMA_CUDA_Q4K_I8");
    return !(e && e[0] == '0');
  }
  const char* e = std::getenv("DASLLAMA_CUDA_Q56K_I8");
  return (type == T_Q5_K || type == T_Q6_K) && !(e && e[0] == '0');
}

bool k_i8_rows_fit(uint32_t type, int64_t cols, int64_t rows, size_t rb, const void* w) {
  if (!k_i8_type(type) || cols % 256 != 0 || rows <= 0) return false;
  return type == T_Q6_K ? rb % 2 == 0 && aligned4(w) : rb % 16 == 0 && aligned16(w);
}

// Rows a warp of gemv_k_i8_k for n tokens: 1 at one token; from 2 tokens DASLLAMA_CUDA_KI8_R (1, 2
// or 4; default 2; read at each launch, so ab_cuda.py can switch it). H100, batched steps of 4 / 16,
// R = 1 / 2 / 4: Q4_K_M 2,225 / 2,977, 2,496 / 4,200, 2,403 / 3,989; Q6_K 2,243 / 3,504, 2,501 /
// 4,373, 2,347 / 4,165.
int k_i8_rows(int n) {
  if (n <= 1) return 1;
  const char* e = std::getenv("DASLLAMA_CUDA_KI8_R");
  const int v = e && *e ? std::atoi(e) : 2;
  return v == 1 || v == 4 ? v : 2;
}

template <uint32_t T, int R>
void launch_k_i8_r(const GemvJob& p, dim3 grid, cudaStream_t st) {
  if (p.n <= 4) launch(gemv_k_i8_k<T, 4, R, 1>, grid, SW * 32, 0, st, p);
  else launch(gemv_k_i8_k<T, 16, R, 1>, grid, SW * 32, 0, st, p);
}
// Pairs a lane has in flight at one token: as many as the row gives it (a 2048-wide row is one a
// lane, an 8192-wide down projection four). H200, against the kernel as it was (nothing loaded
// before the wait, a pair at a time): Q4_K_M tg256 / B=4 1,066 / 2,519 -> 1,080 / 2,670, Q5_K
// 1,070 -> 1,104, Q6_K 989 -> 1,008 (capped at one pair a lane: the same within a percent).
int k_i8_pairs(int64_t cols) {
  const int64_t per = ceil_div(cols / 64, (int64_t)32);
  return per >= 4 ? 4 : per >= 2 ? 2 : 1;
}
template <uint32_t T>
void launch_k_i8(const GemvJob& p, int rw, dim3 grid, cudaStream_t st) {
  const int u = k_i8_pairs(p.cols);
  if (p.n == 1) {
    if (u == 4) launch(gemv_k_i8_k<T, 1, 1, 4>, grid, SW * 32, 0, st, p);
    else if (u == 2) launch(gemv_k_i8_k<T, 1, 1, 2>, grid, SW * 32, 0, st, p);
    else launch(gemv_k_i8_k<T, 1, 1, 1>, grid, SW * 32, 0, st, p);
  }
  else if (rw == 4) launch_k_i8_r<T, 4>(p, grid, st);
  else if (rw == 2) launch_k_i8_r<T, 2>(p, grid, st);
  else launch_k_i8_r<T, 1>(p, grid, st);
}

// The layouts gemv_staged launches (its switches below list exactly these).
bool staged_type(uint32_t t) {
  switch (t) {
    case T_F32: case T_F16: case T_BF16: case T_Q8_0: case T_Q4_0: case T_Q4_1: case T_Q5_0: case T_Q5_1:
    case T_Q4_K: case T_Q5_K: case T_Q6_K: case T_Q8_0S: case T_Q4_0S:
      return true;
  }
  return false;
}

bool gemv_staged_fits(const GemvJob& j) {
  if (j.n < 1 || j.n > kStagedMax || j.count < 1 || j.count > 3 || j.cols <= 0 || j.cols % 8 != 0 ||
      (!j.xq && !aligned16(j.x)) || (j.norm_w && !aligned16(j.norm_w)) ||
      !staged_type(j.type))
    return false;
  const bool is_float = j.type == T_F32 || j.type == T_F16 || j.type == T_BF16;
  if (j.xq && k_i8_type(j.type)) {  // gemv_k_i8_k
    for (int i = 0; i < j.count; ++i)
      if (!k_i8_rows_fit(j.type, j.cols, j.rows[i], j.rb[i], j.w[i])) return false;
    return !j.norm && j.n <= 16;
  }
  if (j.xq) return (j.type == T_Q8_0S || j.type == T_Q4_0S) && j.cols % 32 == 0 && !j.norm;
  if (j.type == T_Q8_0S || j.type == T_Q4_0S) return j.cols % 32 == 0;  // aligned by construction
  bool v16 = true;
  for (int i = 0; i < j.count; ++i) {
    if (j.rows[i] <= 0) return false;
    if (j.rb[i] % 16 != 0 || !aligned16(j.w[i])) v16 = false;
    if (j.rb[i] % 4 != 0 || !aligned4(j.w[i])) return false;
  }
  return v16 || !is_float;
}

void gemv_staged(GemvJob j, cudaStream_t st) {
  if (!gemv_staged_fits(j)) throw Error("cuda: a matmul the staged GEMV does not take");
  bool v16 = true;
  for (int i = 0; i < j.count; ++i)
    if (j.rb[i] % 16 != 0 || !aligned16(j.w[i])) v16 = false;
  const bool direct = is_direct(j.type) && v16;
  const int n = j.n;
  for (int t0 = 0; t0 < n; t0 += 16) {
    GemvJob p = j;
    p.n = std::min(16, n - t0);
    p.x = j.x ? j.x + t0 * j.cols : nullptr;
    if (j.xq) p.xq = j.xq + t0 * j.cols, p.xd = j.xd + t0 * (j.cols / 32), p.xs = j.xs + t0 * (j.cols / 32);
    for (int i = 0; i < j.count; ++i) p.y[i] = j.y[i] + t0 * j.rows[i];
    if (j.xq && k_i8_type(j.type)) {
      const int rw = k_i8_rows(p.n);
      int64_t b = 0;
      for (int i = 0; i < j.count; ++i) p.first_block[i] = b, b += ceil_div(j.rows[i], (int64_t)SW * rw);
      p.first_block[j.count] = b;
      const dim3 grid((unsigned)b);
      switch (j.type) {
        case T_Q4_K: launch_k_i8<T_Q4_K>(p, rw, grid, st); break;
        case T_Q5_K: launch_k_i8<T_Q5_K>(p, rw, grid, st); break;
        default: launch_k_i8<T_Q6_K>(p, rw, grid, st); break;
      }
      continue;
    }
    const int ks = direct ? direct_ks(j.cols / unit_elems(j.type)) : 1;
    const int64_t per_block = direct ? SW / ks * direct_rows(p.n, j.xq != nullptr) : SW;
    int64_t b = 0;
    for (int i = 0; i < j.count; ++i) p.first_block[i] = b, b += ceil_div(j.rows[i], per_block);
    p.first_block[j.count] = b;
    if (j.xn && !(direct && j.xq && gemv_xn_fits(p))) throw Error("cuda: an input left unnormed for a GEMV that cannot norm it");
    if (direct && j.xq) {
      if (j.type == T_Q8_0S) launch_q8<T_Q8_0S>(p, ks, st);
      else launch_q8<T_Q4_0S>(p, ks, st);
      continue;
    }
    if (direct) {
      switch (j.type) {
        case T_F16: launch_direct<T_F16>(p, ks, st); break;
        case T_BF16: launch_direct<T_BF16>(p, ks, st); break;
        case T_Q8_0S: launch_direct<T_Q8_0S>(p, ks, st); break;
        case T_Q4_0S: launch_direct<T_Q4_0S>(p, ks, st); break;
        default: break;
      }
      continue;
    }
    switch (j.type) {
      case T_F32: launch_staged<T_F32, 16>(p, st); break;
      case T_F16: launch_staged<T_F16, 16>(p, st); break;
      case T_BF16: launch_staged<T_BF16, 16>(p, st); break;
#define DL_CASE(T) \
  case T: v16 ? launch_staged<T, 16>(p, st) : launch_staged<T, 4>(p, st); break;
      DL_CASE(T_Q8_0) DL_CASE(T_Q4_0) DL_CASE(T_Q4_1) DL_CASE(T_Q5_0) DL_CASE(T_Q5_1) DL_CASE(T_Q4_K)
      DL_CASE(T_Q5_K) DL_CASE(T_Q6_K)
#undef DL_CASE
      default: throw Error("cuda: the staged GEMV has no kernel for layout " + std::to_string(j.type));
    }
  }
  check_launch("matmul (staged)");
}

// The largest cluster a cluster tail takes (DASLLAMA_CUDA_CLUSTER_MAX, 2-16, default 4; 16 is
// sm_90's non-portable size; read at each call): on the H100, Llama-1B's tails on 8- and 16-block
// clusters lost 3-4% to the launches they replace, those on 2-4 blocks did not (RESULTS.md,
// forty-eighth session; measured before the xn GEMVs' norm went from double to float).
int cluster_max() {
  const char* e = std::getenv("DASLLAMA_CUDA_CLUSTER_MAX");
  return e && *e ? std::max(2, std::min(16, std::atoi(e))) : 4;
}

bool gemv_tail_fits(const GemvJob& j, const GemvTail& t) {
  if (j.n != 1 || !j.xq || (j.type != T_Q8_0S && j.type != T_Q4_0S) || !gemv_staged_fits(j) ||
      (!t.cnt && t.kind != GemvTail::rms && t.kind != GemvTail::glu_cluster) || !t.q ||
      t.cols <= 0 || t.cols % 32 != 0)
    return false;
  for (int i = 0; i < j.count; ++i)
    if (j.rb[i] % 16 != 0 || !aligned16(j.w[i])) return false;
  if (t.kind == GemvTail::round) return j.count == 1 && t.x;
  // Each block's rows lie inside one 32-row chunk (direct_rows(1) rows a group, 8 / ks groups).
  const int64_t per_block = SW / direct_ks(j.cols / unit_elems(j.type)) * direct_rows(1, true);
  if (t.kind == GemvTail::rms)  // a chunk's blocks as one portable cluster (sm_90), its kernel's 2 rows a group
    return cc_major() >= 9 && direct_rows(1, true) == 2 && 32 % per_block == 0 && 32 / per_block <= cluster_max() &&
           j.count == 1 && j.accumulate && j.rows[0] == t.cols && t.x == j.y[0] && t.xn && !j.xn;
  if (t.kind == GemvTail::glu_cluster)  // a chunk of gate and of up as one portable cluster
    return cc_major() >= 9 && direct_rows(1, true) == 2 && 32 % per_block == 0 && 2 * (32 / per_block) <= cluster_max() &&
           j.count == 2 && j.rows[0] == j.rows[1] && j.rows[0] == t.cols && !j.accumulate && t.out &&
           (!j.xn || gemv_xn_fits(j));
  if (t.kind != GemvTail::glu) return false;
  return j.count == 2 && j.rows[0] == j.rows[1] && j.rows[0] == t.cols && 32 % per_block == 0 && t.out &&
         t.cols / 32 <= kTailCounters;
}

bool gemv_direct_glu_fits(const GemvJob& j, const GemvTail& t) {
  if (t.kind != GemvTail::glu_cluster || !t.out || cc_major() < 9 || j.n != 1 || j.xq || j.count != 2 ||
      (j.type != T_F16 && j.type != T_BF16) || j.accumulate || !gemv_staged_fits(j) || rows1(false) != 4 ||
      j.rows[0] != j.rows[1] || j.rows[0] != t.cols || t.cols % 32 != 0)
    return false;
  for (int i = 0; i < 2; ++i)
    if (j.rb[i] % 16 != 0 || !aligned16(j.w[i])) return false;
  const int64_t per_block = SW / direct_ks(j.cols / unit_elems(j.type)) * 4;
  return 32 % per_block == 0 && 2 * (32 / per_block) <= cluster_max();
}

void gemv_direct_tailed(GemvJob j, const GemvTail& t, cudaStream_t st) {
  if (!gemv_direct_glu_fits(j, t)) throw Error("cuda: a GEMV GLU tail the kernel does not take");
  const int ks = direct_ks(j.cols / unit_elems(j.type));
  const int64_t per_block = SW / ks * 4;
  j.first_block[0] = 0, j.first_block[1] = j.rows[0] / per_block, j.first_block[2] = 2 * (j.rows[0] / per_block);
  gemv_fits(j, ks);
  const dim3 cl((unsigned)(2 * (32 / per_block)), 1, 1);
  const unsigned grid = (unsigned)j.first_block[2];
  if (j.type == T_F16) launch_cluster(gemv_direct_gluc_k<T_F16>, grid, SW * 32, 0, st, cl, j, ks, pdl_early(), t);
  else launch_cluster(gemv_direct_gluc_k<T_BF16>, grid, SW * 32, 0, st, cl, j, ks, pdl_early(), t);
  check_launch("matmul (direct, GLU tail)");
}

bool gemv_xn_fits(const GemvJob& j) {
  if (j.n != 1 || (j.type != T_Q8_0S && j.type != T_Q4_0S) || rows1(true) != 2 || j.count < 1 || j.count > 3)
    return false;
  for (int i = 0; i < j.count; ++i)
    if (j.rb[i] % 16 != 0 || !aligned16(j.w[i])) return false;
  return true;
}

void gemv_tailed(GemvJob j, const GemvTail& t, cudaStream_t st) {
  if (!gemv_tail_fits(j, t)) throw Error("cuda: a GEMV tail the kernel does not take");
  const int ks = gemv_q8_plan(j, direct_rows(1, true));
  if (j.type == T_Q8_0S) launch_q8<T_Q8_0S>(j, ks, st, t);
  else launch_q8<T_Q4_0S>(j, ks, st, t);
  check_launch("matmul (tailed)");
}

bool gemv_rope_fits(const GemvJob& j, const GemvRope& r) {
  if (j.n < 1 || j.n > 4 || j.count != 3 || j.accumulate || !is_direct(j.type) || !gemv_staged_fits(j)) return false;
  if (j.xq && j.type != T_Q8_0S && j.type != T_Q4_0S) return false;
  for (int i = 0; i < 3; ++i)
    if (j.rb[i] % 16 != 0 || !aligned16(j.w[i]) || j.rows[i] % 2 != 0) return false;
  const int hd = r.head_dim;
  return !r.p.neox && hd > 0 && hd % 2 == 0 && r.p.n_rot % 2 == 0 && r.p.n_rot <= hd && j.rows[0] % hd == 0 &&
         j.rows[1] % hd == 0 && j.rows[1] == j.rows[2] && r.pos && r.d && r.count > 0 && r.x2 == j.y[1] &&
         r.stride2 == j.rows[1];
}

void gemv_roped(GemvJob j, const GemvRope& r0, cudaStream_t st) {
  if (!gemv_rope_fits(j, r0)) throw Error("cuda: a Q / K / V GEMV the rope epilogue does not take");
  // The angles at the block's start (RopeOut): for one token of q8_0 weights by default. H100
  // Llama-1B tg256, four interleaved runs (RESULTS.md, forty-sixth session): Q8_0 +1.1-1.6%
  // (the Q / K / V kernel's own share 3.72 -> 3.36 us), Q4_0 -0.2 to -0.5%.
  // DASLLAMA_CUDA_ROPE_EARLY=0 / 1 sets it for both (read at each call, so ab_cuda.py can).
  GemvRope r = r0;
  const char* e = std::getenv("DASLLAMA_CUDA_ROPE_EARLY");
  r.early_cs = e && *e ? std::strcmp(e, "0") != 0 : j.type == T_Q8_0S;
  const int ks = direct_ks(j.cols / unit_elems(j.type));
  const int64_t per_block = SW / ks * direct_rows(j.n, j.xq != nullptr);
  int64_t b = 0;
  for (int i = 0; i < j.count; ++i) j.first_block[i] = b, b += ceil_div(j.rows[i], per_block);
  j.first_block[j.count] = b;
  switch (j.type) {
    case T_F16: launch_roped<T_F16>(j, ks, r, st); break;
    case T_BF16: launch_roped<T_BF16>(j, ks, r, st); break;
    case T_Q8_0S: launch_roped<T_Q8_0S>(j, ks, r, st); break;
    default: launch_roped<T_Q4_0S>(j, ks, r, st); break;
  }
  check_launch("matmul (roped)");
}

void matmul(const Mat& m, const float* x, int64_t n, float* y, cudaStream_t st) {
  if (n <= 0 || m.rows <= 0) return;
  switch (m.type) {
#define DL_CASE(T) \
  case T: run_matmul<T>(m, x, n, y, st); break;
    DL_CUDA_LAYOUTS(DL_CASE)
#undef DL_CASE
    default: throw UnsupportedModelError("cuda: no matmul kernel for weight type id " + std::to_string(m.type));
  }
  check_launch("matmul");
}

void matmul_id(const Mat& m, int64_t R, const float* x, int64_t x_div, const int32_t* ids, int64_t n_pairs,
               const float* bias, float* y, cudaStream_t st) {
  if (n_pairs <= 0 || R <= 0) return;
  const bool wvec = m.cols % 8 == 0 && m.row_bytes % 16 == 0 && aligned16(m.w);
  const bool xvec = m.cols % 8 == 0 && aligned16(x);
  const int64_t n_expert = m.rows / R;
  if (n_pairs > 64 && n_pairs <= kIdMaxPairs && n_expert <= 65535) {
    const dim3 grid((unsigned)ceil_div(R, 4), (unsigned)n_expert);
    switch (m.type) {
#define DL_CASE(T)                                                                                                \
  case T:                                                                                                         \
    launch(gemv_id_grouped_k<T>, grid, 128, 0, st, m.w, m.row_bytes, R, m.cols, x, x_div, ids, n_pairs, bias, y, wvec, \
                                               xvec);                                                             \
    break;
      DL_CUDA_TYPES(DL_CASE)
#undef DL_CASE
      default: throw UnsupportedModelError("cuda: no matmul_id kernel for weight type id " + std::to_string(m.type));
    }
    check_launch("matmul_id");
    return;
  }
  for (int64_t p0 = 0; p0 < n_pairs; p0 += 65535) {
    const dim3 grid((unsigned)ceil_div(R, 4), (unsigned)std::min<int64_t>(65535, n_pairs - p0));
    switch (m.type) {
#define DL_CASE(T)                                                                                              \
  case T:                                                                                                       \
    launch(gemv_id_k<T>, grid, 128, 0, st, m.w, m.row_bytes, R, m.cols, x, x_div, ids, p0, bias, y, wvec, xvec); \
    break;
      DL_CUDA_TYPES(DL_CASE)
#undef DL_CASE
      default: throw UnsupportedModelError("cuda: no matmul_id kernel for weight type id " + std::to_string(m.type));
    }
  }
  check_launch("matmul_id");
}

void get_rows(const Mat& m, const int32_t* ids, int64_t n, float* out, cudaStream_t st) {
  if (n <= 0) return;
  const bool wvec = m.cols % 8 == 0 && m.row_bytes % 16 == 0 && ((uintptr_t)m.w & 15) == 0;
  switch (m.type) {
#define DL_CASE(T) \
  case T: launch(get_rows_k<T>, (unsigned)n, 128, 0, st, m.w, m.row_bytes, m.cols, ids, out, wvec); break;
    DL_CUDA_LAYOUTS(DL_CASE)
#undef DL_CASE
    default: throw UnsupportedModelError("cuda: no get_rows kernel for weight type id " + std::to_string(m.type));
  }
  check_launch("get_rows");
}

}  // namespace dl::cuda
