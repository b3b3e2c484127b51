// Prefill of f16 weights on NVIDIA's f16 cooperative matrices (VK_NV_cooperative_matrix,
// f16 x f16 -> f32, 16 x TN x 16: TN 8 is one mma.sync m16n8k16, as CUDA's mma_f16h_k), keeping
// f32 activations: f16_split.comp wrote each token's x * s as two f16 halves hi + lo and 1 / s,
// so y[t][r] = (W[r] . hi[t] + W[r] . lo[t]) / s[t], both products summed in f32 by the tensor
// cores (f16 weights are exact operands), which gives the f32 dot product to about 2^-22
// relative. A workgroup per BM = 16 MT WR rows x 64 tokens, WR x 2 subgroups of 16 MT rows x 32
// tokens (MT 2: WR 4, 256 invocations, or WR 2, 128: CUDA's 64 x 64 tiles, for matrices whose
// 128-row tiles leave a GPU's cores without a second workgroup; MT 4, WR 2: 128 x 64 tiles of
// 4 subgroups, fewer shared-memory reads a product), BK of k a stage in shared memory (weights and both halves, each row's k padded by
// 16 bytes so eight rows' 16-byte reads fall on distinct banks), the next stage's global loads
// issued before this one's math; with BK 32 two stages in shared memory (one barrier a stage),
// with BK 64 one (two would pass the 48 KB a workgroup gets). Subgroups of 32 lanes (the backend
// picks this shader only there). Which row and token each of a lane's sums
// is belongs to the driver: a matrix of the product's type loaded from their positions says
// (gemm_i8.comp's COOP), so each lane scales and stores its own sums. Rows and tokens past the
// end read the last one and are not stored; k past cols (cols % 8 == 0: the backend's check)
// reads zeros.
// COOP=0 (gemm_f16e, gemm_f16eh: DASLLAMA_VULKAN_F16C=emu): the same split, stages and stores
// with the products in plain f32 FMAs, so devices without cooperative matrices (lavapipe, CI)
// check everything but the matrices themselves.
#version 450
#include "common.glsl"
#ifndef COOP
#define COOP 1
#endif
#if COOP
#extension GL_NV_cooperative_matrix : require
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
#extension GL_KHR_memory_scope_semantics : require
#extension GL_KHR_shader_subgroup_basic : require
#endif

#ifndef BK
#define BK 32
#endif
#ifndef TN
#define TN 8
#endif
#ifndef WR
#define WR 4
#endif
#ifndef MT
#define MT 2
#endif
#ifndef LO  // 0 (q8 mode, weights not exact): x rounded to f16 once (hi alone), one product
#define LO 1
#endif
#define NTH (64 * WR)  // invocations: WR x 2 subgroups of 32
#ifndef NBUF  // stages in shared memory (gemm_f16e: 1, to fit lavapipe's 32 KB)
#if BK == 32
#define NBUF 2
#else
#define NBUF 1
#endif
#endif

layout(local_size_x = NTH) in;
layout(push_constant, std430) uniform PC {
  uint64_t w, xh, xl, inv, y;
  uint64_t row_bytes;
  uint rows, cols, n, ys;  // ys: y's row stride (rows, or the whole matrix's where these rows are a slice)
} pc;

const uint BM = 16u * MT * WR, BN = 64u;
const uint CK = BK / 8u;  // 16-byte chunks (8 halves) of a row's k a stage
const uint RS = CK + 1u;  // a row's stride in uvec4s: 80 bytes (BK 32) or 144 (BK 64)
const uint NW = BM * CK / NTH, NX = BN * CK / NTH;  // chunks an invocation loads: weights, each half
const uint WB = BM * RS, XB = BN * RS;              // a stage's buffer, in uvec4s
shared uvec4 Wf[NBUF * WB];  // [stage][row][k], flat for coopMatLoadNV (offsets and strides in uvec4s)
shared uvec4 Hf[NBUF * XB];  // [stage][token][k]
#if LO
shared uvec4 Lf[NBUF * XB];
#endif
#if COOP
shared float Idx[16u * TN];  // positions r * TN + c, loaded as a product's type
fcoopmatNV<32, gl_ScopeSubgroup, 16, TN> sum_t;  // its length() sizes a lane's share of a product
#define L (sum_t.length())
#else
// The 8 halves of a chunk as floats.
void unpack8(uvec4 u, out float f[8]) {
  [[unroll]] for (uint i = 0u; i < 4u; ++i) {
    const vec2 v = unpackHalf2x16(u[i]);
    f[2u * i] = v.x, f[2u * i + 1u] = v.y;
  }
}
#endif

void main() {
  const uint tid = gl_LocalInvocationID.x;
  const uint r0 = gl_WorkGroupID.y * BM, t0 = gl_WorkGroupID.x * BN;  // token tiles of one row tile adjacent (x)
  const uint kb = 0u, ke = pc.cols;
  // Chunk p = tid + NTH i of a stage: row (or token) p / CK, k chunk p % CK (adjacent invocations
  // read a row's adjacent 16 bytes).
  uint64_t wp[NW], xp[NX];
  [[unroll]] for (uint i = 0u; i < NW; ++i) {
    const uint p = tid + NTH * i;
    wp[i] = pc.w + uint64_t(min(r0 + p / CK, pc.rows - 1u)) * pc.row_bytes + uint64_t(p % CK) * 16u;
  }
  [[unroll]] for (uint i = 0u; i < NX; ++i) {
    const uint p = tid + NTH * i;
    xp[i] = (uint64_t(min(t0 + p / CK, pc.n - 1u)) * pc.cols) * 2u + uint64_t(p % CK) * 16u;
  }

#if COOP
  const uint sg = gl_SubgroupID, rs = (sg % WR) * (16u * MT), ts = (sg / WR) * 32u;  // this subgroup's rows and tokens
  for (uint i = tid; i < 16u * TN; i += NTH) Idx[i] = float(i);
  barrier();
  fcoopmatNV<32, gl_ScopeSubgroup, 16, TN> im;
  coopMatLoadNV(im, Idx, 0, TN, false);
  uint er[L], ec[L];
  [[unroll]] for (int e = 0; e < L; ++e) er[e] = uint(im[e]) / TN, ec[e] = uint(im[e]) % TN;

  const uint NJ = 32u / TN;
  fcoopmatNV<32, gl_ScopeSubgroup, 16, TN> acc[MT][NJ];
  [[unroll]] for (uint i = 0u; i < MT; ++i)
    [[unroll]] for (uint j = 0u; j < NJ; ++j) acc[i][j] = fcoopmatNV<32, gl_ScopeSubgroup, 16, TN>(0.0f);
#else
  // Row lr, tokens tg * TPI ..: TPI sums an invocation.
  const uint TPI = 16u * MT, lr = tid % BM, tg = tid / BM;
  float acc[TPI];
  [[unroll]] for (uint j = 0u; j < TPI; ++j) acc[j] = 0.0f;
#endif

  // A stage's global loads, held in registers until stored.
  uvec4 gw0[NW], gh0[NX], gl0[NX];
#if LO
#define LSTORE(at, v) Lf[at] = v
#else
#define LSTORE(at, v)
#endif
#define LOAD(k0, gw, gh, glo)                                                                      \
  {                                                                                                \
    [[unroll]] for (uint i = 0u; i < NW; ++i) {                                                    \
      const uint k = (k0) + ((tid + NTH * i) % CK) * 8u;                                           \
      gw[i] = k < pc.cols ? V4U(wp[i] + uint64_t(k0) * 2u).v[0] : uvec4(0u);                       \
    }                                                                                              \
    [[unroll]] for (uint i = 0u; i < NX; ++i) {                                                    \
      const uint k = (k0) + ((tid + NTH * i) % CK) * 8u;                                           \
      const uint64_t o = xp[i] + uint64_t(k0) * 2u;                                                \
      gh[i] = k < pc.cols ? V4U(pc.xh + o).v[0] : uvec4(0u);                                       \
      if (LO != 0) glo[i] = k < pc.cols ? V4U(pc.xl + o).v[0] : uvec4(0u);                         \
    }                                                                                              \
  }
#define STORE(b, gw, gh, glo)                                                                      \
  {                                                                                                \
    [[unroll]] for (uint i = 0u; i < NW; ++i) {                                                    \
      const uint p = tid + NTH * i;                                                                \
      Wf[(b) * WB + (p / CK) * RS + p % CK] = gw[i];                                               \
    }                                                                                              \
    [[unroll]] for (uint i = 0u; i < NX; ++i) {                                                    \
      const uint p = tid + NTH * i;                                                                \
      Hf[(b) * XB + (p / CK) * RS + p % CK] = gh[i];                                               \
      LSTORE((b) * XB + (p / CK) * RS + p % CK, glo[i]);                                           \
    }                                                                                              \
  }
#if COOP
#define MATH(wb, xb)                                                                               \
  [[unroll]] for (uint kk = 0u; kk < BK / 16u; ++kk) {                                             \
    fcoopmatNV<16, gl_ScopeSubgroup, 16, 16> a[MT];                                                \
    [[unroll]] for (uint i = 0u; i < MT; ++i)                                                      \
      coopMatLoadNV(a[i], Wf, (wb) + (rs + 16u * i) * RS + 2u * kk, RS, false);                    \
    [[unroll]] for (uint j = 0u; j < NJ; ++j) {                                                    \
      /* B is k x tokens: a token's k adjacent, so column-major over the [token][k] rows. */       \
      fcoopmatNV<16, gl_ScopeSubgroup, 16, TN> bh;                                                 \
      coopMatLoadNV(bh, Hf, (xb) + (ts + TN * j) * RS + 2u * kk, RS, true);                        \
      MATH_LO(xb, j, kk)                                                                           \
      [[unroll]] for (uint i = 0u; i < MT; ++i) {                                                  \
        MMA_LO(i, j)                                                                               \
        acc[i][j] = coopMatMulAddNV(a[i], bh, acc[i][j]);                                          \
      }                                                                                            \
    }                                                                                              \
  }
#if LO
#define MATH_LO(xb, j, kk)                                                                         \
  fcoopmatNV<16, gl_ScopeSubgroup, 16, TN> bl;                                                     \
  coopMatLoadNV(bl, Lf, (xb) + (ts + TN * (j)) * RS + 2u * (kk), RS, true);
#define MMA_LO(i, j) acc[i][j] = coopMatMulAddNV(a[i], bl, acc[i][j]);  /* the small half first, as CUDA's */
#else
#define MATH_LO(xb, j, kk)
#define MMA_LO(i, j)
#endif
#else
// Unrolled: llvmpipe bounds the loop iterations an invocation runs (about 2^16 in all).
#if LO
#define EMU_LO(xb, j, c)                                                                           \
  float l[8];                                                                                      \
  unpack8(Lf[(xb) + (tg * TPI + (j)) * RS + (c)], l);
#define FMA_LO(j, e) acc[j] = fma(w[e], l[e], acc[j]);
#else
#define EMU_LO(xb, j, c)
#define FMA_LO(j, e)
#endif
#define MATH(wb, xb)                                                                               \
  [[unroll]] for (uint c = 0u; c < CK; ++c) {                                                      \
    float w[8];                                                                                    \
    unpack8(Wf[(wb) + lr * RS + c], w);                                                            \
    [[unroll]] for (uint j = 0u; j < TPI; ++j) {                                                   \
      float h[8];                                                                                  \
      unpack8(Hf[(xb) + (tg * TPI + j) * RS + c], h);                                              \
      EMU_LO(xb, j, c)                                                                             \
      [[unroll]] for (uint e = 0u; e < 8u; ++e) {                                                  \
        FMA_LO(j, e)                                                                               \
        acc[j] = fma(w[e], h[e], acc[j]);                                                          \
      }                                                                                            \
    }                                                                                              \
  }
#endif
#if NBUF == 1
#define BARRIER_1 barrier();  // every read of the one buffer done
#else
#define BARRIER_1
#endif

  uint cur = 0u;  // the buffer this stage's math reads
  LOAD(kb, gw0, gh0, gl0)
  STORE(0u, gw0, gh0, gl0)
  barrier();
  for (uint k0 = kb; k0 < ke; k0 += BK) {
    const bool more = k0 + BK < ke;  // (uniform)
    if (more) LOAD(k0 + BK, gw0, gh0, gl0)  // in flight during the math
    MATH(cur * WB, cur * XB)
    if (more) {
      BARRIER_1
      cur = (cur + 1u) % NBUF;  // two buffers: the other one, last read a stage ago (before the barrier below)
      STORE(cur, gw0, gh0, gl0)
    }
    barrier();
  }

#define PUT(R_, T_, V_) F32(pc.y + (uint64_t(T_) * pc.ys + (R_)) * 4u).v[0] = (V_);
#if COOP
  [[unroll]] for (uint j = 0u; j < NJ; ++j) {
    float iv[L];
    [[unroll]] for (int e = 0; e < L; ++e) iv[e] = F32(pc.inv).v[min(t0 + ts + TN * j + ec[e], pc.n - 1u)];
    [[unroll]] for (uint i = 0u; i < MT; ++i)
      [[unroll]] for (int e = 0; e < L; ++e) {
        const uint r = r0 + rs + 16u * i + er[e], t = t0 + ts + TN * j + ec[e];
        if (r >= pc.rows || t >= pc.n) continue;
        PUT(r, t, acc[i][j][e] * iv[e])
      }
  }
#else
  const uint r = r0 + lr;
  if (r < pc.rows)
    [[unroll]] for (uint j = 0u; j < TPI; ++j) {
      const uint t = t0 + tg * TPI + j;
      if (t < pc.n) PUT(r, t, acc[j] * F32(pc.inv).v[t])
    }
#endif
}
