// q8 mode's prefill of weights in a block format (q4_1, q5_0, q5_1, q4_K, q5_K, q6_K) on the f16
// GEMM (gemm_f16c.comp), as llama.cpp runs such prefills on f16 GEMMs: `rows` rows of the
// matrix decoded (dequant.glsl's dq8: the reference decoders' values) and rounded to f16
// (nearest even) into out [rows][cols], which the GEMM then reads as an f16 matrix. Once a
// matmul, not once a tile: a 512-token prefill's GEMM reads each weight row for 8 token tiles.
// A workgroup a row (the grid wraps past 65535 in y), its 64 invocations along the row's
// 8-element groups: 16 bytes of halves written each.
#version 450
#include "common.glsl"
#include "dequant.glsl"

layout(local_size_x = 64) in;
layout(push_constant, std430) uniform PC {
  uint64_t w, out_, row_bytes;
  uint rows, cols;
} pc;

void main() {
  const uint r = gl_WorkGroupID.y * gl_NumWorkGroups.x + gl_WorkGroupID.x;
  if (r >= pc.rows) return;  // the whole workgroup alike
  const uint64_t row = pc.w + uint64_t(r) * pc.row_bytes;
  const uint64_t o = pc.out_ + uint64_t(r) * pc.cols * 2u;
  for (uint g = gl_LocalInvocationID.x; g < pc.cols / 8u; g += 64u) {
    float v[8];
    dq8(row, g, pc.cols, v);
    uvec4 h;
    [[unroll]] for (uint i = 0u; i < 4u; ++i) h[i] = f2h(v[2u * i]) | (f2h(v[2u * i + 1u]) << 16);
    V4U(o + uint64_t(g) * 16u).v[0] = h;
  }
}
