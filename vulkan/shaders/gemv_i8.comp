// The decode GEMV in q8 mode (up to 32 tokens): y[t][r] = sum over 32-blocks b of
// isum(W[r][b], xq[t][b]) * (dw * dx), over the int8 activations quant_act.comp rounded, as
// gemm_i8.comp computes it past 32 tokens. Each output's block terms are added in block order
// into one accumulator by one fused multiply-add each (precise), exactly as gemm_i8.comp and
// gemm_coop.comp add them, so a row's values do not depend on how many tokens share the
// matmul (batched equals alone across the 32-token switch). A workgroup per RW rows x NT
// tokens; k in chunks of CB blocks: every invocation first takes P (row, block) pairs, their
// exact integer sums for each token into shared memory, then invocation (row, token) adds the
// chunk's terms in order. DOT=1: the packed 4x8 dot product (OpSDotKHR), else bytes.
#version 450
#include "common.glsl"
#define T_Q8_0S 40  // dequant.glsl's type ids
#define T_Q4_0S 41
#if DOT
#extension GL_EXT_spirv_intrinsics : require
spirv_instruction(extensions = ["SPV_KHR_integer_dot_product"], capabilities = [6019, 6018], id = 4450)
int sdot4(uint a, uint b, spirv_literal int fmt);
#define DOT4(a, b) sdot4(a, b, 0)
#else
int DOT4(uint a, uint b) {
  int s = 0;
  [[unroll]] for (uint i = 0u; i < 4u; ++i) s += sbyte(a, i) * sbyte(b, i);
  return s;
}
#endif

layout(local_size_x = 128) in;
layout(push_constant, std430) uniform PC {
  uint64_t w, xq, xd, y;
  uint64_t row_bytes;
  uint rows, cols, n, flags;  // flags 1: y += the product
} pc;

const uint RW = 8u, NT = 8u, P = 2u, CB = 128u * P / RW;  // rows, tokens, pairs, blocks a chunk
shared int Ss[NT][RW][CB + 1u];  // +1: invocation (row, token)'s reads on distinct banks
shared float Wd[RW][CB], Xd[NT][CB];

uint s4(uint u) { return (u + 0x78787878u) ^ 0x80808080u; }  // gemm_i8.comp's
float i2f(int s) {  // gemm_i8.comp's exact block sum to float
  precise float f = intBitsToFloat(0x4B400000 + s) - 12582912.0f;
  return f;
}

void main() {
  const uint tid = gl_LocalInvocationID.x;
  const uint r0 = gl_WorkGroupID.x * RW, t0 = gl_WorkGroupID.y * NT, nt = min(NT, pc.n - t0);
  const uint nb = pc.cols / 32u;
#if TYPE == T_Q8_0S
  const uint64_t scales = uint64_t(pc.cols);
#else
  const uint64_t scales = uint64_t(pc.cols / 2u);
#endif
  const uint orow = tid % RW, otok = tid / RW;  // the output this invocation adds up
  float acc = 0.0f;
  for (uint kb0 = 0u; kb0 < nb; kb0 += CB) {
    [[unroll]] for (uint p = 0u; p < P; ++p) {
      const uint pi = tid + 128u * p, lr = pi / CB, lb = pi % CB, b = kb0 + lb;  // adjacent blocks adjacent
      if (b < nb) {
        const uint64_t wrow = pc.w + uint64_t(min(r0 + lr, pc.rows - 1u)) * pc.row_bytes;
        uvec4 w0, w1;
#if TYPE == T_Q8_0S
        w0 = V4U(wrow + uint64_t(b) * 32u).v[0];
        w1 = V4U(wrow + uint64_t(b) * 32u + 16u).v[0];
#else
        const uvec4 u = V4U(wrow + uint64_t(b) * 16u).v[0];  // elements 0-15 low nibbles, 16-31 high
        w0 = uvec4(s4(u.x & 0x0F0F0F0Fu), s4(u.y & 0x0F0F0F0Fu), s4(u.z & 0x0F0F0F0Fu), s4(u.w & 0x0F0F0F0Fu));
        w1 = uvec4(s4((u.x >> 4) & 0x0F0F0F0Fu), s4((u.y >> 4) & 0x0F0F0F0Fu), s4((u.z >> 4) & 0x0F0F0F0Fu),
                   s4((u.w >> 4) & 0x0F0F0F0Fu));
#endif
        Wd[lr][lb] = h2f(rd16(wrow + scales + uint64_t(b) * 2u));
        for (uint t = 0u; t < nt; ++t) {
          const uint64_t xa = pc.xq + uint64_t(t0 + t) * pc.cols + uint64_t(b) * 32u;
          const uvec4 x0 = V4U(xa).v[0], x1 = V4U(xa + 16u).v[0];
          int s = 0;
          [[unroll]] for (uint c = 0u; c < 4u; ++c) s = DOT4(w0[c], x0[c]) + s;
          [[unroll]] for (uint c = 0u; c < 4u; ++c) s = DOT4(w1[c], x1[c]) + s;
          Ss[t][lr][lb] = s;
          if (lr == 0u) Xd[t][lb] = F32(pc.xd + (uint64_t(t0 + t) * nb + b) * 4u).v[0];
        }
      }
    }
    barrier();
    if (otok < nt) {
      const uint m = min(CB, nb - kb0);
      for (uint k = 0u; k < m; ++k) {
        precise float sc = Wd[orow][k] * Xd[otok][k];
        precise float a = fma(i2f(Ss[otok][orow][k]), sc, acc);
        acc = a;
      }
    }
    barrier();  // the chunk's terms are read before the next chunk's are written
  }
  const uint r = r0 + orow;
  if (otok < nt && r < pc.rows) {
    F32 yp = F32(pc.y + (uint64_t(t0 + otok) * pc.rows + r) * 4u);
    yp.v[0] = (pc.flags & 1u) != 0u ? yp.v[0] + acc : acc;
  }
}
