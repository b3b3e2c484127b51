// Row and elementwise ops of the CUDA backend: norms (double accumulation, as the CPU),
// RoPE (angles in double), GLU, adds and scales, and the audio towers' im2col / pooling.
#include <algorithm>
#include <atomic>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>

#include "act.cuh"
#include "common.cuh"
#include "kernels.h"
#include "rope.cuh"

namespace dl::cuda {
namespace {

constexpr int TPB = 256;

unsigned grid_for(int64_t n) { return (unsigned)std::min<int64_t>(ceil_div(n, TPB), 65535 * 8); }

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets it.
__device__ double block_sum(double v) {
  __shared__ double sh[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  v = warp_sum_d(v);
  __syncthreads();  // sh may still be read from a previous call
  if (lane == 0) sh[warp] = v;
  __syncthreads();
  double s = 0;
  for (int w = 0; w < nw; ++w) s += sh[w];
  return s;
}

__global__ void rms_norm_k(const float* x, const float* __restrict__ w, float* y, int64_t dim, float eps) {
  pdl_wait();
  pdl_trigger();
  const float* xr = x + blockIdx.x * dim;
  float* yr = y + blockIdx.x * dim;
  double ss = 0;
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) ss += (double)xr[i] * xr[i];
  ss = block_sum(ss);
  const float s = (float)(1.0 / sqrt(ss / dim + eps));
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) yr[i] = w ? __fmul_rn(xr[i], s) * w[i] : xr[i] * s;
}

__global__ void layer_norm_k(const float* x, const float* __restrict__ w, const float* __restrict__ b, float* y,
                             int64_t dim, float eps) {
  pdl_wait();
  pdl_trigger();
  const float* xr = x + blockIdx.x * dim;
  float* yr = y + blockIdx.x * dim;
  double mean = 0;
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) mean += xr[i];
  mean = block_sum(mean) / dim;
  double var = 0;
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) {
    const double d = (double)xr[i] - mean;
    var += d * d;
  }
  var = block_sum(var);
  const double inv = 1.0 / sqrt(var / dim + eps);
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) {
    float v = (float)(((double)xr[i] - mean) * inv);
    if (w) v = __fmul_rn(v, w[i]);
    if (b) v += b[i];
    yr[i] = v;
  }
}

// One block per token (rope_token). A second tensor at the same positions (K beside Q) rides
// along.
__global__ void rope_tok_k(float* x, int64_t stride, int n_heads, float* x2, int64_t stride2, int n_heads2,
                           int head_dim, const int32_t* pos, RopeParams p) {
  pdl_wait();
  pdl_trigger();
  __shared__ float cs[2][kRopeMaxHalf];
  rope_token(x, stride, n_heads, x2, stride2, n_heads2, head_dim, blockIdx.x, pos, p, cs);
}
// Any rotary width: a thread per (token, pair), walking the heads.
__global__ void rope_any_k(float* x, int64_t n_tok, int64_t stride, int n_heads, int head_dim, const int32_t* pos,
                           RopeParams p) {
  pdl_wait();
  pdl_trigger();
  const int half = p.n_rot / 2;
  const int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= n_tok * half) return;
  const int64_t t = idx / half;
  const int i = (int)(idx % half);
  float c, s;
  rope_cs(p, pos[t], i, &c, &s);
  for (int h = 0; h < n_heads; ++h) rope_pair(x + t * stride + (int64_t)h * head_dim, i, half, p.neox, c, s);
}

__global__ void glu_k(const float* gate, int64_t gs, const float* up, int64_t us, float* out, int64_t n_rows,
                      int64_t dim, int act) {
  pdl_wait();
  pdl_trigger();
  for (int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; idx < n_rows * dim;
       idx += (int64_t)gridDim.x * blockDim.x) {
    const int64_t r = idx / dim, i = idx % dim;
    out[idx] = glu_value(act, gate[r * gs + i], up[r * us + i]);
  }
}

#define DL_GRID_LOOP(n) \
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (int64_t)gridDim.x * blockDim.x)

__global__ void add_k(float* y, const float* x, int64_t n) {
  pdl_wait();
  pdl_trigger();
  DL_GRID_LOOP(n) y[i] += x[i];
}
__global__ void add_bias_k(float* y, const float* b, int64_t n_rows, int64_t dim) {
  pdl_wait();
  pdl_trigger();
  DL_GRID_LOOP(n_rows * dim) y[i] += b[i % dim];
}
__global__ void scale_k(float* y, float s, int64_t n) {
  pdl_wait();
  pdl_trigger();
  DL_GRID_LOOP(n) y[i] *= s;
}
__global__ void softcap_k(float* y, float cap, int64_t n) {
  pdl_wait();
  pdl_trigger();
  DL_GRID_LOOP(n) y[i] = cap * tanhf(y[i] / cap);
}
__global__ void gelu_erf_k(float* y, int64_t n) {
  pdl_wait();
  pdl_trigger();
  DL_GRID_LOOP(n) y[i] = 0.5f * y[i] * (1.f + erff(y[i] * 0.70710678118654752f));
}
__global__ void copy_rows_k(float* dst, int64_t ds, const float* src, int64_t ss, int64_t rows, int64_t width) {
  pdl_wait();
  pdl_trigger();
  DL_GRID_LOOP(rows * width) {
    const int64_t r = i / width, c = i % width;
    dst[r * ds + c] = src[r * ss + c];
  }
}
// out[t][c*k + j] = x(c, t*stride + j - pad), 0 outside [0, T); rows_layout: x is [T][C], else [C][x_stride].
__global__ void im2col_k(const float* x, int64_t x_stride, int64_t C, int64_t T, int k, int stride, int pad,
                         float* out, int64_t T_out, bool rows_layout) {
  pdl_wait();
  pdl_trigger();
  const int64_t w = C * k;
  DL_GRID_LOOP(T_out * w) {
    const int64_t t = i / w, ck = i % w, c = ck / k;
    const int j = (int)(ck % k);
    const int64_t s = t * stride + j - pad;
    out[i] = s < 0 || s >= T ? 0.f : (rows_layout ? x[s * C + c] : x[c * x_stride + s]);
  }
}
__global__ void im2col_2d_k(const float* x, int64_t C, int64_t H, int64_t W, int64_t sc, int64_t sh, int64_t sw,
                            int kh, int kw, int stride, int pad, float* out, int64_t W_out, int64_t n) {
  const int64_t width = C * kh * kw;
  DL_GRID_LOOP(n) {
    const int64_t p = i / width, q = i % width;
    const int64_t c = q / (kh * kw);
    const int r = (int)(q % (kh * kw)), ki = r / kw, kj = r % kw;
    const int64_t h = p / W_out * stride - pad + ki, w = p % W_out * stride - pad + kj;
    out[i] = h >= 0 && h < H && w >= 0 && w < W ? x[c * sc + h * sh + w * sw] : 0.f;
  }
}
__global__ void avg_pool_k(const float* x, int64_t n_rows, int64_t dim, int k, float* out, int64_t n_out) {
  pdl_wait();
  pdl_trigger();
  DL_GRID_LOOP(n_out * dim) {
    const int64_t r = i / dim, d = i % dim;
    const int64_t r0 = r * k, r1 = min(n_rows, r0 + k);
    float s = 0.f;
    for (int64_t j = r0; j < r1; ++j) s += x[j * dim + d];
    out[i] = s / (float)(r1 - r0);
  }
}

}  // namespace

void rms_norm(const float* x, const float* w, float* y, int64_t n_rows, int64_t dim, float eps, cudaStream_t st) {
  if (n_rows <= 0) return;
  launch(rms_norm_k, (unsigned)n_rows, TPB, 0, st, x, w, y, dim, eps);
  check_launch("rms_norm");
}
void layer_norm(const float* x, const float* w, const float* b, float* y, int64_t n_rows, int64_t dim, float eps,
                cudaStream_t st) {
  if (n_rows <= 0) return;
  launch(layer_norm_k, (unsigned)n_rows, TPB, 0, st, x, w, b, y, dim, eps);
  check_launch("layer_norm");
}
void rope(float* x, int64_t n_tok, int64_t stride, int n_heads, int head_dim, const int32_t* pos, const RopeParams& p,
          cudaStream_t st) {
  const int64_t n = n_tok * (p.n_rot / 2);
  if (n <= 0) return;
  if (p.n_rot > head_dim) throw Error("cuda rope: n_rot " + std::to_string(p.n_rot) + " > head_dim");
  if (p.n_rot / 2 <= kRopeMaxHalf)
    launch(rope_tok_k, (unsigned)n_tok, 256, 0, st, x, stride, n_heads, (float*)nullptr, (int64_t)0, 0, head_dim, pos,
           p);
  else
    launch(rope_any_k, (unsigned)ceil_div(n, 128), 128, 0, st, x, n_tok, stride, n_heads, head_dim, pos, p);
  check_launch("rope");
}
void rope2(float* x, int64_t stride, int n_heads, float* x2, int64_t stride2, int n_heads2, int64_t n_tok,
           int head_dim, const int32_t* pos, const RopeParams& p, cudaStream_t st) {
  if (p.n_rot / 2 > kRopeMaxHalf) {
    rope(x, n_tok, stride, n_heads, head_dim, pos, p, st);
    return rope(x2, n_tok, stride2, n_heads2, head_dim, pos, p, st);
  }
  if (n_tok * (p.n_rot / 2) <= 0) return;
  if (p.n_rot > head_dim) throw Error("cuda rope: n_rot " + std::to_string(p.n_rot) + " > head_dim");
  launch(rope_tok_k, (unsigned)n_tok, 256, 0, st, x, stride, n_heads, x2, stride2, n_heads2, head_dim, pos, p);
  check_launch("rope");
}
void glu(const float* gate, int64_t gs, const float* up, int64_t us, float* out, int64_t n_rows, int64_t dim, Act act,
         cudaStream_t st) {
  if (n_rows * dim <= 0) return;
  launch(glu_k, grid_for(n_rows * dim), TPB, 0, st, gate, gs, up, us, out, n_rows, dim, act_code(act));
  check_launch("glu");
}
void add(float* y, const float* x, int64_t n, cudaStream_t st) {
  if (n <= 0) return;
  launch(add_k, grid_for(n), TPB, 0, st, y, x, n);
  check_launch("add");
}
void add_bias(float* y, const float* b, int64_t n_rows, int64_t dim, cudaStream_t st) {
  if (n_rows * dim <= 0) return;
  launch(add_bias_k, grid_for(n_rows * dim), TPB, 0, st, y, b, n_rows, dim);
  check_launch("add_bias");
}
void scale(float* y, float s, int64_t n, cudaStream_t st) {
  if (n <= 0) return;
  launch(scale_k, grid_for(n), TPB, 0, st, y, s, n);
  check_launch("scale");
}
void softcap(float* y, float cap, int64_t n, cudaStream_t st) {
  if (n <= 0) return;
  launch(softcap_k, grid_for(n), TPB, 0, st, y, cap, n);
  check_launch("softcap");
}
void gelu_erf(float* y, int64_t n, cudaStream_t st) {
  if (n <= 0) return;
  launch(gelu_erf_k, grid_for(n), TPB, 0, st, y, n);
  check_launch("gelu_erf");
}
void copy_rows(float* dst, int64_t ds, const float* src, int64_t ss, int64_t rows, int64_t width, cudaStream_t st) {
  if (rows * width <= 0) return;
  launch(copy_rows_k, grid_for(rows * width), TPB, 0, st, dst, ds, src, ss, rows, width);
  check_launch("copy_rows");
}
void im2col_1d(const float* x, int64_t x_stride, int64_t C, int64_t T, int k, int stride, int pad, float* out,
               int64_t T_out, cudaStream_t st) {
  if (T_out * C * k <= 0) return;
  launch(im2col_k, grid_for(T_out * C * k), TPB, 0, st, x, x_stride, C, T, k, stride, pad, out, T_out, false);
  check_launch("im2col_1d");
}
void im2col_rows(const float* x, int64_t C, int64_t T, int k, int stride, int pad, float* out, int64_t T_out,
                 cudaStream_t st) {
  if (T_out * C * k <= 0) return;
  launch(im2col_k, grid_for(T_out * C * k), TPB, 0, st, x, C, C, T, k, stride, pad, out, T_out, true);
  check_launch("im2col_rows");
}
void im2col_2d(const float* x, int64_t C, int64_t H, int64_t W, int64_t sc, int64_t sh, int64_t sw, int kh, int kw,
               int stride, int pad, float* out, int64_t H_out, int64_t W_out, cudaStream_t st) {
  const int64_t n = H_out * W_out * C * kh * kw;
  if (n <= 0) return;
  im2col_2d_k<<<grid_for(n), TPB, 0, st>>>(x, C, H, W, sc, sh, sw, kh, kw, stride, pad, out, W_out, n);
  check_launch("im2col_2d");
}
void avg_pool_rows(const float* x, int64_t n_rows, int64_t dim, int k, float* out, cudaStream_t st) {
  if (n_rows <= 0 || dim <= 0) return;
  if (k <= 0) throw Error("cuda avg_pool_rows: k must be positive");
  const int64_t n_out = ceil_div(n_rows, k);
  launch(avg_pool_k, grid_for(n_out * dim), TPB, 0, st, x, n_rows, dim, k, out, n_out);
  check_launch("avg_pool_rows");
}

// One thread per token: the CPU's moe_route_row step for step (expf, f32).
__global__ void moe_route_k(const float* __restrict__ lg, int64_t n, int E, int k, int gate, bool norm,
                            int32_t* __restrict__ ids, float* __restrict__ w) {
  pdl_wait();
  pdl_trigger();
  const int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= n) return;
  const float* l = lg + t * E;
  int32_t* id = ids + t * k;
  float* wt = w + t * k;
  for (int j = 0; j < k; ++j) {
    int best = -1;
    for (int e = 0; e < E; ++e) {
      bool taken = false;
      for (int i = 0; i < j; ++i) taken |= id[i] == e;
      if (!taken && (best < 0 || l[e] > l[best])) best = e;
    }
    id[j] = best;
  }
  if (gate == 1) {
    for (int j = 0; j < k; ++j) wt[j] = 1.f / (1.f + expf(-l[id[j]]));
  } else {
    float mx = l[id[0]], sum = 0.f;
    if (gate == 0) {
      for (int e = 0; e < E; ++e) mx = fmaxf(mx, l[e]);
      for (int e = 0; e < E; ++e) sum += expf(l[e] - mx);
    } else {
      for (int j = 0; j < k; ++j) sum += expf(l[id[j]] - mx);
    }
    for (int j = 0; j < k; ++j) wt[j] = expf(l[id[j]] - mx) / sum;
  }
  if (norm) {
    float sum = 0.f;
    for (int j = 0; j < k; ++j) sum += wt[j];
    for (int j = 0; j < k; ++j) wt[j] /= sum;
  }
}

__global__ void moe_sum_k(const float* __restrict__ y, const float* __restrict__ w, int64_t n, int k, int64_t dim,
                          float* __restrict__ out) {
  pdl_wait();
  pdl_trigger();
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n * dim; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t t = i / dim, d = i % dim;
    float acc = 0.f;
    for (int j = 0; j < k; ++j) acc += w[t * k + j] * y[(t * k + j) * dim + d];
    out[i] = acc;
  }
}

void moe_route(const float* logits, int64_t n, int n_expert, int k, int gate, bool norm, int32_t* ids, float* w,
               cudaStream_t st) {
  if (n <= 0) return;
  if (k < 1 || k > n_expert) throw Error("cuda moe_route: k must be in [1, n_expert]");
  launch(moe_route_k, (unsigned)ceil_div(n, 64), 64, 0, st, logits, n, n_expert, k, gate, norm, ids, w);
  check_launch("moe_route");
}

// Each row split over S blocks (gridDim.x; a row's blocks adjacent): each thread keeps its first
// largest over a strided walk of its block's range, 8 loads in flight a round, then the block
// joins them, the smaller index winning ties (so the first index overall, in any join order).
// v > b never holds for a NaN; a -inf row keeps its first -inf through i < bi. With S > 1 each
// block leaves its (value, index) in part[row][s], and the row's last block to finish (counted
// in cnt[row], left at 0 again) joins the S of them: a one-block row walked 125 dependent loads
// a thread (~40-70 us on an H100 for a 128K vocabulary; the greedy step's whole head is ~100).
__device__ __forceinline__ void argmax_join(float& b, int& bi, float v, int i) {
  if (v > b || (v == b && i < bi)) b = v, bi = i;
}
__device__ __forceinline__ void argmax_block(float& b, int& bi) {
  for (int o = 16; o > 0; o >>= 1)
    argmax_join(b, bi, __shfl_xor_sync(0xffffffffu, b, o), __shfl_xor_sync(0xffffffffu, bi, o));
  __shared__ float sb[32];
  __shared__ int si[32];
  const int w = threadIdx.x >> 5, nw = blockDim.x >> 5;
  if ((threadIdx.x & 31) == 0) sb[w] = b, si[w] = bi;
  __syncthreads();
  b = (int)threadIdx.x < nw ? sb[threadIdx.x] : -INFINITY;
  bi = (int)threadIdx.x < nw ? si[threadIdx.x] : INT_MAX;
  if (w == 0)
    for (int o = 16; o > 0; o >>= 1)
      argmax_join(b, bi, __shfl_xor_sync(0xffffffffu, b, o), __shfl_xor_sync(0xffffffffu, bi, o));
}
constexpr int kArgmaxThreads = 256, kArgmaxUnroll = 8;
__global__ void __launch_bounds__(kArgmaxThreads) argmax_k(const float* __restrict__ x, int64_t dim,
                                                          int32_t* __restrict__ out, float* __restrict__ part_v,
                                                          int* __restrict__ part_i, int* __restrict__ cnt) {
  pdl_wait();
  pdl_trigger();
  const int S = gridDim.x, s = blockIdx.x;
  const int64_t row = blockIdx.y;
  const float* r = x + row * dim;
  const int64_t chunk = (dim + S - 1) / S, lo = s * chunk, hi = min(dim, lo + chunk);
  float b = -INFINITY;
  int bi = INT_MAX;
  constexpr int step = kArgmaxThreads * kArgmaxUnroll;
  for (int64_t i0 = lo + threadIdx.x; i0 < hi; i0 += step) {
    float v[kArgmaxUnroll];
#pragma unroll
    for (int u = 0; u < kArgmaxUnroll; ++u) {
      const int64_t i = i0 + (int64_t)u * kArgmaxThreads;
      v[u] = i < hi ? __ldg(r + i) : -INFINITY;
    }
#pragma unroll
    for (int u = 0; u < kArgmaxUnroll; ++u) {
      const int64_t i = i0 + (int64_t)u * kArgmaxThreads;
      if (i < hi) argmax_join(b, bi, v[u], (int)i);
    }
  }
  argmax_block(b, bi);
  if (S == 1) {
    if (threadIdx.x == 0) out[row] = bi == INT_MAX ? 0 : bi;
    return;
  }
  __shared__ bool last;
  if (threadIdx.x == 0) {
    part_v[row * S + s] = b, part_i[row * S + s] = bi;
    __threadfence();  // the partial is visible before it is counted
    last = atomicAdd(cnt + row, 1) == S - 1;
    if (last) cnt[row] = 0;
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  b = -INFINITY, bi = INT_MAX;
  for (int k = threadIdx.x; k < S; k += blockDim.x) argmax_join(b, bi, __ldcg(part_v + row * S + k), __ldcg(part_i + row * S + k));
  argmax_block(b, bi);
  if (threadIdx.x == 0) out[row] = bi == INT_MAX ? 0 : bi;
}

int argmax_splits(int64_t n_rows, int64_t dim, int n_sm) {
  const char* e = std::getenv("DASLLAMA_ARGMAX_SPLIT");  // 0: a block a row (A/B runs)
  if (e && e[0] == '0') return 1;
  // About two blocks an SM over all rows, each block 2K values at least, within kArgmaxParts.
  int64_t S = std::min<int64_t>((2 * (int64_t)n_sm + n_rows - 1) / n_rows, (dim + 2047) / 2048);
  S = std::max<int64_t>(1, std::min<int64_t>(S, 64));
  while (S > 1 && (n_rows * S > kArgmaxParts || n_rows > kArgmaxRows)) --S;
  return (int)S;
}

void argmax(const float* x, int64_t n_rows, int64_t dim, int32_t* out, int splits, float* part_v, int* part_i,
            int* cnt, cudaStream_t st) {
  if (n_rows <= 0) return;
  if (dim <= 0 || dim > INT32_MAX || n_rows > INT32_MAX) throw Error("cuda argmax: rows past 2^31 or an empty row");
  if (splits > 1 && (!part_v || !part_i || !cnt || n_rows * splits > kArgmaxParts || n_rows > kArgmaxRows))
    throw Error("cuda argmax: split without room for its partials");
  for (int64_t r0 = 0; r0 < n_rows; r0 += 65535) {  // (grid y's limit; only unsplit rows get past it)
    const int64_t n = std::min<int64_t>(65535, n_rows - r0);
    launch(argmax_k, dim3((unsigned)splits, (unsigned)n), kArgmaxThreads, 0, st, x + r0 * dim, dim, out + r0, part_v,
           part_i, cnt);
  }
  check_launch("argmax");
}

void moe_sum(const float* y, const float* w, int64_t n, int k, int64_t dim, float* out, cudaStream_t st) {
  if (n * dim <= 0) return;
  launch(moe_sum_k, grid_for(n * dim), TPB, 0, st, y, w, n, k, dim, out);
  check_launch("moe_sum");
}

int cc_cap(int major) {
  static const int cap = [] {
    const char* e = std::getenv("DASLLAMA_CUDA_CC_MAJOR");
    return e && std::atoi(e) > 0 ? std::atoi(e) : INT_MAX;
  }();
  return std::min(major, cap);
}

int cc_major() {
  static std::atomic<int8_t> known[64];  // per device: 0 not asked yet, else the major
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return 0;
  int8_t k = known[dev].load(std::memory_order_relaxed);
  if (k == 0) {
    int major = 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess) major = 0;
    k = (int8_t)std::min(cc_cap(major), 127);
    known[dev].store(k, std::memory_order_relaxed);
  }
  return k;
}

bool pdl_on() {
  static const bool off = [] {
    const char* e = std::getenv("DASLLAMA_CUDA_PDL");
    return e && (std::strcmp(e, "0") == 0 || std::strcmp(e, "off") == 0);
  }();
  return !off && cc_major() >= 9;
}

bool tensor_cores() { return cc_major() >= 8; }

}  // namespace dl::cuda
