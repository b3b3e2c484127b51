// Activations of a q8-mode prefill rounded to 8-bit blocks of 32, as the CPU's q8 mode
// (cpp/cpu/matmul_isa.cpp, quant_block) and CUDA (quantize_act_k) round them: d = amax / 127,
// q = rint(x * (127 / amax)) clamped to +-127 (NaN to -127). An invocation per 32-block.
// The two divisions are done in f64 and rounded to f32, since Vulkan's f32 division need not
// be correctly rounded and one quant off would move a row's sums past the harness bar. A fused
// stage's RMS norm comes first (flags 1), its values those norm.comp would have written.
#version 450
#extension GL_EXT_shader_explicit_arithmetic_types_float64 : require
#include "common.glsl"

layout(local_size_x = 64) in;
layout(push_constant, std430) uniform PC {
  uint64_t x, xq, xd;  // f32 [n][cols]; int8 [n][cols]; f32 [n][cols / 32]
  uint64_t nw;         // flags 1: x RMS-normed first (times nw where not 0), as norm.comp does
  uint cols, n, flags;
  float eps;
} pc;

shared double red[64];

void main() {
  const uint nb = pc.cols / 32u, b = gl_GlobalInvocationID.x, t = gl_WorkGroupID.y, tid = gl_LocalInvocationID.x;
  float sc = 1.0f;
  if ((pc.flags & 1u) != 0u) {  // the row's scale, each workgroup of the row alike (sums in double)
    F32 xr = F32(pc.x + uint64_t(t) * pc.cols * 4u);
    double ss = 0.0lf;
    for (uint i = tid; i < pc.cols; i += 64u) ss += double(xr.v[i]) * double(xr.v[i]);
    red[tid] = ss;
    barrier();
    for (uint h = 32u; h > 0u; h >>= 1) {
      if (tid < h) red[tid] += red[tid + h];
      barrier();
    }
    sc = float(1.0lf / sqrt(red[0] / double(pc.cols) + double(pc.eps)));
  }
  if (b >= nb || t >= pc.n) return;
  const uint64_t at = uint64_t(t) * pc.cols + uint64_t(b) * 32u;
  V4 xv = V4(pc.x + at * 4u);  // 16-aligned: cols % 32 == 0 and x is (backend's check)
  vec4 v[8];
  float amax = 0.0f;
  [[unroll]] for (uint i = 0u; i < 8u; ++i) {
    v[i] = xv.v[i];
    if ((pc.flags & 1u) != 0u) {  // norm.comp's values, rounded as it rounds them
      [[unroll]] for (uint c = 0u; c < 4u; ++c) {
        precise float e = v[i][c] * sc;
        if (pc.nw != 0ul) e = e * F32(pc.nw).v[b * 32u + i * 4u + c];
        v[i][c] = e;
      }
    }
    const vec4 a = abs(v[i]);
    amax = max(amax, max(max(a.x, a.y), max(a.z, a.w)));
  }
  const float id = amax > 0.0f ? float(127.0lf / double(amax)) : 0.0f;
  uint w[8];
  [[unroll]] for (uint i = 0u; i < 8u; ++i) {
    uint packed = 0u;
    [[unroll]] for (uint c = 0u; c < 4u; ++c) {
      precise float s = v[i][c] * id;
      if (!(s >= -127.0f)) s = -127.0f;
      if (s > 127.0f) s = 127.0f;
      packed |= (uint(int(roundEven(s))) & 0xffu) << (8u * c);
    }
    w[i] = packed;
  }
  V4U q = V4U(pc.xq + at);
  q.v[0] = uvec4(w[0], w[1], w[2], w[3]);
  q.v[1] = uvec4(w[4], w[5], w[6], w[7]);
  F32(pc.xd + (uint64_t(t) * nb + b) * 4u).v[0] = float(double(amax) / 127.0lf);
}
