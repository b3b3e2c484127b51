// Rotary embedding's device pieces, shared by the rope kernels (ops.cu) and the fused decoder
// layer (fused.cu).
#pragma once
#include <cstdint>

#include "common.cuh"
#include "core/backend.h"

namespace dl::cuda {

// The angle of pair i at position `pos`, in double (long positions keep their precision).
__device__ __forceinline__ void rope_cs(const RopeParams& p, int64_t pos, int i, float* c, float* s) {
  double inv = p.inv_freq ? p.inv_freq[i] : pow((double)p.base, -2.0 * i / p.n_rot);
  if (p.freq_factors) inv /= p.freq_factors[i];
  const double theta = (double)pos * p.freq_scale * inv;
  double sd, cd;
  sincos(theta, &sd, &cd);
  *c = __fmul_rn((float)cd, p.mscale), *s = __fmul_rn((float)sd, p.mscale);
}
// The rotation of one pair (a, b) by the angle whose cosine and sine are c, s.
__device__ __forceinline__ void rope_rot(float a, float b, float c, float s, float* o0, float* o1) {
  *o0 = __fmul_rn(a, c) - __fmul_rn(b, s);
  *o1 = __fmul_rn(a, s) + __fmul_rn(b, c);
}
__device__ __forceinline__ void rope_pair(float* v, int i, int half, bool neox, float c, float s) {
  const int i0 = neox ? i : 2 * i, i1 = neox ? i + half : 2 * i + 1;
  rope_rot(v[i0], v[i1], c, s, &v[i0], &v[i1]);
}

// Token t of x (n_heads heads) and of x2 (n_heads2, may be 0) by the whole block: each pair's
// angle once into cs (shared), then a thread per (head, pair). Each thread's pairs of its first K
// rounds over the block are loaded before the angles are formed, so the loads' wait overlaps the
// double-precision trig instead of following it round after round (one block of the decode
// step's rope + KV store had done 5 rounds, each load after the last round's store).
constexpr int kRopeMaxHalf = 256;
template <int K = 8>
__device__ __forceinline__ void rope_token(float* x, int64_t stride, int n_heads, float* x2, int64_t stride2,
                                           int n_heads2, int head_dim, int64_t t, const int32_t* pos,
                                           const RopeParams& p, float (*cs)[kRopeMaxHalf]) {
  const int half = p.n_rot / 2, total = (n_heads + n_heads2) * half;
  auto head = [&](int h) {
    return h < n_heads ? x + t * stride + (int64_t)h * head_dim : x2 + t * stride2 + (int64_t)(h - n_heads) * head_dim;
  };
  float a[K], b[K];
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int idx = threadIdx.x + k * blockDim.x;
    if (idx < total) {
      const int i = idx % half;
      const float* v = head(idx / half);
      a[k] = v[p.neox ? i : 2 * i], b[k] = v[p.neox ? i + half : 2 * i + 1];
    }
  }
  for (int i = threadIdx.x; i < half; i += blockDim.x) rope_cs(p, pos[t], i, &cs[0][i], &cs[1][i]);
  __syncthreads();
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int idx = threadIdx.x + k * blockDim.x;
    if (idx < total) {
      const int i = idx % half, i0 = p.neox ? i : 2 * i, i1 = p.neox ? i + half : 2 * i + 1;
      float* v = head(idx / half);
      rope_rot(a[k], b[k], cs[0][i], cs[1][i], &v[i0], &v[i1]);
    }
  }
  for (int idx = threadIdx.x + K * blockDim.x; idx < total; idx += blockDim.x)
    rope_pair(head(idx / half), idx % half, half, p.neox, cs[0][idx % half], cs[1][idx % half]);
}

}  // namespace dl::cuda
