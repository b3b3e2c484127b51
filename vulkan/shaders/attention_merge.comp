// Joins attention.comp's key splits: a workgroup per (head, token) rescales each split's
// (m, l, acc) to the common max, adds the sink (if any) to the denominator, and writes the
// normalized output. Splits with no visible keys (l = 0) weigh nothing.
#version 450
#include "common.glsl"

#ifndef HDMAX
#define HDMAX 256  // the largest head size (attention_merge_512: 512)
#endif
#define NA (HDMAX / 64)  // an invocation's output dims: tid + 64 i, i < NA

layout(local_size_x = 64) in;
layout(push_constant, std430) uniform PC {
  uint64_t part, out_, sinks;
  int out_stride, n_heads, head_dim, n_split;
} pc;

void main() {
  const int h = int(gl_WorkGroupID.x), t = int(gl_WorkGroupID.y), tid = int(gl_LocalInvocationID.x);
  const int hd = pc.head_dim, ns = pc.n_split;
  const uint64_t base = pc.part + uint64_t((t * pc.n_heads + h) * ns) * uint64_t(hd + 2) * 4u;
  float mx = uintBitsToFloat(0xff800000u);
  for (int s = 0; s < ns; ++s) {
    F32 p = F32(base + uint64_t(s * (hd + 2)) * 4u);
    if (p.v[1] > 0.0f) mx = max(mx, p.v[0]);
  }
  const float sink = pc.sinks != 0ul ? F32(pc.sinks).v[h] : uintBitsToFloat(0xff800000u);
  if (pc.sinks != 0ul) mx = max(mx, sink);
  float l = pc.sinks != 0ul ? exp(sink - mx) : 0.0f;
  float acc[NA];
  for (int i = 0; i < NA; ++i) acc[i] = 0.0f;
  for (int s = 0; s < ns; ++s) {
    F32 p = F32(base + uint64_t(s * (hd + 2)) * 4u);
    const float ls = p.v[1];
    if (!(ls > 0.0f)) continue;
    const float w = exp(p.v[0] - mx);
    l += ls * w;
    for (int i = 0; i < NA; ++i) {
      const int d = tid + 64 * i;
      if (d < hd) acc[i] += p.v[2 + d] * w;
    }
  }
  F32 o = F32(pc.out_ + (uint64_t(t) * uint64_t(pc.out_stride) + uint64_t(h * hd)) * 4u);
  const float inv = l > 0.0f ? 1.0f / l : 0.0f;
  for (int i = 0; i < NA; ++i) {
    const int d = tid + 64 * i;
    if (d < hd) o.v[d] = acc[i] * inv;
  }
}
