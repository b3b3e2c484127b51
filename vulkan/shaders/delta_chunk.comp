// The gated delta rule in its chunked form (Backend::delta_rule with `chunked`; the algebra is in
// cpp/cpu/delta_chunked.cpp): a workgroup per (value head, tile of TILE state columns), the
// columns of the state being independent given the keys. Per chunk of CL tokens the workgroup
// keeps the decay-weighted key Gram matrix M (then the causal q.k matrix P in its place), the
// solved rows U and its dk x TILE state tile in shared memory; q and k are read from the rows
// (scaled by their norms, taken in double as the token-by-token rule). The solve runs a column per
// invocation; the rest are (token, column) or (key, column) pairs spread over the workgroup.
// dk <= MAXDK (the caller runs the token-by-token rule beyond).
#version 450
#extension GL_EXT_shader_explicit_arithmetic_types_float64 : require
#include "common.glsl"

const uint CL = 64u, TILE = 16u, MAXDK = 128u, NT = 256u, MS = CL + 1u;
layout(local_size_x = 256) in;
layout(push_constant, std430) uniform PC {
  uint64_t state, q, k, v, alpha, beta, A, dt, out_;
  uint op, n, qkv_stride, ab_stride, nk, dk, dv, out_stride;
  uint nv_per_k;  // 0: value head h reads key head h % nk; else h / nv_per_k (grouped)
  float l2_eps;
} pc;

shared float Ss[MAXDK * TILE];
shared float M[CL * MS];
shared float U[CL * TILE];
shared float gc[CL], bt[CL], eg[CL], el[CL], iq[CL], ik[CL];

void main() {
  F32 St = F32(pc.state), Q = F32(pc.q), Kk = F32(pc.k), V = F32(pc.v), Al = F32(pc.alpha), Be = F32(pc.beta),
      Av = F32(pc.A), Dt = F32(pc.dt), O = F32(pc.out_);
  const uint h = gl_WorkGroupID.x, kh = pc.nv_per_k != 0u ? h / pc.nv_per_k : h % pc.nk, dk = pc.dk, dv = pc.dv;
  const uint j0 = gl_WorkGroupID.y * TILE, tw = min(TILE, dv - j0), tid = gl_LocalInvocationID.x;
  const uint s0 = h * dk * dv;
  for (uint p = tid; p < dk * TILE; p += NT) {
    const uint i = p / TILE, c = p % TILE;
    Ss[p] = c < tw ? St.v[s0 + i * dv + j0 + c] : 0.0f;
  }
  for (uint t0 = 0u; t0 < pc.n; t0 += CL) {
    const uint L = min(CL, pc.n - t0);
    if (tid < L) {
      const uint r = (t0 + tid) * pc.qkv_stride + kh * dk;
      double sq = 0.0LF, sk = 0.0LF;
      for (uint i = 0u; i < dk; ++i) {
        sq += double(Q.v[r + i]) * double(Q.v[r + i]);
        sk += double(Kk.v[r + i]) * double(Kk.v[r + i]);
      }
      iq[tid] = float(1.0LF / sqrt(sq + double(pc.l2_eps)) / sqrt(double(dk)));
      ik[tid] = float(1.0LF / sqrt(sk + double(pc.l2_eps)));
      const float x = Al.v[(t0 + tid) * pc.ab_stride + h] + Dt.v[h];
      const float sp = x > 20.0f ? x : log(1.0f + exp(x));
      gc[tid] = Av.v[h] * sp;  // g, summed below
      bt[tid] = 1.0f / (1.0f + exp(-Be.v[(t0 + tid) * pc.ab_stride + h]));
    }
    barrier();
    if (tid == 0u)
      for (uint t = 1u; t < L; ++t) gc[t] += gc[t - 1u];
    barrier();
    if (tid < L) {
      eg[tid] = exp(gc[tid]);
      el[tid] = exp(gc[L - 1u] - gc[tid]);
    }
    // The right-hand sides b_t (v_t - exp(gc_t) S^T k_t), and M.
    for (uint p = tid; p < L * TILE; p += NT) {
      const uint t = p / TILE, c = p % TILE, r = (t0 + t) * pc.qkv_stride + kh * dk;
      float acc = 0.0f;
      for (uint i = 0u; i < dk; ++i) acc += Kk.v[r + i] * Ss[i * TILE + c];
      const float v = c < tw ? V.v[(t0 + t) * pc.qkv_stride + h * dv + j0 + c] : 0.0f;
      U[p] = bt[t] * (v - exp(gc[t]) * (acc * ik[t]));
    }
    for (uint p = tid; p < L * L; p += NT) {
      const uint t = p / L, s = p % L;
      if (s >= t) continue;
      const uint rt = (t0 + t) * pc.qkv_stride + kh * dk, rs = (t0 + s) * pc.qkv_stride + kh * dk;
      float acc = 0.0f;
      for (uint i = 0u; i < dk; ++i) acc += Kk.v[rt + i] * Kk.v[rs + i];
      M[t * MS + s] = bt[t] * exp(gc[t] - gc[s]) * (acc * ik[t] * ik[s]);
    }
    barrier();
    if (tid < TILE)  // the unit lower-triangular solve, a column per invocation
      for (uint t = 1u; t < L; ++t) {
        float u = U[t * TILE + tid];
        for (uint s = 0u; s < t; ++s) u -= M[t * MS + s] * U[s * TILE + tid];
        U[t * TILE + tid] = u;
      }
    barrier();
    for (uint p = tid; p < L * L; p += NT) {
      const uint t = p / L, s = p % L;
      if (s > t) continue;
      const uint rt = (t0 + t) * pc.qkv_stride + kh * dk, rs = (t0 + s) * pc.qkv_stride + kh * dk;
      float acc = 0.0f;
      for (uint i = 0u; i < dk; ++i) acc += Q.v[rt + i] * Kk.v[rs + i];
      M[t * MS + s] = exp(gc[t] - gc[s]) * (acc * iq[t] * ik[s]);
    }
    barrier();
    for (uint p = tid; p < L * TILE; p += NT) {
      const uint t = p / TILE, c = p % TILE, r = (t0 + t) * pc.qkv_stride + kh * dk;
      if (c >= tw) continue;
      float acc = 0.0f, o = 0.0f;
      for (uint i = 0u; i < dk; ++i) acc += Q.v[r + i] * Ss[i * TILE + c];
      for (uint s = 0u; s <= t; ++s) o += M[t * MS + s] * U[s * TILE + c];
      O.v[(t0 + t) * pc.out_stride + h * dv + j0 + c] = eg[t] * (acc * iq[t]) + o;
    }
    barrier();
    const float e_last = eg[L - 1u];
    for (uint p = tid; p < dk * TILE; p += NT) {
      const uint i = p / TILE, c = p % TILE;
      float acc = 0.0f;
      for (uint t = 0u; t < L; ++t) acc += (el[t] * ik[t] * Kk.v[(t0 + t) * pc.qkv_stride + kh * dk + i]) * U[t * TILE + c];
      Ss[p] = Ss[p] * e_last + acc;
    }
    barrier();
  }
  for (uint p = tid; p < dk * TILE; p += NT) {
    const uint i = p / TILE, c = p % TILE;
    if (c < tw) St.v[s0 + i * dv + j0 + c] = Ss[p];
  }
}
