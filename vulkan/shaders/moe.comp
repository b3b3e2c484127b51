// Mixture-of-experts routing and combining (Backend::moe_route / moe_sum), picked by `op`.
// ROUTE: one invocation per token selects the k largest of its n_expert logits (ties to the
// lower id) and weighs them as the gate says (the CPU's moe_route_row, step for step).
// SUM: out[t][d] = sum_j w[t*k + j] * y[t*k + j][d], invocations over the output elements.
#version 450
#include "common.glsl"

layout(local_size_x = 64) in;
layout(push_constant, std430) uniform PC {
  uint64_t a, b, c;  // ROUTE: logits, ids, weights; SUM: y, w, out
  uint op, n, n_expert, k, gate, norm, dim;
} pc;

const uint ROUTE = 0u, SUM = 1u;
const uint SOFTMAX = 0u, SIGMOID = 1u, SOFTMAX_TOPK = 2u;

void main() {
  F32 A = F32(pc.a), C = F32(pc.c);
  if (pc.op == ROUTE) {
    I32 ids = I32(pc.b);
    for (uint t = gl_GlobalInvocationID.x; t < pc.n; t += gl_NumWorkGroups.x * 64u) {
      const uint l0 = t * pc.n_expert, o = t * pc.k;
      for (uint j = 0u; j < pc.k; ++j) {
        int best = -1;
        for (uint e = 0u; e < pc.n_expert; ++e) {
          bool taken = false;
          for (uint i = 0u; i < j; ++i) taken = taken || ids.v[o + i] == int(e);
          if (!taken && (best < 0 || A.v[l0 + e] > A.v[l0 + uint(best)])) best = int(e);
        }
        ids.v[o + j] = best;
      }
      if (pc.gate == SIGMOID) {
        for (uint j = 0u; j < pc.k; ++j) C.v[o + j] = 1.0f / (1.0f + exp(-A.v[l0 + uint(ids.v[o + j])]));
      } else {
        float mx = A.v[l0 + uint(ids.v[o])];
        float sum = 0.0f;
        if (pc.gate == SOFTMAX) {
          for (uint e = 0u; e < pc.n_expert; ++e) mx = max(mx, A.v[l0 + e]);
          for (uint e = 0u; e < pc.n_expert; ++e) sum += exp(A.v[l0 + e] - mx);
        } else {
          for (uint j = 0u; j < pc.k; ++j) sum += exp(A.v[l0 + uint(ids.v[o + j])] - mx);
        }
        for (uint j = 0u; j < pc.k; ++j) C.v[o + j] = exp(A.v[l0 + uint(ids.v[o + j])] - mx) / sum;
      }
      if (pc.norm != 0u) {
        float sum = 0.0f;
        for (uint j = 0u; j < pc.k; ++j) sum += C.v[o + j];
        for (uint j = 0u; j < pc.k; ++j) C.v[o + j] /= sum;
      }
    }
  } else {
    F32 W = F32(pc.b);
    for (uint i = gl_GlobalInvocationID.x; i < pc.n * pc.dim; i += gl_NumWorkGroups.x * 64u) {
      const uint t = i / pc.dim, d = i % pc.dim;
      float acc = 0.0f;
      for (uint j = 0u; j < pc.k; ++j) acc += W.v[t * pc.k + j] * A.v[(t * pc.k + j) * pc.dim + d];
      C.v[i] = acc;
    }
  }
}
