// y[t][r] = sum_k W[r][k] x[t][k]: one workgroup per (weight row, block of 8 tokens); each
// invocation decodes 8-element groups once and dots them with every token's x, then the
// workgroup sums in shared memory. One kernel for decode and prefill (plain path).
#version 450
#include "common.glsl"
#include "dequant.glsl"

layout(local_size_x = 64) in;
layout(push_constant, std430) uniform PC {
  uint64_t w, x, y;
  uint64_t row_bytes;
  uint rows, cols, n, row_base;  // row_base + workgroup z * 32768 + x = the row
} pc;

const uint NT = 8u;
shared float red[NT][64];

void main() {
  const uint r = pc.row_base + gl_WorkGroupID.z * 32768u + gl_WorkGroupID.x;
  if (r >= pc.rows) return;  // uniform over the workgroup
  const uint t0 = gl_WorkGroupID.y * NT, tid = gl_LocalInvocationID.x;
  const uint nt = min(NT, pc.n - t0);
  const uint64_t row = pc.w + uint64_t(r) * pc.row_bytes;
  const uint ng = (pc.cols + 7u) / 8u;
  float acc[NT];
  for (uint t = 0u; t < NT; ++t) acc[t] = 0.0f;
  for (uint g = tid; g < ng; g += 64u) {
    float v[8];
    dq8(row, g, pc.cols, v);
    const uint e0 = g * 8u;
    for (uint t = 0u; t < nt; ++t) {
      F32 xr = F32(pc.x + (uint64_t(t0 + t) * pc.cols) * 4u);
      float s = 0.0f;
      for (uint i = 0u; i < 8u; ++i) s += e0 + i < pc.cols ? v[i] * xr.v[e0 + i] : 0.0f;
      acc[t] += s;
    }
  }
  for (uint t = 0u; t < NT; ++t) red[t][tid] = acc[t];
  barrier();
  for (uint h = 32u; h > 0u; h >>= 1) {
    if (tid < h)
      for (uint t = 0u; t < NT; ++t) red[t][tid] += red[t][tid + h];
    barrier();
  }
  if (tid < nt) F32(pc.y + (uint64_t(t0 + tid) * pc.rows + r) * 4u).v[0] = red[tid][0];
}
