// out[i] = row ids[i] of a weight table in format TYPE, dequantized: a workgroup per id.
#version 450
#include "common.glsl"
#include "dequant.glsl"

layout(local_size_x = 64) in;
layout(push_constant, std430) uniform PC {
  uint64_t w, ids, out_;
  uint64_t row_bytes;
  uint cols, id_base;
} pc;

void main() {
  const uint i = pc.id_base + gl_WorkGroupID.y * 32768u + gl_WorkGroupID.x;
  const int id = I32(pc.ids).v[i];
  const uint64_t row = pc.w + uint64_t(id) * pc.row_bytes;
  F32 o = F32(pc.out_ + uint64_t(i) * pc.cols * 4u);
  for (uint g = gl_LocalInvocationID.x; g * 8u < pc.cols; g += 64u) {
    float v[8];
    dq8(row, g, pc.cols, v);
    for (uint j = 0u; j < 8u; ++j)
      if (g * 8u + j < pc.cols) o.v[g * 8u + j] = v[j];
  }
}
