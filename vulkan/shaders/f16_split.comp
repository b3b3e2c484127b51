// Step one of the f16 prefill on cooperative matrices (gemm_f16c.comp), as CUDA's f16_split_k:
// each token's f32 activations scaled by a power of two s (its largest magnitude into
// [2^13, 2^14): nothing overflows f16, and small values keep their bits) and split
// x * s = hi + lo, both f16 (hi rounded to nearest even; lo = x * s - hi, exact in f32, rounded
// once more), so W * hi + W * lo gives the f32 dot product to about 2^-22 relative. Writes hi
// [n][cols], lo [n][cols] (f16 bits) and 1 / s [n]. A workgroup per token (the grid wraps past
// 65535 in y); cols % 8 == 0 and x, xh, xl 16-aligned (the backend's check).
// LO 0 (f16_round, q8 mode): hi alone, the activations rounded to f16 once on the same scale.
#version 450
#include "common.glsl"
#ifndef LO
#define LO 1
#endif

layout(local_size_x = 256) in;
layout(push_constant, std430) uniform PC {
  uint64_t x, xh, xl, inv;
  uint cols, n;
} pc;

shared float red[256];

void main() {
  const uint tid = gl_LocalInvocationID.x;
  const uint t = gl_WorkGroupID.y * gl_NumWorkGroups.x + gl_WorkGroupID.x;
  if (t >= pc.n) return;  // the whole workgroup alike
  const uint nc = pc.cols / 8u;  // 8-element chunks: two vec4s read, one uvec4 of halves written each
  const uint64_t xr = pc.x + uint64_t(t) * pc.cols * 4u;
  float amax = 0.0f;
  for (uint c = tid; c < nc; c += 256u) {
    V4 p = V4(xr + uint64_t(c) * 32u);
    const vec4 a = abs(p.v[0]), b = abs(p.v[1]);
    amax = max(amax, max(max(max(a.x, a.y), max(a.z, a.w)), max(max(b.x, b.y), max(b.z, b.w))));
  }
  red[tid] = amax;
  barrier();
  for (uint h = 128u; h > 0u; h >>= 1) {
    if (tid < h) red[tid] = max(red[tid], red[tid + h]);
    barrier();
  }
  amax = red[0];
  int e = 0;
  if (amax > 0.0f && amax <= 3.0e38f) frexp(amax, e);  // amax < 2^e
  e = clamp(14 - e, -110, 110);
  const float sc = ldexp(1.0f, e);
  const uint64_t at = (uint64_t(t) * pc.cols) * 2u;
  for (uint c = tid; c < nc; c += 256u) {
    V4 p = V4(xr + uint64_t(c) * 32u);
    const vec4 a = p.v[0], b = p.v[1];
    const float f[8] = float[8](a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w);
    uvec4 hw, lw;
    [[unroll]] for (uint i = 0u; i < 4u; ++i) {
      const float v0 = f[2u * i] * sc, v1 = f[2u * i + 1u] * sc;  // exact: a power of two
      const uint h0 = f2h(v0), h1 = f2h(v1);
      hw[i] = h0 | (h1 << 16);
      lw[i] = f2h(v0 - h2f(h0)) | (f2h(v1 - h2f(h1)) << 16);
    }
    V4U(pc.xh + at + uint64_t(c) * 16u).v[0] = hw;
#if LO
    V4U(pc.xl + at + uint64_t(c) * 16u).v[0] = lw;
#endif
  }
  if (tid == 0u) F32(pc.inv).v[t] = ldexp(1.0f, -e);
}
