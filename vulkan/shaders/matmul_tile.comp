// y[t][r] = sum_k W[r][k] x[t][k] for many tokens (prefill) on GPUs: a workgroup per 64 weight
// rows x 64 tokens. Each 32-wide slice of k is staged in shared memory (weights decoded once per
// workgroup, x read once), then every invocation accumulates a 4 x 4 block of outputs from it,
// so a weight byte is read once per 64 tokens instead of once per 8 (the subgroup path's pass).
// Rows and tokens past the end are computed on clamped / zero inputs and not stored.
#version 450
#include "common.glsl"
#include "dequant.glsl"

layout(local_size_x = 256) in;
layout(push_constant, std430) uniform PC {
  uint64_t w, x, y;
  uint64_t row_bytes;
  uint rows, cols, n, pad_;
} pc;

const uint BM = 64u, BN = 64u, BK = 32u;
shared float Ws[BK][BM + 1u];  // [k][row]; +1 keeps the column writes off one bank
shared float Xs[BK][BN + 1u];  // [k][token]

void main() {
  const uint tid = gl_LocalInvocationID.x, tx = tid % 16u, ty = tid / 16u;
  const uint r0 = gl_WorkGroupID.x * BM, t0 = gl_WorkGroupID.y * BN;
  // Loading: invocation tid decodes group (tid % 4) of row r0 + tid / 4 and reads the same 8
  // elements of token t0 + tid / 4.
  const uint lr = tid / 4u, lg = tid % 4u;
  const uint64_t wrow = pc.w + uint64_t(min(r0 + lr, pc.rows - 1u)) * pc.row_bytes;
  const bool tok_ok = t0 + lr < pc.n;
  const uint64_t xrow = pc.x + uint64_t(min(t0 + lr, pc.n - 1u)) * pc.cols * 4u;
  float acc[4][4];
  [[unroll]] for (uint i = 0u; i < 4u; ++i)
    [[unroll]] for (uint j = 0u; j < 4u; ++j) acc[i][j] = 0.0f;
  for (uint k0 = 0u; k0 < pc.cols; k0 += BK) {
    const uint g = k0 / 8u + lg;
    float v[8];
    dq8(wrow, g, pc.cols, v);  // elements past cols read 0
    const uint e0 = g * 8u;
    F32 xr = F32(xrow);
    [[unroll]] for (uint i = 0u; i < 8u; ++i) {
      Ws[lg * 8u + i][lr] = v[i];
      Xs[lg * 8u + i][lr] = tok_ok && e0 + i < pc.cols ? xr.v[e0 + i] : 0.0f;
    }
    barrier();
    [[unroll]] for (uint k = 0u; k < BK; ++k) {
      float a[4], b[4];
      [[unroll]] for (uint i = 0u; i < 4u; ++i) a[i] = Ws[k][ty + 16u * i];
      [[unroll]] for (uint j = 0u; j < 4u; ++j) b[j] = Xs[k][tx + 16u * j];
      [[unroll]] for (uint i = 0u; i < 4u; ++i)
        [[unroll]] for (uint j = 0u; j < 4u; ++j) acc[i][j] += a[i] * b[j];
    }
    barrier();
  }
  [[unroll]] for (uint i = 0u; i < 4u; ++i) {
    const uint r = r0 + ty + 16u * i;
    [[unroll]] for (uint j = 0u; j < 4u; ++j) {
      const uint t = t0 + tx + 16u * j;
      if (r < pc.rows && t < pc.n) F32(pc.y + (uint64_t(t) * pc.rows + r) * 4u).v[0] = acc[i][j];
    }
  }
}
