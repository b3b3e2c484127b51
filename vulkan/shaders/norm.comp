// rms_norm (mode 0) and layer_norm (mode 1) over rows: a workgroup per row, sums in double
// (as the CPU) through shared memory; y may alias x, w and b may be 0 (absent). WG invocations
// (specialization constant 0: 256 on a GPU, so a decode step's one row is a few loads per
// invocation, not a serial walk; 64 on a software device, where invocations run in turn).
#version 450
#extension GL_EXT_shader_explicit_arithmetic_types_float64 : require
#include "common.glsl"

layout(constant_id = 0) const uint WG = 64;
layout(local_size_x_id = 0) in;
layout(push_constant, std430) uniform PC {
  uint64_t x, w, b, y;
  uint dim, mode, row_base;
  float eps;
} pc;

shared double red[WG];

double wg_sum(double v) {
  const uint tid = gl_LocalInvocationID.x;
  red[tid] = v;
  barrier();
  for (uint h = WG / 2u; h > 0u; h >>= 1) {
    if (tid < h) red[tid] += red[tid + h];
    barrier();
  }
  const double s = red[0];
  barrier();
  return s;
}

void main() {
  const uint r = pc.row_base + gl_WorkGroupID.x, tid = gl_LocalInvocationID.x;
  F32 x = F32(pc.x + uint64_t(r) * pc.dim * 4u), y = F32(pc.y + uint64_t(r) * pc.dim * 4u);
  F32 w = F32(pc.w), b = F32(pc.b);
  if (pc.mode == 0u) {
    double ss = 0.0lf;
    for (uint i = tid; i < pc.dim; i += WG) ss += double(x.v[i]) * double(x.v[i]);
    ss = wg_sum(ss);
    const float s = float(1.0lf / sqrt(ss / double(pc.dim) + double(pc.eps)));
    for (uint i = tid; i < pc.dim; i += WG) {
      precise float v = x.v[i] * s;
      if (pc.w != 0ul) v = v * w.v[i];
      y.v[i] = v;
    }
  } else {
    double mean = 0.0lf;
    for (uint i = tid; i < pc.dim; i += WG) mean += double(x.v[i]);
    mean = wg_sum(mean) / double(pc.dim);
    double var = 0.0lf;
    for (uint i = tid; i < pc.dim; i += WG) {
      const double d = double(x.v[i]) - mean;
      var += d * d;
    }
    var = wg_sum(var);
    const double inv = 1.0lf / sqrt(var / double(pc.dim) + double(pc.eps));
    for (uint i = tid; i < pc.dim; i += WG) {
      precise float v = float((double(x.v[i]) - mean) * inv);
      if (pc.w != 0ul) v = v * w.v[i];
      if (pc.b != 0ul) v = v + b.v[i];
      y.v[i] = v;
    }
  }
}
