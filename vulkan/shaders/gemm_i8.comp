// Prefill in q8 mode: y[t][r] = sum over 32-blocks b of isum(W[r][b], xq[t][b]) * (dw * dx),
// the weights (q8_0 / q4_0 in the split layouts, TYPE 40 / 41) and the activations quant_act.comp
// rounded, both int8. Each block's integer dot product is exact, so the sums are the CPU q8
// mode's (and CUDA's mma) up to the order of the float adds. A workgroup per 16 RM rows x 64
// tokens (RM 8, or 4 where 128-row tiles would leave a GPU's cores idle), the token tiles of one
// row tile adjacent in the grid (x) so its weights come from L2; two blocks of k a stage in shared
// memory as int8 (q4_0's nibbles made signed on the way in), the next stage's global loads issued
// before this one's math; each invocation a block of RM rows x 4 tokens, adjacent invocations on
// adjacent rows (coalesced stores); every output's block sums added in the same order whatever
// the tile (one fused multiply-add a block, in block order, as gemv_i8.comp below 33 tokens), so a
// row's values do not depend on the tile size chosen nor on how many tokens share the matmul.
// DOT=1: the packed 4x8 dot product (SPV_KHR_integer_dot_product, OpSDotKHR) where the device
// has it, else bytes. LOWREG=1: a row's sums at a time (fewer registers; DASLLAMA_VULKAN_I8=rows).
// Rows and tokens past the end read the last one and are not stored; blocks past the end are 0.
#version 450
#include "common.glsl"
#if COOP
#extension GL_NV_cooperative_matrix : require
#extension GL_NV_integer_cooperative_matrix : require
#extension GL_EXT_shader_explicit_arithmetic_types_int8 : require
#extension GL_KHR_memory_scope_semantics : require
#extension GL_KHR_shader_subgroup_basic : require
#endif
#define T_Q8_0S 40  // dequant.glsl's type ids
#define T_Q4_0S 41
#if DOT
#extension GL_EXT_spirv_intrinsics : require
// OpSDotKHR (4450), capabilities DotProduct (6019) and DotProductInput4x8BitPacked (6018);
// the literal 0 is PackedVectorFormat4x8Bit.
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

layout(local_size_x = 256) in;
layout(push_constant, std430) uniform PC {
  uint64_t w, xq, xd, y;
  uint64_t row_bytes;
  uint rows, cols, n, flags;  // flags 1: y += the product
} pc;

const uint BM = 16u * RM, BN = 64u, KB = 2u;  // rows, tokens, 32-blocks a stage
// [block][row or token][2 x 16 bytes + 16 of padding]: a stride of 48 bytes keeps the 16-byte
// reads of 8 adjacent rows on distinct banks.
#if COOP
// Flat, for coopMatLoadNV (offsets and strides in uvec4s); WS / XS index them as the arrays below.
shared uvec4 Wf[KB * BM * 3];
shared uvec4 Xf[KB * BN * 3];
#define WS(k, r, h) Wf[((k) * BM + (r)) * 3u + (h)]
#define XS(k, t, h) Xf[((k) * BN + (t)) * 3u + (h)]
shared int Idx[128];  // 16 x 8 positions r * 8 + c, loaded as a product's type: which lane holds which sum
icoopmatNV<32, gl_ScopeSubgroup, 16, 8> sum_t;  // its length() sizes a lane's share of a product
#define L (sum_t.length())
#else
shared uvec4 Ws[KB][BM][3];
shared uvec4 Xs[KB][BN][3];
#define WS(k, r, h) Ws[k][r][h]
#define XS(k, t, h) Xs[k][t][h]
#endif
shared float Wd[KB][BM];
shared float Xd[KB][BN];

// q4_0 nibbles (q + 8) in each byte of u, as the signed bytes q: n + 0x78 never carries out of
// its byte, and flipping bit 7 then gives n - 8.
uint s4(uint u) { return (u + 0x78787878u) ^ 0x80808080u; }

// A block sum (|s| <= 32 * 128 * 127 < 2^22) as a float, exactly: s added into the mantissa of
// 1.5 * 2^23, which is then taken off. Two full-rate ops where int-to-float conversion runs at a
// quarter of the rate on NVIDIA's GPUs, once per output and block.
float i2f(int s) {
  precise float f = intBitsToFloat(0x4B400000 + s) - 12582912.0f;
  return f;
}

void main() {
  const uint tid = gl_LocalInvocationID.x, tx = tid % 16u, ty = tid / 16u;
  const uint r0 = gl_WorkGroupID.y * BM, t0 = gl_WorkGroupID.x * BN;
  const uint nb = pc.cols / 32u;
#if TYPE == T_Q8_0S
  const uint64_t scales = uint64_t(pc.cols);
#else
  const uint64_t scales = uint64_t(pc.cols / 2u);
#endif
  // Loads of a stage. Weights: q8_0 16-byte pieces p = tid + 256 i (row p / 4, block (p / 2) % 2,
  // half p % 2), q4_0 one piece for tid < 2 BM (row tid / 2, block tid % 2: 32 nibbles); scales
  // for tid < 2 BM: row tid / 2, block tid % 2; activations: token tid / 4, block (tid / 2) % 2,
  // half tid % 2; their scales: token tid / 2, block tid % 2, for tid < 128.
  const uint NW = BM / 64u;  // q8_0 pieces a thread
#if TYPE == T_Q8_0S
  uint64_t wp[NW];
  uint wk[NW];
  [[unroll]] for (uint i = 0u; i < NW; ++i) {
    const uint p = tid + 256u * i;
    wp[i] = pc.w + uint64_t(min(r0 + p / 4u, pc.rows - 1u)) * pc.row_bytes + (p % 2u) * 16u;
    wk[i] = (p / 2u) % 2u;
  }
#else
  const uint64_t wp0 = pc.w + uint64_t(min(r0 + (tid / 2u) % BM, pc.rows - 1u)) * pc.row_bytes;
#endif
  const bool wmine = tid < 2u * BM;  // loads a q4_0 piece and a weight scale
  const uint64_t ws0 = pc.w + uint64_t(min(r0 + (tid / 2u) % BM, pc.rows - 1u)) * pc.row_bytes + scales;
  const uint64_t xp0 = pc.xq + uint64_t(min(t0 + tid / 4u, pc.n - 1u)) * pc.cols + (tid % 2u) * 16u;
  const uint xk = (tid / 2u) % 2u;
  const uint64_t xd0 = pc.xd + uint64_t(min(t0 + (tid % 128u) / 2u, pc.n - 1u)) * nb * 4u;

  uvec4 gw[2], gx;
  float gwd, gxd;
  const uint sk = tid % 2u;  // the block of this thread's scale loads
#define LOAD(kb0)                                                                                  \
  {                                                                                                \
    [[unroll]] for (uint i = 0u; i < NW; ++i) {                                                    \
      WLOAD(i, kb0)                                                                                \
    }                                                                                              \
    const uint b = (kb0) + xk;                                                                     \
    gx = b < nb ? V4U(xp0 + uint64_t(b) * 32u).v[0] : uvec4(0u);                                  \
    const uint bs = (kb0) + sk;                                                                    \
    gwd = bs < nb && wmine ? h2f(rd16(ws0 + uint64_t(bs) * 2u)) : 0.0f;                            \
    gxd = bs < nb && tid < 128u ? F32(xd0).v[bs] : 0.0f;                                           \
  }
#if TYPE == T_Q8_0S
#define WLOAD(i, kb0)                                                                              \
  {                                                                                                \
    const uint b = (kb0) + wk[i];                                                                  \
    gw[i] = b < nb ? V4U(wp[i] + uint64_t(b) * 32u).v[0] : uvec4(0u);                              \
  }
#else
#define WLOAD(i, kb0)                                                                              \
  if (i == 0u) {                                                                                   \
    const uint b = (kb0) + sk;                                                                     \
    const uvec4 u = b < nb && wmine ? V4U(wp0 + uint64_t(b) * 16u).v[0] : uvec4(0x88888888u);      \
    gw[0] = uvec4(s4(u.x & 0x0F0F0F0Fu), s4(u.y & 0x0F0F0F0Fu), s4(u.z & 0x0F0F0F0Fu),            \
                  s4(u.w & 0x0F0F0F0Fu));                                                          \
    gw[1] = uvec4(s4((u.x >> 4) & 0x0F0F0F0Fu), s4((u.y >> 4) & 0x0F0F0F0Fu),                      \
                  s4((u.z >> 4) & 0x0F0F0F0Fu), s4((u.w >> 4) & 0x0F0F0F0Fu));                     \
  }
#endif

#if COOP
  // Subgroup sg (of 8, 32 lanes each: the host checks) takes rows rs.. (2 products of 16) x
  // tokens ts.. (J of 8): 128-row tiles as 4 x 2 subgroups of 32 x 32, 64-row tiles as 2 x 4 of
  // 32 x 16 (twice the workgroups where 128-row tiles leave the cores idle; each output's sums
  // in the same order, so the same bits). Which row and token each of a lane's L sums of a
  // 16 x 8 product is the driver's: a matrix of the product's type loaded from their positions
  // says, and a lane then scales its own sums in registers (no round trip through shared memory).
  const uint RG = BM / 32u, J = RG;  // subgroups across the rows (8 / RG across the tokens); J: token products a subgroup
  const uint sg = gl_SubgroupID, rs = (sg % RG) * 32u, ts = (sg / RG) * (8u * J);
  if (tid < 128u) Idx[tid] = int(tid);
  barrier();
  icoopmatNV<32, gl_ScopeSubgroup, 16, 8> im;
  coopMatLoadNV(im, Idx, 0, 8, false);
  uint er[L], ec[L];
  [[unroll]] for (int e = 0; e < L; ++e) er[e] = uint(im[e]) >> 3, ec[e] = uint(im[e]) & 7u;
  float acc[2][RM / 2u][L];
  [[unroll]] for (uint i = 0u; i < 2u; ++i)
    [[unroll]] for (uint j = 0u; j < J; ++j)
      [[unroll]] for (int e = 0; e < L; ++e) acc[i][j][e] = 0.0f;
  const icoopmatNV<32, gl_ScopeSubgroup, 16, 8> zero = icoopmatNV<32, gl_ScopeSubgroup, 16, 8>(0);
#else
  float acc[RM][4];
  [[unroll]] for (uint i = 0u; i < RM; ++i)
    [[unroll]] for (uint j = 0u; j < 4u; ++j) acc[i][j] = 0.0f;
#endif

  LOAD(0u)
  for (uint kb0 = 0u; kb0 < nb; kb0 += KB) {
    barrier();  // the last stage's reads are done
#if TYPE == T_Q8_0S
    [[unroll]] for (uint i = 0u; i < NW; ++i) {
      const uint p = tid + 256u * i;
      WS(wk[i], p / 4u, p % 2u) = gw[i];
    }
#else
    if (wmine) {
      WS(sk, tid / 2u, 0) = gw[0];
      WS(sk, tid / 2u, 1) = gw[1];
    }
#endif
    XS(xk, tid / 4u, tid % 2u) = gx;
    if (wmine) Wd[sk][tid / 2u] = gwd;
    if (tid < 128u) Xd[sk][tid / 2u] = gxd;
    barrier();
    if (kb0 + KB < nb) LOAD(kb0 + KB)
    [[unroll]] for (uint k = 0u; k < KB; ++k) {
#if COOP
      // A 32-block of 16 rows x 8 tokens is one int8 product (m16n8k32): its sums exact, then
      // each scaled by its row's and token's block scales with gemm_i8's fused multiply-add.
      icoopmatNV<8, gl_ScopeSubgroup, 16, 32> a[2];
      icoopmatNV<8, gl_ScopeSubgroup, 32, 8> x[RM / 2u];
      [[unroll]] for (uint i = 0u; i < 2u; ++i) coopMatLoadNV(a[i], Wf, ((k * BM) + rs + 16u * i) * 3u, 3u, false);
      [[unroll]] for (uint j = 0u; j < J; ++j) coopMatLoadNV(x[j], Xf, ((k * BN) + ts + 8u * j) * 3u, 3u, true);
      float dw[2][L], dx[RM / 2u][L];
      [[unroll]] for (uint i = 0u; i < 2u; ++i)
        [[unroll]] for (int e = 0; e < L; ++e) dw[i][e] = Wd[k][rs + 16u * i + er[e]];
      [[unroll]] for (uint j = 0u; j < J; ++j)
        [[unroll]] for (int e = 0; e < L; ++e) dx[j][e] = Xd[k][ts + 8u * j + ec[e]];
      [[unroll]] for (uint i = 0u; i < 2u; ++i)
        [[unroll]] for (uint j = 0u; j < J; ++j) {
          icoopmatNV<32, gl_ScopeSubgroup, 16, 8> sm = coopMatMulAddNV(a[i], x[j], zero);
          [[unroll]] for (int e = 0; e < L; ++e) {
            precise float sc = dw[i][e] * dx[j][e];
            precise float r = fma(i2f(sm[e]), sc, acc[i][j][e]);
            acc[i][j][e] = r;
          }
        }
#elif LOWREG
      // A row at a time: its 4 block sums finished and scaled before the next row's loads, so
      // 4 integer sums and one row's 32 bytes are live, not 4 RM sums and RM rows' halves (about
      // 40 registers fewer: two workgroups an SM where the 128-row tile allowed one). The same
      // dot products and the same fused multiply-add a block: the same bits.
      uvec4 b[2][4];
      float dx[4];
      [[unroll]] for (uint h = 0u; h < 2u; ++h)
        [[unroll]] for (uint j = 0u; j < 4u; ++j) b[h][j] = XS(k, ty + 16u * j, h);
      [[unroll]] for (uint j = 0u; j < 4u; ++j) dx[j] = Xd[k][ty + 16u * j];
      [[unroll]] for (uint i = 0u; i < RM; ++i) {
        const uvec4 a0 = WS(k, tx + 16u * i, 0), a1 = WS(k, tx + 16u * i, 1);
        const float dw = Wd[k][tx + 16u * i];
        int s[4];
        [[unroll]] for (uint j = 0u; j < 4u; ++j) s[j] = 0;
        [[unroll]] for (uint c = 0u; c < 4u; ++c)
          [[unroll]] for (uint j = 0u; j < 4u; ++j) s[j] = DOT4(a0[c], b[0][j][c]) + s[j];
        [[unroll]] for (uint c = 0u; c < 4u; ++c)
          [[unroll]] for (uint j = 0u; j < 4u; ++j) s[j] = DOT4(a1[c], b[1][j][c]) + s[j];
        [[unroll]] for (uint j = 0u; j < 4u; ++j) {
          precise float sc = dw * dx[j];
          precise float a = fma(i2f(s[j]), sc, acc[i][j]);
          acc[i][j] = a;
        }
      }
#else
      int s[RM][4];
      [[unroll]] for (uint i = 0u; i < RM; ++i)
        [[unroll]] for (uint j = 0u; j < 4u; ++j) s[i][j] = 0;
      [[unroll]] for (uint h = 0u; h < 2u; ++h) {
        uvec4 a[RM], b[4];
        [[unroll]] for (uint i = 0u; i < RM; ++i) a[i] = WS(k, tx + 16u * i, h);
        [[unroll]] for (uint j = 0u; j < 4u; ++j) b[j] = XS(k, ty + 16u * j, h);
        // One chain a sum (each dot product added to it in turn): a dp4a with its accumulator.
        [[unroll]] for (uint c = 0u; c < 4u; ++c)
          [[unroll]] for (uint i = 0u; i < RM; ++i)
            [[unroll]] for (uint j = 0u; j < 4u; ++j) s[i][j] = DOT4(a[i][c], b[j][c]) + s[i][j];
      }
      float dw[RM], dx[4];
      [[unroll]] for (uint i = 0u; i < RM; ++i) dw[i] = Wd[k][tx + 16u * i];
      [[unroll]] for (uint j = 0u; j < 4u; ++j) dx[j] = Xd[k][ty + 16u * j];
      [[unroll]] for (uint i = 0u; i < RM; ++i)
        [[unroll]] for (uint j = 0u; j < 4u; ++j) {
          precise float sc = dw[i] * dx[j];
          precise float a = fma(i2f(s[i][j]), sc, acc[i][j]);  // one rounding, as gemv_i8.comp's
          acc[i][j] = a;
        }
#endif
    }
  }
#if COOP
  [[unroll]] for (uint i = 0u; i < 2u; ++i)
    [[unroll]] for (uint j = 0u; j < J; ++j)
      [[unroll]] for (int e = 0; e < L; ++e) {
        const uint r = r0 + rs + 16u * i + er[e], t = t0 + ts + 8u * j + ec[e];
        if (r >= pc.rows || t >= pc.n) continue;
        F32 yp = F32(pc.y + (uint64_t(t) * pc.rows + r) * 4u);
        yp.v[0] = (pc.flags & 1u) != 0u ? yp.v[0] + acc[i][j][e] : acc[i][j][e];
      }
#else
  [[unroll]] for (uint j = 0u; j < 4u; ++j) {
    const uint t = t0 + ty + 16u * j;
    if (t >= pc.n) continue;
    [[unroll]] for (uint i = 0u; i < RM; ++i) {
      const uint r = r0 + tx + 16u * i;
      if (r >= pc.rows) continue;
      F32 yp = F32(pc.y + (uint64_t(t) * pc.rows + r) * 4u);
      yp.v[0] = (pc.flags & 1u) != 0u ? yp.v[0] + acc[i][j] : acc[i][j];
    }
  }
#endif
}
