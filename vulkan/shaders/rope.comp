// In-place RoPE: an invocation per (token, pair); cos and sin from common.glsl's rope_cs.
#version 450
#extension GL_EXT_shader_explicit_arithmetic_types_float64 : require
#include "common.glsl"

layout(local_size_x = 64) in;
layout(push_constant, std430) uniform PC {
  uint64_t x, pos, inv_freq, factors;  // inv_freq: doubles; factors: floats or 0
  uint n_tok, stride, n_heads, head_dim, n_rot, neox;
  float freq_scale, mscale;
} pc;

void main() {
  const uint half_ = pc.n_rot / 2u;
  for (uint idx = gl_GlobalInvocationID.x; idx < pc.n_tok * half_; idx += gl_NumWorkGroups.x * 64u) {
  const uint t = idx / half_, i = idx % half_;
  float c, s;
  rope_cs(pc.inv_freq, pc.factors, i, I32(pc.pos).v[t], pc.freq_scale, pc.mscale, c, s);
  const uint i0 = pc.neox != 0u ? i : 2u * i, i1 = pc.neox != 0u ? i + half_ : 2u * i + 1u;
  for (uint h = 0u; h < pc.n_heads; ++h) {
    F32 v = F32(pc.x + (uint64_t(t) * pc.stride + h * pc.head_dim) * 4u);
    const float a = v.v[i0], b = v.v[i1];
    precise float ac = a * c, bs = b * s, as_ = a * s, bc = b * c;
    v.v[i0] = ac - bs;
    v.v[i1] = as_ + bc;
  }
  }
}
