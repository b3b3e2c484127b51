// The ops of recurrent (gated DeltaNet) layers: the causal depthwise conv with its carried
// state, and the gated delta rule run token by token from its state (sequential over tokens
// as the CPU's, so one prefill and the same tokens decoded one by one agree) or, for a
// prefill, in its chunked form (DeltaRuleArgs::chunked; the algebra is in cpp/cpu/delta_chunked.cpp).
#include <cmath>

#include "common.cuh"
#include "kernels.h"

namespace dl::cuda {
namespace {

// One thread per channel, over the whole sequence; the state is rewritten after every output
// of the channel is made.
__global__ void conv1d_causal_k(float* state, const float* x, int64_t x_stride, int64_t n, int64_t C,
                                const float* __restrict__ w, int k, int silu, float* y) {
  pdl_wait();
  pdl_trigger();
  const int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= C) return;
  const int64_t S = k - 1;
  const float* wc = w + c * k;
  for (int64_t t = 0; t < n; ++t) {
    float acc = 0.f;
    for (int j = 0; j < k; ++j) {
      const int64_t i = t + j;
      acc += wc[j] * (i < S ? state[i * C + c] : x[(i - S) * x_stride + c]);
    }
    y[t * C + c] = silu ? acc / (1.f + expf(-acc)) : acc;
  }
  float keep[64];
  for (int64_t i = 0; i < S; ++i) {
    const int64_t u = n + i;
    keep[i] = u < S ? state[u * C + c] : x[(u - S) * x_stride + c];
  }
  for (int64_t i = 0; i < S; ++i) state[i * C + c] = keep[i];
}

// One block per value head; thread j owns column j of the head's state (dk x dv), read and
// written in global memory (coalesced across j). The norms of q and k in double, as the CPU.
__global__ void delta_rule_k(DeltaRuleArgs a) {
  pdl_wait();
  pdl_trigger();
  const int h = blockIdx.x;
  const int kh = a.grouped ? h / (a.n_v_heads / a.n_k_heads) : h % a.n_k_heads;
  const int64_t dk = a.dk, dv = a.dv;
  float* S = a.state + (int64_t)h * dk * dv;
  __shared__ float sc[2];
  for (int64_t t = 0; t < a.n; ++t) {
    const float* qt = a.q + t * a.qkv_stride + kh * dk;
    const float* kt = a.k + t * a.qkv_stride + kh * dk;
    const float* vt = a.v + t * a.qkv_stride + (int64_t)h * dv;
    if (threadIdx.x == 0) {
      double sq = 0, sk = 0;
      for (int64_t i = 0; i < dk; ++i) sq += (double)qt[i] * qt[i], sk += (double)kt[i] * kt[i];
      sc[0] = (float)(1.0 / sqrt(sq + a.l2_eps) / sqrt((double)dk));
      sc[1] = (float)(1.0 / sqrt(sk + a.l2_eps));
    }
    __syncthreads();
    const float iq = sc[0], ik = sc[1];
    const float x = a.alpha[t * a.ab_stride + h] + a.dt_bias[h];
    const float sp = x > 20.f ? x : log1pf(expf(x));
    const float decay = expf(a.A[h] * sp);
    const float b = 1.f / (1.f + expf(-a.beta[t * a.ab_stride + h]));
    for (int64_t j = threadIdx.x; j < dv; j += blockDim.x) {
      float kv = 0.f;
      for (int64_t i = 0; i < dk; ++i) {
        const float s = S[i * dv + j] * decay;
        S[i * dv + j] = s;
        kv += s * (kt[i] * ik);
      }
      const float delta = (vt[j] - kv) * b;
      float o = 0.f;
      for (int64_t i = 0; i < dk; ++i) {
        const float s = S[i * dv + j] + (kt[i] * ik) * delta;
        S[i * dv + j] = s;
        o += s * (qt[i] * iq);
      }
      a.out[t * a.out_stride + (int64_t)h * dv + j] = o;
    }
    __syncthreads();  // sc is rewritten for the next token
  }
}

// The chunked form: a block per (value head, tile of kTile state columns), the columns of the
// state being independent given the keys. Per chunk of kDeltaChunk tokens the block keeps the
// chunk's normed q and k, the decay-weighted Gram matrix M (then the causal q.k matrix P in its
// place), the solved rows U and its state tile in shared memory; the solve runs a column per
// thread, the rest are (token, column) or (key, column) pairs spread over the block.
constexpr int kTile = 16, kChunkThreads = 256;

__host__ __device__ inline size_t delta_chunk_smem_floats(int64_t dk) {
  const int64_t CL = kDeltaChunk;
  return (size_t)(2 * CL * (dk + 1) + dk * kTile + CL * (CL + 1) + CL * kTile + 4 * CL);
}

__global__ void __launch_bounds__(kChunkThreads) delta_chunk_k(DeltaRuleArgs a) {
  pdl_wait();
  pdl_trigger();
  constexpr int CL = kDeltaChunk;
  extern __shared__ float sm[];
  const int64_t dk = a.dk, dv = a.dv, dq = dk + 1;  // rows of q, k padded against bank conflicts
  float* qs = sm;                 // [CL][dk + 1]
  float* ks = qs + CL * dq;       // [CL][dk + 1]
  float* Ss = ks + CL * dq;       // [dk][kTile]
  float* M = Ss + dk * kTile;     // [CL][CL + 1]
  float* U = M + CL * (CL + 1);   // [CL][kTile]
  float* gc = U + CL * kTile;
  float* b = gc + CL;
  float* eg = b + CL;             // exp(gc)
  float* el = eg + CL;            // exp(gc_last - gc)
  const int h = blockIdx.x, tid = threadIdx.x, nth = blockDim.x;
  const int64_t j0 = (int64_t)blockIdx.y * kTile;
  const int tw = (int)(dv - j0 < kTile ? dv - j0 : kTile);
  const int kh = a.grouped ? h / (a.n_v_heads / a.n_k_heads) : h % a.n_k_heads;
  float* S = a.state + (int64_t)h * dk * dv;
  for (int64_t p = tid; p < dk * kTile; p += nth) {
    const int64_t i = p / kTile, c = p % kTile;
    Ss[p] = c < tw ? S[i * dv + j0 + c] : 0.f;
  }
  const int warp = tid / 32, lane = tid % 32, n_warps = nth / 32;
  for (int64_t t0 = 0; t0 < a.n; t0 += CL) {
    const int L = (int)(a.n - t0 < CL ? a.n - t0 : CL);
    // A warp per token: the norms in double, as the token-by-token rule.
    for (int t = warp; t < L; t += n_warps) {
      const float* qt = a.q + (t0 + t) * a.qkv_stride + kh * dk;
      const float* kt = a.k + (t0 + t) * a.qkv_stride + kh * dk;
      double sq = 0, sk = 0;
      for (int64_t i = lane; i < dk; i += 32) sq += (double)qt[i] * qt[i], sk += (double)kt[i] * kt[i];
      for (int o = 16; o > 0; o /= 2) {
        sq += __shfl_xor_sync(0xffffffffu, sq, o);
        sk += __shfl_xor_sync(0xffffffffu, sk, o);
      }
      const float iq = (float)(1.0 / sqrt(sq + a.l2_eps) / sqrt((double)dk));
      const float ik = (float)(1.0 / sqrt(sk + a.l2_eps));
      for (int64_t i = lane; i < dk; i += 32) qs[t * dq + i] = qt[i] * iq, ks[t * dq + i] = kt[i] * ik;
      if (lane == 0) {
        const float x = a.alpha[(t0 + t) * a.ab_stride + h] + a.dt_bias[h];
        const float sp = x > 20.f ? x : log1pf(expf(x));
        gc[t] = a.A[h] * sp;  // g, summed below
        b[t] = 1.f / (1.f + expf(-a.beta[(t0 + t) * a.ab_stride + h]));
      }
    }
    __syncthreads();
    if (tid == 0)
      for (int t = 1; t < L; ++t) gc[t] += gc[t - 1];
    __syncthreads();
    if (tid < L) eg[tid] = expf(gc[tid]), el[tid] = expf(gc[L - 1] - gc[tid]);
    // The right-hand sides b_t (v_t - exp(gc_t) S^T k_t), and M.
    for (int p = tid; p < L * kTile; p += nth) {
      const int t = p / kTile, c = p % kTile;
      float acc = 0.f;
      for (int64_t i = 0; i < dk; ++i) acc += ks[t * dq + i] * Ss[i * kTile + c];
      const float v = c < tw ? a.v[(t0 + t) * a.qkv_stride + (int64_t)h * dv + j0 + c] : 0.f;
      U[p] = b[t] * (v - expf(gc[t]) * acc);
    }
    for (int p = tid; p < L * L; p += nth) {
      const int t = p / L, s = p % L;
      if (s >= t) continue;
      float acc = 0.f;
      for (int64_t i = 0; i < dk; ++i) acc += ks[t * dq + i] * ks[s * dq + i];
      M[t * (CL + 1) + s] = b[t] * expf(gc[t] - gc[s]) * acc;
    }
    __syncthreads();
    if (tid < kTile)  // the unit lower-triangular solve, a column per thread
      for (int t = 1; t < L; ++t) {
        float u = U[t * kTile + tid];
        for (int s = 0; s < t; ++s) u -= M[t * (CL + 1) + s] * U[s * kTile + tid];
        U[t * kTile + tid] = u;
      }
    __syncthreads();
    for (int p = tid; p < L * L; p += nth) {
      const int t = p / L, s = p % L;
      if (s > t) continue;
      float acc = 0.f;
      for (int64_t i = 0; i < dk; ++i) acc += qs[t * dq + i] * ks[s * dq + i];
      M[t * (CL + 1) + s] = expf(gc[t] - gc[s]) * acc;
    }
    __syncthreads();
    for (int p = tid; p < L * kTile; p += nth) {
      const int t = p / kTile, c = p % kTile;
      if (c >= tw) continue;
      float acc = 0.f, o = 0.f;
      for (int64_t i = 0; i < dk; ++i) acc += qs[t * dq + i] * Ss[i * kTile + c];
      for (int s = 0; s <= t; ++s) o += M[t * (CL + 1) + s] * U[s * kTile + c];
      a.out[(t0 + t) * a.out_stride + (int64_t)h * dv + j0 + c] = eg[t] * acc + o;
    }
    __syncthreads();
    const float e_last = eg[L - 1];
    for (int64_t p = tid; p < dk * kTile; p += nth) {
      const int64_t i = p / kTile, c = p % kTile;
      float acc = 0.f;
      for (int t = 0; t < L; ++t) acc += el[t] * ks[t * dq + i] * U[t * kTile + c];
      Ss[p] = Ss[p] * e_last + acc;
    }
    __syncthreads();
  }
  for (int64_t p = tid; p < dk * kTile; p += nth) {
    const int64_t i = p / kTile, c = p % kTile;
    if (c < tw) S[i * dv + j0 + c] = Ss[p];
  }
}

}  // namespace

bool delta_chunk_fits(int64_t dk) {
  int dev = 0, optin = 0;
  check(cudaGetDevice(&dev), "cudaGetDevice");
  check(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev), "cudaDeviceGetAttribute");
  const size_t smem = delta_chunk_smem_floats(dk) * sizeof(float);
  if (smem > (size_t)optin) return false;
  // Set here, on the host before any capture, for the current device.
  check(cudaFuncSetAttribute(delta_chunk_k, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem),
        "delta_rule chunked: shared memory");
  return true;
}

void conv1d_causal(float* state, const float* x, int64_t x_stride, int64_t n, int64_t C, const float* w, int k,
                   bool silu, float* y, cudaStream_t st) {
  if (n <= 0 || C <= 0) return;
  launch(conv1d_causal_k, (unsigned)ceil_div(C, 128), 128, 0, st, state, x, x_stride, n, C, w, k, silu ? 1 : 0, y);
  check_launch("conv1d_causal");
}

void delta_rule(const DeltaRuleArgs& a, cudaStream_t st) {
  if (a.n <= 0) return;
  if (a.chunked) {  // the caller checked delta_chunk_fits (which sets the shared memory size)
    const size_t smem = delta_chunk_smem_floats(a.dk) * sizeof(float);
    launch(delta_chunk_k, dim3((unsigned)a.n_v_heads, (unsigned)ceil_div(a.dv, kTile)), kChunkThreads, smem, st, a);
    check_launch("delta_rule chunked");
    return;
  }
  launch(delta_rule_k, (unsigned)a.n_v_heads, 128, 0, st, a);
  check_launch("delta_rule");
}

}  // namespace dl::cuda
