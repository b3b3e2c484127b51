// The ops of recurrent (gated DeltaNet) layers: the causal depthwise conv with its carried
// state, and the gated delta rule run token by token from its state. Sequential over tokens
// as the CPU's, so one prefill and the same tokens decoded one by one agree.
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

}  // namespace

void conv1d_causal(float* state, const float* x, int64_t x_stride, int64_t n, int64_t C, const float* w, int k,
                   bool silu, float* y, cudaStream_t st) {
  if (n <= 0 || C <= 0) return;
  launch(conv1d_causal_k, (unsigned)ceil_div(C, 128), 128, 0, st, state, x, x_stride, n, C, w, k, silu ? 1 : 0, y);
  check_launch("conv1d_causal");
}

void delta_rule(const DeltaRuleArgs& a, cudaStream_t st) {
  if (a.n <= 0) return;
  launch(delta_rule_k, (unsigned)a.n_v_heads, 128, 0, st, a);
  check_launch("delta_rule");
}

}  // namespace dl::cuda
