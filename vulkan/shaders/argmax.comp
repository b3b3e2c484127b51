// Backend::argmax: a workgroup per row; each invocation keeps the first largest of a strided
// walk, then the workgroup joins them in shared memory, the smaller index winning ties (so the
// first index overall). v > b never holds for a NaN; a row of -inf keeps its first through i < bi.
#version 450
#include "common.glsl"

layout(constant_id = 0) const uint WG = 64;
layout(local_size_x_id = 0) in;
layout(push_constant, std430) uniform PC {
  uint64_t x, out_;
  uint dim, row_base;
} pc;

shared float sb[WG];
shared uint si[WG];

const uint NONE = 0xffffffffu;

void join(inout float b, inout uint bi, float v, uint i) {
  if (v > b || (v == b && i < bi)) {
    b = v;
    bi = i;
  }
}

void main() {
  const uint r = pc.row_base + gl_WorkGroupID.x, tid = gl_LocalInvocationID.x;
  F32 x = F32(pc.x + uint64_t(r) * pc.dim * 4u);
  float b = uintBitsToFloat(0xff800000u);  // -inf
  uint bi = NONE;
  for (uint i = tid; i < pc.dim; i += WG) join(b, bi, x.v[i], i);
  sb[tid] = b;
  si[tid] = bi;
  barrier();
  for (uint h = WG / 2u; h > 0u; h >>= 1) {
    if (tid < h) {
      float v = sb[tid];
      uint vi = si[tid];
      join(v, vi, sb[tid + h], si[tid + h]);
      sb[tid] = v;
      si[tid] = vi;
    }
    barrier();
  }
  if (tid == 0u) I32(pc.out_).v[r] = si[0] == NONE ? 0 : int(si[0]);
}
