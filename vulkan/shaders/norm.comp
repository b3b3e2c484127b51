// rms_norm (mode 0) and layer_norm (mode 1) over rows: a workgroup per row, sums in double
// (as the CPU) through shared memory; y may alias x, w and b may be 0 (absent). Mode 2: q8
// mode's f16 prefill, rms_norm's row rounded to f16 once as f16_round (f16_split.comp, LO 0)
// would round it (scaled by the power of two that brings its largest magnitude into
// [2^13, 2^14)): the halves to y, 1 / scale to b[row]; one dispatch where rms_norm and f16_round
// were two (dim even, y 4-aligned, y not x). WG invocations
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

double wg_max(double v) {
  const uint tid = gl_LocalInvocationID.x;
  red[tid] = v;
  barrier();
  for (uint h = WG / 2u; h > 0u; h >>= 1) {
    if (tid < h) red[tid] = max(red[tid], red[tid + h]);
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
  } else if (pc.mode == 2u) {
    double ss = 0.0lf;
    for (uint i = tid; i < pc.dim; i += WG) ss += double(x.v[i]) * double(x.v[i]);
    ss = wg_sum(ss);
    const float s = float(1.0lf / sqrt(ss / double(pc.dim) + double(pc.eps)));
    // The normed values (mode 0's), formed again for each pass: their largest magnitude, then
    // the halves of each pair.
    float amax = 0.0f;
    for (uint i = tid; i < pc.dim; i += WG) {
      precise float v = x.v[i] * s;
      if (pc.w != 0ul) v = v * w.v[i];
      amax = max(amax, abs(v));
    }
    amax = float(wg_max(double(amax)));
    int e = 0;
    if (amax > 0.0f && amax <= 3.0e38f) frexp(amax, e);  // amax < 2^e
    e = clamp(14 - e, -110, 110);
    const float sc = ldexp(1.0f, e);
    U32 yh = U32(pc.y + uint64_t(r) * pc.dim * 2u);
    for (uint i = 2u * tid; i < pc.dim; i += 2u * WG) {
      precise float v0 = x.v[i] * s, v1 = x.v[i + 1u] * s;
      if (pc.w != 0ul) v0 = v0 * w.v[i], v1 = v1 * w.v[i + 1u];
      yh.v[i / 2u] = f2h(v0 * sc) | (f2h(v1 * sc) << 16);  // (exact products: a power of two)
    }
    if (tid == 0u) F32(pc.b).v[r] = ldexp(1.0f, -e);
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
