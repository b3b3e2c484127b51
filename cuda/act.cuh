// The gated activations of the CUDA backend, shared by the GLU op and the GLU fused into
// the quantization of the down projection's input (both must round alike).
#pragma once
#include <cuda_runtime.h>

namespace dl::cuda {

__device__ __forceinline__ float silu(float x) {
  const float e = expf(-fabsf(x));
  return (x >= 0.f ? x : x * e) / (1.f + e);
}
__device__ __forceinline__ float swiglu_oai(float gate, float up) {
  const float g = fminf(gate, 7.f), u = fminf(fmaxf(up, -7.f), 7.f);
  const float z = 1.702f * g;
  const float e = expf(-fabsf(z));
  return g * ((z >= 0.f ? 1.f : e) / (1.f + e)) * (u + 1.f);
}
__device__ __forceinline__ float gelu_tanh(float x) {
  return 0.5f * x * (1.f + tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x)));
}
// act: 0 silu, 1 gelu_tanh, 2 gpt-oss's clamped SwiGLU, 3 sigmoid, 4 relu (Act's order).
__device__ __forceinline__ float glu_value(int act, float g, float u) {
  return act == 2 ? swiglu_oai(g, u) : act == 3 ? u / (1.f + expf(-g)) : act == 4 ? fmaxf(g, 0.f) * u
                                                                     : (act == 0 ? silu(g) : gelu_tanh(g)) * u;
}

}  // namespace dl::cuda
