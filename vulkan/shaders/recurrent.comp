// Recurrent (gated DeltaNet) layers, picked by `op`, sequential over tokens as the CPU's:
// CONV: the causal depthwise conv with its carried state (Backend::conv1d_causal), an
//   invocation per channel over the whole sequence;
// DELTA: the gated delta rule (Backend::delta_rule), a workgroup per value head, invocation j
//   owning column j of the head's dk x dv state; the norms of q and k in double, as the CPU.
#version 450
#extension GL_EXT_shader_explicit_arithmetic_types_float64 : require
#include "common.glsl"

layout(local_size_x = 64) in;
layout(push_constant, std430) uniform PC {
  uint64_t state, q, k, v, alpha, beta, A, dt, out_;  // CONV: state, x, w, -, -, -, -, -, y
  uint op, n, qkv_stride, ab_stride, nk, dk, dv, out_stride;  // CONV: -, n, x_stride, C, k, silu
  uint nv_per_k;  // 0: value head h reads key head h % nk; else h / nv_per_k (grouped)
  float l2_eps;
} pc;

const uint CONV = 0u, DELTA = 1u;
shared float sc[2];

void conv() {
  F32 st = F32(pc.state), X = F32(pc.q), W = F32(pc.k), Y = F32(pc.out_);
  const uint C = pc.ab_stride, K = pc.nk, S = K - 1u, xs = pc.qkv_stride;
  const uint c = gl_GlobalInvocationID.x;
  if (c >= C) return;
  for (uint t = 0u; t < pc.n; ++t) {
    float acc = 0.0f;
    for (uint j = 0u; j < K; ++j) {
      const uint i = t + j;
      acc += W.v[c * K + j] * (i < S ? st.v[i * C + c] : X.v[(i - S) * xs + c]);
    }
    Y.v[t * C + c] = pc.dk != 0u ? acc / (1.0f + exp(-acc)) : acc;
  }
  float keep[64];
  for (uint i = 0u; i < S; ++i) {
    const uint u = pc.n + i;
    keep[i] = u < S ? st.v[u * C + c] : X.v[(u - S) * xs + c];
  }
  for (uint i = 0u; i < S; ++i) st.v[i * C + c] = keep[i];
}

void delta() {
  F32 St = F32(pc.state), Q = F32(pc.q), Kk = F32(pc.k), V = F32(pc.v), Al = F32(pc.alpha), Be = F32(pc.beta),
      Av = F32(pc.A), Dt = F32(pc.dt), O = F32(pc.out_);
  const uint h = gl_WorkGroupID.x, kh = pc.nv_per_k != 0u ? h / pc.nv_per_k : h % pc.nk, dk = pc.dk, dv = pc.dv;
  const uint s0 = h * dk * dv;
  for (uint t = 0u; t < pc.n; ++t) {
    const uint qo = t * pc.qkv_stride + kh * dk, vo = t * pc.qkv_stride + h * dv;
    if (gl_LocalInvocationID.x == 0u) {
      double sq = 0.0LF, sk = 0.0LF;
      for (uint i = 0u; i < dk; ++i) {
        sq += double(Q.v[qo + i]) * double(Q.v[qo + i]);
        sk += double(Kk.v[qo + i]) * double(Kk.v[qo + i]);
      }
      sc[0] = float(1.0LF / sqrt(sq + double(pc.l2_eps)) / sqrt(double(dk)));
      sc[1] = float(1.0LF / sqrt(sk + double(pc.l2_eps)));
    }
    barrier();
    const float iq = sc[0], ik = sc[1];
    const float x = Al.v[t * pc.ab_stride + h] + Dt.v[h];
    const float sp = x > 20.0f ? x : log(1.0f + exp(x));
    const float decay = exp(Av.v[h] * sp);
    const float b = 1.0f / (1.0f + exp(-Be.v[t * pc.ab_stride + h]));
    for (uint j = gl_LocalInvocationID.x; j < dv; j += 64u) {
      float kv = 0.0f;
      for (uint i = 0u; i < dk; ++i) {
        const float s = St.v[s0 + i * dv + j] * decay;
        St.v[s0 + i * dv + j] = s;
        kv += s * (Kk.v[qo + i] * ik);
      }
      const float d = (V.v[vo + j] - kv) * b;
      float o = 0.0f;
      for (uint i = 0u; i < dk; ++i) {
        const float s = St.v[s0 + i * dv + j] + (Kk.v[qo + i] * ik) * d;
        St.v[s0 + i * dv + j] = s;
        o += s * (Q.v[qo + i] * iq);
      }
      O.v[t * pc.out_stride + h * dv + j] = o;
    }
    barrier();  // sc is rewritten for the next token
  }
}

void main() {
  if (pc.op == CONV)
    conv();
  else
    delta();
}
