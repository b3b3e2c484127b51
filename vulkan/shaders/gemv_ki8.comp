// q8 mode's decode GEMV of q4_K / q5_K / q6_K weights (up to 32 tokens) on int8 dot products,
// over the activations quant_act.comp rounded to 8-bit blocks of 32 (CUDA's gemv_k_i8_k). 32
// invocations a row, 4 rows a workgroup; an invocation takes pairs of 32-weight sub-blocks of its
// row (p = lane, lane + 32, ...), so a 2048-wide row is one pair each:
// - q4_K / q5_K: pair k of a super-block is sub-blocks 2k and 2k + 1, the low and high nibbles
//   of the same 32 bytes (q5_K's fifth bits: bits 2k, 2k + 1 of the block's 32 high bytes); a
//   sub-block's term is xd * (d * sc * sum(q * xq) - dmin * m * sum(xq)).
// - q6_K: pair k = 2h + s is sub-blocks s and s + 2 of half h, the low and high nibbles of the
//   same 32 ql bytes and two bits each of the half's 32 qh bytes, stored + 32 and made signed a
//   byte at a time; each 16 weights have their own int8 scale: xd * d * (sc0 * sum0 + sc1 * sum1).
// A token's value is the same whatever the tokens beside it: each invocation adds its pairs in
// order, then the row's 32 partial sums are added by one subgroupAdd where a subgroup is 32
// lanes (a row's invocations are then one subgroup), else in a fixed tree through shared memory.
// DOT=1: the packed 4x8 dot product (OpSDotKHR), else bytes. Rows 16-byte aligned for q4_K /
// q5_K; q6_K's 210-byte blocks read as the 4-byte words around them (the host checks).
#version 450
#include "common.glsl"
#include "dequant.glsl"
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_KHR_shader_subgroup_arithmetic : require
#extension GL_KHR_shader_subgroup_vote : require
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

const uint RW = 4u, NT = 8u;  // rows a workgroup, tokens a pass
shared float red[NT][128];
shared uint sg_rows;

// 32 bytes at a 2-aligned address as eight words: the aligned words around them, shifted a
// half-word where they start mid-word (every word read holds some of the block's bytes).
void ld32_a2(uint64_t a, out uint w[8]) {
  U32 p = U32(a & ~uint64_t(3));
  const uint sh = uint(a & 2) * 8u;
  uint v[9];
  [[unroll]] for (uint i = 0u; i < 9u; ++i) v[i] = p.v[i];
  [[unroll]] for (uint i = 0u; i < 8u; ++i) w[i] = sh == 0u ? v[i] : (v[i] >> 16) | (v[i + 1u] << 16);
}

// The byte-wise subtraction of 32 (q6_K's stored quants, 0..63, to -32..31 as int8 bytes).
uint sub32(uint u) { return ((u | 0x80808080u) - 0x20202020u) ^ 0x80808080u; }

void main() {
  const uint tid = gl_LocalInvocationID.x, lane = tid & 31u, lr = tid >> 5;
  // subgroupAdd where every subgroup is exactly one row's 32 invocations (checked, not assumed:
  // a driver may number its subgroups otherwise); the shared-memory tree elsewhere.
  if (tid == 0u) sg_rows = 1u;
  barrier();
  if (!(gl_SubgroupSize == 32u && subgroupAllEqual(lr))) atomicAnd(sg_rows, 0u);
  barrier();
  const bool sg32 = sg_rows != 0u;
  const uint r = gl_WorkGroupID.x * RW + lr;
  const uint64_t row = pc.w + uint64_t(min(r, pc.rows - 1u)) * pc.row_bytes;
  const uint nb = pc.cols / 32u, pairs = pc.cols / 64u;
  for (uint t0 = 0u; t0 < pc.n; t0 += NT) {
    const uint nt = min(NT, pc.n - t0);
    float acc[NT];
    [[unroll]] for (uint t = 0u; t < NT; ++t) acc[t] = 0.0f;
    // Trips alike in every lane, no lane leaving early (a lane past the row's pairs reads the last
    // pair and adds nothing), so the subgroup's sums below follow uniform control flow.
    for (uint p0 = 0u; p0 < pairs; p0 += 32u) {
      const bool live = p0 + lane < pairs;
      const uint p = min(p0 + lane, pairs - 1u);
      const uint sb = p >> 2, k = p & 3u;
      uint qa[8], qb[8];  // the pair's two sub-blocks as bytes
      float wa0, wa1, wb0, wb1, na = 0.0f, nbm = 0.0f;  // scales of each 16 (q4_K / q5_K: of 32), mins
      uint xa, xb;                                       // x's blocks of the two sub-blocks
#if TYPE == T_Q6_K
      const uint64_t b = row + uint64_t(sb) * 210u;
      const uint h = k >> 1, s = k & 1u;
      uint ql[8], qh[8];
      ld32_a2(b + h * 64u + s * 32u, ql);
      ld32_a2(b + 128u + h * 32u, qh);
      const float d = h2f(rd16(b + 208u));
      const uint64_t sc = b + 192u + h * 8u + s * 2u;
      wa0 = d * float(sbyte(rd8(sc), 0u)), wa1 = d * float(sbyte(rd8(sc + 1u), 0u));
      wb0 = d * float(sbyte(rd8(sc + 4u), 0u)), wb1 = d * float(sbyte(rd8(sc + 5u), 0u));
      [[unroll]] for (uint i = 0u; i < 8u; ++i) {
        qa[i] = sub32((ql[i] & 0x0F0F0F0Fu) | (((qh[i] >> (2u * s)) & 0x03030303u) << 4));
        qb[i] = sub32(((ql[i] >> 4) & 0x0F0F0F0Fu) | (((qh[i] >> (2u * s + 4u)) & 0x03030303u) << 4));
      }
      xa = sb * 8u + h * 4u + s, xb = xa + 2u;
#else
      const uint64_t b = row + uint64_t(sb) * (TYPE == T_Q4_K ? 144u : 176u);
      const uvec4 hd = V4U(b).v[0];  // d, dmin and the 12 bytes of scales and mins in one load
      const float d = h2f(hd.x & 0xFFFFu), dmin = h2f(hd.x >> 16);
      uint s0, m0, s1, m1;
      k_scale_min_w(hd.yzw, 2u * k, s0, m0);
      k_scale_min_w(hd.yzw, 2u * k + 1u, s1, m1);
      const uint64_t qo = b + (TYPE == T_Q4_K ? 16u : 48u) + 32u * k;
      const uvec4 u0 = V4U(qo).v[0], u1 = V4U(qo + 16u).v[0];
      const uint qw[8] = uint[8](u0.x, u0.y, u0.z, u0.w, u1.x, u1.y, u1.z, u1.w);
#if TYPE == T_Q5_K
      const uvec4 h0 = V4U(b + 16u).v[0], h1 = V4U(b + 32u).v[0];
      const uint hw[8] = uint[8](h0.x, h0.y, h0.z, h0.w, h1.x, h1.y, h1.z, h1.w);
#endif
      [[unroll]] for (uint i = 0u; i < 8u; ++i) {
        qa[i] = qw[i] & 0x0F0F0F0Fu, qb[i] = (qw[i] >> 4) & 0x0F0F0F0Fu;
#if TYPE == T_Q5_K
        qa[i] |= ((hw[i] >> (2u * k)) & 0x01010101u) << 4;
        qb[i] |= ((hw[i] >> (2u * k + 1u)) & 0x01010101u) << 4;
#endif
      }
      wa0 = wa1 = d * float(s0), wb0 = wb1 = d * float(s1);
      na = dmin * float(m0), nbm = dmin * float(m1);
      xa = sb * 8u + 2u * k, xb = xa + 1u;
#endif
      for (uint t = 0u; t < nt; ++t) {
        const uint64_t xr = pc.xq + uint64_t(t0 + t) * pc.cols;
        const uvec4 a0 = V4U(xr + uint64_t(xa) * 32u).v[0], a1 = V4U(xr + uint64_t(xa) * 32u + 16u).v[0];
        const uvec4 c0 = V4U(xr + uint64_t(xb) * 32u).v[0], c1 = V4U(xr + uint64_t(xb) * 32u + 16u).v[0];
        const uint xva[8] = uint[8](a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w);
        const uint xvb[8] = uint[8](c0.x, c0.y, c0.z, c0.w, c1.x, c1.y, c1.z, c1.w);
        int sa0 = 0, sa1 = 0, sb0 = 0, sb1 = 0;
        [[unroll]] for (uint i = 0u; i < 4u; ++i) {
          sa0 = DOT4(qa[i], xva[i]) + sa0, sa1 = DOT4(qa[i + 4u], xva[i + 4u]) + sa1;
          sb0 = DOT4(qb[i], xvb[i]) + sb0, sb1 = DOT4(qb[i + 4u], xvb[i + 4u]) + sb1;
        }
        float va = wa0 * float(sa0) + wa1 * float(sa1), vb = wb0 * float(sb0) + wb1 * float(sb1);
#if TYPE != T_Q6_K
        int xsa = 0, xsb = 0;  // the blocks' sums of x's quants (the mins' terms)
        [[unroll]] for (uint i = 0u; i < 8u; ++i) xsa = DOT4(0x01010101u, xva[i]) + xsa, xsb = DOT4(0x01010101u, xvb[i]) + xsb;
        va -= na * float(xsa), vb -= nbm * float(xsb);
#endif
        F32 xd = F32(pc.xd + (uint64_t(t0 + t) * nb) * 4u);
        acc[t] += live ? xd.v[xa] * va + xd.v[xb] * vb : 0.0f;
      }
    }
    if (sg32) {
      for (uint t = 0u; t < nt; ++t) {
        const float v = subgroupAdd(acc[t]);
        if (lane == t && r < pc.rows) {
          F32 yp = F32(pc.y + (uint64_t(t0 + t) * pc.rows + r) * 4u);
          yp.v[0] = (pc.flags & 1u) != 0u ? yp.v[0] + v : v;
        }
      }
      continue;
    }
    [[unroll]] for (uint t = 0u; t < NT; ++t) red[t][tid] = acc[t];
    barrier();
    [[unroll]] for (uint w = 16u; w > 0u; w >>= 1) {
      if (lane < w)
        for (uint t = 0u; t < nt; ++t) red[t][tid] += red[t][tid + w];
      barrier();
    }
    if (lane < nt && r < pc.rows) {
      F32 yp = F32(pc.y + (uint64_t(t0 + lane) * pc.rows + r) * 4u);
      const float v = red[lane][lr * 32u];
      yp.v[0] = (pc.flags & 1u) != 0u ? yp.v[0] + v : v;
    }
    barrier();  // the sums are read before the next pass writes them
  }
}
