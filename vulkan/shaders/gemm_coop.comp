// gemm_i8.comp's product on NVIDIA's int8 cooperative matrices (VK_NV_cooperative_matrix, the
// 16 x 8 x 32 int8 shape: one mma.sync m16n8k32, as CUDA's mma.cu): a 32-block of 16 rows x 8
// tokens is one matrix product, its int32 sums exactly the per-block dot products. Which lane
// holds which sum is the driver's, so each product goes through shared memory to be scaled by
// its rows' and tokens' block scales in f32 (as gemm_i8.comp scales them). A workgroup per 128
// rows x 64 tokens, 8 subgroups of 32 lanes (the backend picks this shader only where the
// subgroup size is 32), each 32 rows x 32 tokens; a lane keeps the 32 rows of one token.
#version 450
#include "common.glsl"
#extension GL_NV_cooperative_matrix : require
#extension GL_NV_integer_cooperative_matrix : require
#extension GL_EXT_shader_explicit_arithmetic_types_int8 : require
#extension GL_KHR_memory_scope_semantics : require
#extension GL_KHR_shader_subgroup_basic : require
#define T_Q8_0S 40  // dequant.glsl's type ids
#define T_Q4_0S 41

layout(local_size_x = 256) in;
layout(push_constant, std430) uniform PC {
  uint64_t w, xq, xd, y;
  uint64_t row_bytes;
  uint rows, cols, n, flags;  // flags 1: y += the product
} pc;

const uint BM = 128u, BN = 64u, KS = 48u;  // KS: a row's stride in bytes (32 and 16 of padding)
shared int8_t Ws[BM * KS];  // one 32-block of k: [row][k]
shared int8_t Xs[BN * KS];  // [token][k]
shared float Wd[BM], Xd[BN];
shared int Cs[8u * 32u * 32u];  // each subgroup's sums, [row][token]

uint s4(uint u) { return (u + 0x78787878u) ^ 0x80808080u; }  // q4_0 nibbles (q + 8) to signed bytes q
// A block sum as a float, exactly (gemm_i8.comp's i2f: no quarter-rate int-to-float conversion).
float i2f(int s) {
  precise float f = intBitsToFloat(0x4B400000 + s) - 12582912.0f;
  return f;
}

void put4(uint at, uint w, bool x) {
  [[unroll]] for (uint c = 0u; c < 4u; ++c) {
    const int8_t v = int8_t(bitfieldExtract(int(w), int(8u * c), 8));
    if (x) Xs[at + c] = v;
    else Ws[at + c] = v;
  }
}

void main() {
  const uint tid = gl_LocalInvocationID.x, sg = gl_SubgroupID, lane = gl_SubgroupInvocationID;
  const uint r0 = gl_WorkGroupID.y * BM, t0 = gl_WorkGroupID.x * BN;  // as the host dispatches (token tiles in x)
  const uint nb = pc.cols / 32u;
  const uint rs = (sg % 4u) * 32u, ts = (sg / 4u) * 32u;  // this subgroup's rows and tokens in the tile
#if TYPE == T_Q8_0S
  const uint64_t scales = uint64_t(pc.cols);
#else
  const uint64_t scales = uint64_t(pc.cols / 2u);
#endif
  // Loads of a block: weights, row tid / 2, half tid % 2 (q8_0 16 bytes, q4_0 8 bytes: 16
  // nibbles); activations, token tid / 2, half tid % 2 (tid < 128); the scales of row tid
  // (tid < 128) and of token tid - 128 (128 <= tid < 192).
  const uint lr = tid / 2u, lh = tid % 2u;
  const uint64_t wrow = pc.w + uint64_t(min(r0 + lr, pc.rows - 1u)) * pc.row_bytes;
  const uint64_t xrow = pc.xq + uint64_t(min(t0 + (lr % 64u), pc.n - 1u)) * pc.cols;
  const uint64_t srow = pc.w + uint64_t(min(r0 + tid % 128u, pc.rows - 1u)) * pc.row_bytes + scales;
  const uint64_t drow = pc.xd + uint64_t(min(t0 + tid % 64u, pc.n - 1u)) * nb * 4u;

  float acc[32];
  [[unroll]] for (uint i = 0u; i < 32u; ++i) acc[i] = 0.0f;
  const icoopmatNV<32, gl_ScopeSubgroup, 16, 8> zero = icoopmatNV<32, gl_ScopeSubgroup, 16, 8>(0);

  for (uint b = 0u; b < nb; ++b) {
#if TYPE == T_Q8_0S
    const uvec4 gw = V4U(wrow + uint64_t(b) * 32u + lh * 16u).v[0];
#else
    const uvec2 gw = U2(wrow + uint64_t(b) * 16u + lh * 8u).v[0];
#endif
    const uvec4 gx = tid < 128u ? V4U(xrow + uint64_t(b) * 32u + lh * 16u).v[0] : uvec4(0u);
    const float gd = tid < 128u ? h2f(rd16(srow + uint64_t(b) * 2u)) : tid < 192u ? F32(drow).v[b] : 0.0f;
    barrier();  // the last block's reads are done
#if TYPE == T_Q8_0S
    [[unroll]] for (uint c = 0u; c < 4u; ++c) put4(lr * KS + lh * 16u + 4u * c, gw[c], false);
#else
    // Bytes 8h..8h+7: elements 8h.. in the low nibbles, 16+8h.. in the high ones.
    [[unroll]] for (uint c = 0u; c < 2u; ++c) {
      put4(lr * KS + lh * 8u + 4u * c, s4(gw[c] & 0x0F0F0F0Fu), false);
      put4(lr * KS + 16u + lh * 8u + 4u * c, s4((gw[c] >> 4) & 0x0F0F0F0Fu), false);
    }
#endif
    if (tid < 128u) {
      [[unroll]] for (uint c = 0u; c < 4u; ++c) put4(lr * KS + lh * 16u + 4u * c, gx[c], true);
      Wd[tid] = gd;
    } else if (tid < 192u) {
      Xd[tid - 128u] = gd;
    }
    barrier();
    icoopmatNV<8, gl_ScopeSubgroup, 16, 32> a[2];
    icoopmatNV<8, gl_ScopeSubgroup, 32, 8> x[4];
    [[unroll]] for (uint i = 0u; i < 2u; ++i) coopMatLoadNV(a[i], Ws, (rs + 16u * i) * KS, KS, false);
    [[unroll]] for (uint j = 0u; j < 4u; ++j) coopMatLoadNV(x[j], Xs, (ts + 8u * j) * KS, KS, true);
    [[unroll]] for (uint i = 0u; i < 2u; ++i)
      [[unroll]] for (uint j = 0u; j < 4u; ++j) {
        icoopmatNV<32, gl_ScopeSubgroup, 16, 8> s = coopMatMulAddNV(a[i], x[j], zero);
        coopMatStoreNV(s, Cs, sg * 1024u + 16u * i * 32u + 8u * j, 32u, false);
      }
    subgroupMemoryBarrierShared();
    subgroupBarrier();
    const float dx = Xd[ts + lane];
    [[unroll]] for (uint r = 0u; r < 32u; ++r) {
      precise float sc = Wd[rs + r] * dx;
      precise float a = fma(i2f(Cs[sg * 1024u + r * 32u + lane]), sc, acc[r]);  // as gemm_i8.comp's
      acc[r] = a;
    }
  }
  const uint t = t0 + ts + lane;
  if (t < pc.n)
    [[unroll]] for (uint r = 0u; r < 32u; ++r) {
      const uint row = r0 + rs + r;
      if (row >= pc.rows) continue;
      F32 yp = F32(pc.y + (uint64_t(t) * pc.rows + row) * 4u);
      yp.v[0] = (pc.flags & 1u) != 0u ? yp.v[0] + acc[r] : acc[r];
    }
}
