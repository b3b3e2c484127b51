// y[t][r] = sum_k W[r][k] x[t][k]: an invocation per (4 weight rows, 8 tokens) walks the rows
// serially, decoding each 8-element group once and reusing every x value for 4 rows (a 4x8
// register tile). No shared memory and no barriers: cheap on lavapipe (where loads are per-lane
// gathers and a barrier is a coroutine switch), and the x reads are the same for the whole
// workgroup (a broadcast on a GPU). One kernel for decode and prefill (the plain path).
#version 450
#include "common.glsl"
#include "dequant.glsl"

layout(local_size_x = 64) in;
layout(push_constant, std430) uniform PC {
  uint64_t w, x, y;
  uint64_t row_bytes;
  uint rows, cols, n, pad_;
} pc;

const uint NT = 8u, NR = 4u;

void main() {
  const uint r0 = gl_GlobalInvocationID.x * NR;
  if (r0 >= pc.rows) return;
  const uint t0 = gl_WorkGroupID.y * NT;
  const uint nt = min(NT, pc.n - t0);
  uint64_t row[NR];
  // Rows past the end repeat the last one (computed, not stored).
  [[unroll]] for (uint j = 0u; j < NR; ++j) row[j] = pc.w + uint64_t(min(r0 + j, pc.rows - 1u)) * pc.row_bytes;
  const uint ng = (pc.cols + 7u) / 8u;
  float acc[NR][NT];
  [[unroll]] for (uint j = 0u; j < NR; ++j)
    [[unroll]] for (uint t = 0u; t < NT; ++t) acc[j][t] = 0.0f;
  for (uint g = 0u; g < ng; ++g) {
    float v[NR][8];
    [[unroll]] for (uint j = 0u; j < NR; ++j) dq8(row[j], g, pc.cols, v[j]);
    const uint e0 = g * 8u;
    const uint ne = min(8u, pc.cols - e0);
    [[unroll]] for (uint t = 0u; t < NT; ++t) {
      if (t >= nt) break;
      F32 xr = F32(pc.x + (uint64_t(t0 + t) * pc.cols + e0) * 4u);
      [[unroll]] for (uint i = 0u; i < 8u; ++i) {
        if (i >= ne) break;
        const float xv = xr.v[i];
        [[unroll]] for (uint j = 0u; j < NR; ++j) acc[j][t] += v[j][i] * xv;
      }
    }
  }
  [[unroll]] for (uint t = 0u; t < NT; ++t)
    [[unroll]] for (uint j = 0u; j < NR; ++j)
      if (t < nt && r0 + j < pc.rows) F32(pc.y + (uint64_t(t0 + t) * pc.rows + r0 + j) * 4u).v[0] = acc[j][t];
}
