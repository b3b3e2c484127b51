// Matmul and embedding lookup over ggml-format weights: a warp-per-row GEMV for
// decode (n <= 8; 16 tokens a pass up to 64) and a 64x64 shared-memory tiled f32 kernel for prefill;
// matmul_id over stacks of experts (a warp per row and pair for decode, pairs gathered per expert
// for prefill).
#include <algorithm>
#include <string>

#include "common.cuh"
#include "dequant.cuh"
#include "kernels.h"

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

// One block per id, threads over 8-element groups.
template <uint32_t T>
__global__ void get_rows_k(const uint8_t* __restrict__ W, size_t rb, int64_t cols, const int32_t* __restrict__ ids,
                           float* __restrict__ out, bool wvec) {
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

template <uint32_t T>
void run_matmul(const Mat& m, const float* x, int64_t n, float* y, cudaStream_t st) {
  const bool wvec = m.cols % 8 == 0 && m.row_bytes % 16 == 0 && aligned16(m.w);
  const bool xvec = m.cols % 8 == 0 && aligned16(x);
  if (n <= 8) {
    const dim3 grid((unsigned)ceil_div(m.rows, 4));
    const int nn = (int)n;
    if (n == 1)
      gemv_k<T, 1><<<grid, 128, 0, st>>>(m.w, m.row_bytes, m.rows, m.cols, x, nn, y, wvec, xvec);
    else if (n == 2)
      gemv_k<T, 2><<<grid, 128, 0, st>>>(m.w, m.row_bytes, m.rows, m.cols, x, nn, y, wvec, xvec);
    else if (n <= 4)
      gemv_k<T, 4><<<grid, 128, 0, st>>>(m.w, m.row_bytes, m.rows, m.cols, x, nn, y, wvec, xvec);
    else
      gemv_k<T, 8><<<grid, 128, 0, st>>>(m.w, m.row_bytes, m.rows, m.cols, x, nn, y, wvec, xvec);
  } else if (n <= 64) {
    // Batched decode: the GEMV over 16 tokens at a time reads W once per 16 rows of x,
    // where the 64x64 tile would do 64-wide f32 work per block for a few real tokens.
    const dim3 grid((unsigned)ceil_div(m.rows, 4));
    for (int64_t t0 = 0; t0 < n; t0 += 16) {
      const float* xc = x + t0 * m.cols;
      const bool xv = m.cols % 8 == 0 && aligned16(xc);
      gemv_k<T, 16><<<grid, 128, 0, st>>>(m.w, m.row_bytes, m.rows, m.cols, xc, (int)std::min<int64_t>(16, n - t0),
                                         y + t0 * m.rows, wvec, xv);
    }
  } else {
    const dim3 grid((unsigned)ceil_div(m.rows, BM), (unsigned)ceil_div(n, BN));
    gemm_k<T><<<grid, 256, 0, st>>>(m.w, m.row_bytes, m.rows, m.cols, x, n, y, wvec, xvec);
  }
}

}  // namespace

bool matmul_type_ok(uint32_t type) { return served_type(type); }

void matmul(const Mat& m, const float* x, int64_t n, float* y, cudaStream_t st) {
  if (n <= 0 || m.rows <= 0) return;
  switch (m.type) {
#define DL_CASE(T) \
  case T: run_matmul<T>(m, x, n, y, st); break;
    DL_CUDA_TYPES(DL_CASE)
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
    gemv_id_grouped_k<T><<<grid, 128, 0, st>>>(m.w, m.row_bytes, R, m.cols, x, x_div, ids, n_pairs, bias, y, wvec, \
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
    gemv_id_k<T><<<grid, 128, 0, st>>>(m.w, m.row_bytes, R, m.cols, x, x_div, ids, p0, bias, y, wvec, xvec); \
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
  case T: get_rows_k<T><<<(unsigned)n, 128, 0, st>>>(m.w, m.row_bytes, m.cols, ids, out, wvec); break;
    DL_CUDA_TYPES(DL_CASE)
#undef DL_CASE
    default: throw UnsupportedModelError("cuda: no get_rows kernel for weight type id " + std::to_string(m.type));
  }
  check_launch("get_rows");
}

}  // namespace dl::cuda
