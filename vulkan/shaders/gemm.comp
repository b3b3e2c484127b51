// y[t][r] = sum_k W[r][k] x[t][k] for many tokens (prefill) on GPUs, in f32: a workgroup per
// 128 weight rows x 64 tokens, 16-wide slices of k staged in shared memory (weights decoded
// once per workgroup). Each invocation keeps an 8 x 4 block of outputs and reads the slice
// as vec4s: 32 FMAs per 3 shared loads, where matmul_tile.comp's 4 x 4 block takes 8 scalar
// loads per 16 (its shared-memory reads bounded it). Rows and tokens past the end are
// computed on clamped / zero inputs and not stored.
#version 450
#include "common.glsl"
#include "dequant.glsl"

layout(local_size_x = 256) in;
layout(push_constant, std430) uniform PC {
  uint64_t w, x, y;
  uint64_t row_bytes;
  uint rows, cols, n, pad_;
} pc;

const uint BM = 128u, BN = 64u, BK = 16u;
shared vec4 Ws[BK][BM / 4u];  // [k][row / 4]
shared vec4 Xs[BK][BN / 4u];  // [k][token / 4]

void main() {
  // ty (rows) varies fastest: a subgroup's stores of y cover adjacent rows.
  const uint tid = gl_LocalInvocationID.x, ty = tid % 16u, tx = tid / 16u;
  const uint r0 = gl_WorkGroupID.x * BM, t0 = gl_WorkGroupID.y * BN;
  // Loading: invocation tid decodes group kg of row r0 + lr (8 k) and reads 4 k of token t0 + lt.
  const uint lr = tid % BM, kg = tid / BM;
  const uint lt = tid % BN, kq = tid / BN;
  const uint64_t wrow = pc.w + uint64_t(min(r0 + lr, pc.rows - 1u)) * pc.row_bytes;
  const bool tok_ok = t0 + lt < pc.n;
  const uint64_t xrow = pc.x + uint64_t(min(t0 + lt, pc.n - 1u)) * pc.cols * 4u;
  const bool xvec = pc.cols % 4u == 0u && (pc.x & 15ul) == 0ul;
  // Outputs: rows 4 ty + i and 64 + 4 ty + i (i < 4), tokens 4 tx + j.
  float acc[8][4];
  [[unroll]] for (uint i = 0u; i < 8u; ++i)
    [[unroll]] for (uint j = 0u; j < 4u; ++j) acc[i][j] = 0.0f;
  for (uint k0 = 0u; k0 < pc.cols; k0 += BK) {
    float v[8];
    dq8(wrow, k0 / 8u + kg, pc.cols, v);  // elements past cols read 0
    [[unroll]] for (uint i = 0u; i < 8u; ++i) Ws[kg * 8u + i][lr / 4u][lr % 4u] = v[i];
    const uint e0 = k0 + kq * 4u;
    vec4 xv = vec4(0.0f);
    if (tok_ok) {
      if (xvec && e0 < pc.cols) {
        xv = V4(xrow + uint64_t(e0) * 4u).v[0];
      } else {
        F32 xr = F32(xrow);
        [[unroll]] for (uint i = 0u; i < 4u; ++i) xv[i] = e0 + i < pc.cols ? xr.v[e0 + i] : 0.0f;
      }
    }
    [[unroll]] for (uint i = 0u; i < 4u; ++i) Xs[kq * 4u + i][lt / 4u][lt % 4u] = xv[i];
    barrier();
    [[unroll]] for (uint k = 0u; k < BK; ++k) {
      const vec4 a0 = Ws[k][ty], a1 = Ws[k][16u + ty], b = Xs[k][tx];
      [[unroll]] for (uint j = 0u; j < 4u; ++j) {
        acc[0][j] += a0.x * b[j];
        acc[1][j] += a0.y * b[j];
        acc[2][j] += a0.z * b[j];
        acc[3][j] += a0.w * b[j];
        acc[4][j] += a1.x * b[j];
        acc[5][j] += a1.y * b[j];
        acc[6][j] += a1.z * b[j];
        acc[7][j] += a1.w * b[j];
      }
    }
    barrier();
  }
  [[unroll]] for (uint i = 0u; i < 8u; ++i) {
    const uint r = r0 + (i < 4u ? 4u * ty + i : 64u + 4u * ty + i - 4u);
    [[unroll]] for (uint j = 0u; j < 4u; ++j) {
      const uint t = t0 + 4u * tx + j;
      if (r < pc.rows && t < pc.n) F32(pc.y + (uint64_t(t) * pc.rows + r) * 4u).v[0] = acc[i][j];
    }
  }
}
