// Activations of a q8-mode prefill rounded to 8-bit blocks of 32, as the CPU's q8 mode
// (cpp/cpu/matmul_isa.cpp, quant_block) and CUDA (quantize_act_k) round them (qact.glsl, which
// gemv_q.comp shares). An invocation per 32-block. A fused stage's RMS norm comes first (flags
// 1), its values those norm.comp would have written. Flags 2: x is act(gate) * up, computed here
// from the GLU's inputs (gate at x, up, row strides gs / us; act in flags bits 8-15, ops.comp's
// codes) as ops.comp computes it, and also written to gout: the glu's dispatch folded in (each
// invocation reads only its own block's gate and up, so gout may be up).
#version 450
#extension GL_EXT_shader_explicit_arithmetic_types_float64 : require
#include "common.glsl"
#include "qact.glsl"

// WG=32 (quant_act32): rows without the norm only, on 8 times as many workgroups (a decode's
// 8192-wide GLU row is 256 blocks: one workgroup, one SM, at 256).
#ifndef WG
#define WG 256
#endif
layout(local_size_x = WG) in;
layout(push_constant, std430) uniform PC {
  uint64_t x, xq, xd;  // f32 [n][cols]; int8 [n][cols]; f32 [n][cols / 32]
  uint64_t nw;         // flags 1: x RMS-normed first (times nw where not 0), as norm.comp does
  uint64_t up, gout;    // flags 2 (GLU): up, and where x is written
  uint cols, n, flags;
  float eps;
  uint gs, us;          // flags 2: gate's and up's row strides (floats)
} pc;

shared double red[256];
float glu_act(uint act, float g) { return act == 5u ? silu(g) : act == 6u ? gelu_tanh(g) : max(g, 0.0f); }  // gemv_q.comp's

void main() {
  const uint nb = pc.cols / 32u, b = gl_GlobalInvocationID.x, t = gl_WorkGroupID.y, tid = gl_LocalInvocationID.x;
  const bool mine = b < nb && t < pc.n, norm = (pc.flags & 1u) != 0u;
  const uint64_t at = uint64_t(t) * pc.cols + uint64_t(b) * 32u;
  vec4 v[8];
  float sc = 1.0f;
#if WG == 256
  if (norm) {
    // This block's values and norm weights are loaded first: their latency overlaps the row's sum.
    float nwv[32];
    if (mine) {
      V4 xv = V4(pc.x + at * 4u);  // 16-aligned: cols % 32 == 0 and x is (backend's check)
      [[unroll]] for (uint i = 0u; i < 8u; ++i) v[i] = xv.v[i];
      if (pc.nw != 0ul) {
        F32 nw = F32(pc.nw);
        [[unroll]] for (uint i = 0u; i < 32u; ++i) nwv[i] = nw.v[b * 32u + i];
      }
    }
    // the row's scale, each workgroup of the row alike (qact.glsl's order)
    red[tid] = qa_partial(F32(pc.x + uint64_t(t) * pc.cols * 4u), pc.cols, tid);
    barrier();
    for (uint h = 128u; h > 0u; h >>= 1) {
      if (tid < h) red[tid] += red[tid + h];
      barrier();
    }
    sc = qa_scale(red[0], pc.cols, pc.eps);
    if (!mine) return;
    // qact.glsl's qa_norm, over the weights loaded above: the same products
    [[unroll]] for (uint i = 0u; i < 8u; ++i)
      [[unroll]] for (uint c = 0u; c < 4u; ++c) {
        precise float e = v[i][c] * sc;
        if (pc.nw != 0ul) e = e * nwv[i * 4u + c];
        v[i][c] = e;
      }
  } else
#endif
  if (!mine) {
    return;
  } else if ((pc.flags & 2u) != 0u) {  // 16-aligned: gate, up and their strides are (backend's check)
    const uint act = (pc.flags >> 8) & 0xffu;
    V4 gr = V4(pc.x + (uint64_t(t) * pc.gs + b * 32u) * 4u), ur = V4(pc.up + (uint64_t(t) * pc.us + b * 32u) * 4u);
    V4 o = V4(pc.gout + at * 4u);
    [[unroll]] for (uint i = 0u; i < 8u; ++i) {
      const vec4 g = gr.v[i], u = ur.v[i];
      [[unroll]] for (uint c = 0u; c < 4u; ++c) v[i][c] = glu_act(act, g[c]) * u[c];
    }
    [[unroll]] for (uint i = 0u; i < 8u; ++i) o.v[i] = v[i];
  } else {
    V4 xv = V4(pc.x + at * 4u);
    [[unroll]] for (uint i = 0u; i < 8u; ++i) v[i] = xv.v[i];
  }
  uint w[8];
  const float d = qa_round(v, w);
  V4U q = V4U(pc.xq + at);
  q.v[0] = uvec4(w[0], w[1], w[2], w[3]);
  q.v[1] = uvec4(w[4], w[5], w[6], w[7]);
  F32(pc.xd + (uint64_t(t) * nb + b) * 4u).v[0] = d;
}
