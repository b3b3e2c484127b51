// Prefill of f16 weights on NVIDIA's workgroup-scope cooperative matrices
// (VK_NV_cooperative_matrix2): the same product as gemm_f16c.comp, y[t][r] = (W[r] . hi[t]
// (+ W[r] . lo[t])) * inv[t] over the halves f16_split / f16_round wrote, but each BM x BN tile
// is one matrix of the whole workgroup and its loads are tensor loads straight from memory: the
// driver stages them through shared memory and spreads the products over the subgroups itself,
// with what Vulkan otherwise lacks (asynchronous copies, more than 48 KB a workgroup). This is
// the path llama.cpp's Vulkan build takes on NVIDIA (its *_cm2 shaders); 64 of k a stage and
// 128 x 128 / 64 x 64 tiles as its f16 ones, and its largest, 128 x 256 (X, F16C=cm2x: pp512's
// matrices a wave or less on a large GPU; slower here). Rows, tokens and k past the ends read
// zeros (clamp-to-constant layouts) and are not stored; a whole tile takes unclamped layouts
// and an unrolled loop instead (its fast path, which is what made these tiles pay: H100 F16
// pp512 33.8k -> 50.3k t/s). The sums' order is the driver's, so the result is held to float64
// numpy, not to gemm_f16c's bits.
// QT=40 / 41 (gemm_f16mq40* / q41*: q8 mode's q8_0 / q4_0 in the split layout, with
// DASLLAMA_VULKAN_Q8CM2=1): W's tiles decoded in the tensor load itself (a decode function a
// 16-byte block of quants, where the layout's block stride puts it, and its 32-block's f16
// scale after the row's quants), each weight d * q rounded to f16 to nearest even (gguf-py's
// decoded value through numpy's f16), x rounded once (f16_round): llama.cpp's q8_0 / q4_0
// *_cm2 matmuls, in place of q8 mode's int8 tiles.
// Needs GL_NV_cooperative_matrix2 in the compiler (glslang 15): vulkan/CMakeLists.txt builds
// these variants only where the one it finds has it, and the backend takes them only where the
// device offers workgroup scope, flexible dimensions, tensor addressing and per-element
// operations (and block loads, for QT) for f16 x f16 -> f32 at this workgroup size
// (DASLLAMA_VULKAN_COOPMAT2=1, DASLLAMA_VULKAN_F16C=cm2*).
#version 450
#extension GL_GOOGLE_include_directive : require  // (glslangValidator; glslc has it on)
#include "common.glsl"
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
#extension GL_EXT_shader_16bit_storage : require
#extension GL_EXT_shader_explicit_arithmetic_types_int32 : require
#extension GL_KHR_memory_scope_semantics : require
#extension GL_KHR_cooperative_matrix : require
#extension GL_NV_cooperative_matrix2 : require

#ifndef BM
#define BM 128
#endif
#ifndef BN
#define BN 128
#endif
#ifndef BK
#define BK 64
#endif
#ifndef LO  // 0: x rounded to f16 once (q8 mode, f16_round), one product
#define LO 1
#endif
#ifndef NTH
#define NTH 256
#endif
#ifndef UNROLL  // k stages a pass of the fast path's loop (llama.cpp's *_cm2: 8)
#define UNROLL 8
#endif

layout(local_size_x = NTH) in;
// gemm_f16c.comp's constants (the backend fills one struct for both).
layout(push_constant, std430) uniform PC {
  uint64_t w, xh, xl, inv, y;
  uint64_t row_bytes;
  uint rows, cols, n, ys;
} pc;

layout(buffer_reference, std430, buffer_reference_align = 16) buffer H16 { float16_t v[]; };

#ifdef QT
// A row's f16 scale of 32-block kb: after its quants (cols bytes for q8_0, cols / 2 for q4_0).
// Each weight is q * d as one f16 product (llama.cpp's *_cm2 decoders' form): q and d are exact
// in f16 and q * d exact in f32, so the product rounded to nearest even is gguf-py's decoded
// value through numpy's f16. (That rounding done in integer ops, f2h, a weight at a time, held
// these tiles to 8-9k t/s of pp512.)
layout(buffer_reference, std430, buffer_reference_align = 2) buffer S16 { float16_t v[]; };
float16_t block_scale(uint row, uint kb) {
  return S16(pc.w + uint64_t(row) * pc.row_bytes + uint64_t(QT == 40 ? pc.cols : pc.cols / 2u)).v[kb];
}
// A decode block is a row's 16 bytes (rows are 16-aligned, so the layout's stride in blocks is
// whole): 16 of q8_0's quants (half a 32-block), or 32 of q4_0's nibbles (a whole one).
layout(buffer_reference, std430, buffer_reference_align = 16) buffer QBlk { uvec4 q; };
#if QT == 40
float16_t decode_q(const in QBlk b, const in uint32_t bc[2], const in uint32_t ci[2]) {
  const uint i = ci[1];
  const uint wd = b.q[i >> 2u];
  return float16_t(bitfieldExtract(int(wd), int((i & 3u) * 8u), 8)) * block_scale(bc[0], bc[1] / 2u);
}
#else
float16_t decode_q(const in QBlk b, const in uint32_t bc[2], const in uint32_t ci[2]) {
  const uint i = ci[1], j = i & 15u;  // elements 0-15: byte j's low nibble; 16-31: its high one
  const uint by = (b.q[j >> 2u] >> ((j & 3u) * 8u)) & 0xffu;
  return float16_t(int(i < 16u ? by & 15u : by >> 4u) - 8) * block_scale(bc[0], bc[1]);
}
#endif
#endif
layout(buffer_reference, std430, buffer_reference_align = 4) buffer Y32 { float v[]; };  // (y may be a slice's)

// Each token's column scaled by its 1 / s (f16_split's power of two; f16_round's 1).
float scale_token(const in uint32_t r, const in uint32_t c, const in float e, const in uint32_t t0) {
  const uint t = t0 + c;
  return t < pc.n ? e * F32(pc.inv).v[t] : e;
}

void main() {
  const uint t0 = gl_WorkGroupID.x * BN, r0 = gl_WorkGroupID.y * BM;
  tensorLayoutNV<2, gl_CooperativeMatrixClampModeConstantNV> lw =
      createTensorLayoutNV(2, gl_CooperativeMatrixClampModeConstantNV);
  lw = setTensorLayoutDimensionNV(lw, pc.rows, pc.cols);
#ifdef QT
  // Blocks of 1 x 16 (q8_0) or 1 x 32 (q4_0) elements, 16 bytes each; the stride in blocks.
  lw = setTensorLayoutBlockSizeNV(lw, 1, QT == 40 ? 16u : 32u);
  lw = setTensorLayoutStrideNV(lw, uint(pc.row_bytes / 16u), 1);
#else
  lw = setTensorLayoutStrideNV(lw, uint(pc.row_bytes / 2), 1);
#endif
  tensorLayoutNV<2, gl_CooperativeMatrixClampModeConstantNV> lx =
      createTensorLayoutNV(2, gl_CooperativeMatrixClampModeConstantNV);
  lx = setTensorLayoutDimensionNV(lx, pc.n, pc.cols);
  lx = setTensorLayoutStrideNV(lx, pc.cols, 1);
  // x is [token][k]: the B operand (k x tokens) is its transpose, as is y ([token][row]) of the
  // accumulator (rows x tokens).
  tensorViewNV<2, false, 1, 0> tr = createTensorViewNV(2, false, 1, 0);
  H16 w = H16(pc.w), xh = H16(pc.xh);
#if LO
  H16 xl = H16(pc.xl);
#endif
  coopmat<float, gl_ScopeWorkgroup, BM, BN, gl_MatrixUseAccumulator> acc =
      coopmat<float, gl_ScopeWorkgroup, BM, BN, gl_MatrixUseAccumulator>(0.0);
#ifdef QT
#define LOAD_A(LW, k) coopMatLoadTensorNV(a, w.v, 0, sliceTensorLayoutNV(LW, r0, BM, k, BK), decode_q);
#else
#define LOAD_A(LW, k) coopMatLoadTensorNV(a, w.v, 0, sliceTensorLayoutNV(LW, r0, BM, k, BK));
#endif
#if LO
#define MMA_LO(LX, k)                                                                              \
  coopMatLoadTensorNV(b, xl.v, 0, sliceTensorLayoutNV(LX, t0, BN, k, BK), tr);                      \
  acc = coopMatMulAdd(a, b, acc);
#else
#define MMA_LO(LX, k)
#endif
#define STAGE(LW, LX, k)                                                                           \
  {                                                                                                \
    coopmat<float16_t, gl_ScopeWorkgroup, BM, BK, gl_MatrixUseA> a;                                \
    coopmat<float16_t, gl_ScopeWorkgroup, BK, BN, gl_MatrixUseB> b;                                \
    LOAD_A(LW, k)                                                                                  \
    coopMatLoadTensorNV(b, xh.v, 0, sliceTensorLayoutNV(LX, t0, BN, k, BK), tr);                    \
    acc = coopMatMulAdd(a, b, acc);                                                                \
    MMA_LO(LX, k)                                                                                  \
  }
  if (r0 + BM <= pc.rows && t0 + BN <= pc.n && pc.cols % (BK * UNROLL) == 0) {
    // The tile wholly inside (llama.cpp's fast path): layouts without clamping, so the loads
    // need no bounds, and UNROLL stages a pass, so the driver can pipeline their loads. The
    // same products in the same order as the loop below.
    tensorLayoutNV<2> fw = createTensorLayoutNV(2);
    fw = setTensorLayoutDimensionNV(fw, pc.rows, pc.cols);
#ifdef QT
    fw = setTensorLayoutBlockSizeNV(fw, 1, QT == 40 ? 16u : 32u);
    fw = setTensorLayoutStrideNV(fw, uint(pc.row_bytes / 16u), 1);
#else
    fw = setTensorLayoutStrideNV(fw, uint(pc.row_bytes / 2) & ~7u, 1);  // (16-byte rows: a hint)
#endif
    tensorLayoutNV<2> fx = createTensorLayoutNV(2);
    fx = setTensorLayoutDimensionNV(fx, pc.n, pc.cols);
    fx = setTensorLayoutStrideNV(fx, pc.cols & ~7u, 1);
    for (uint k0 = 0; k0 < pc.cols; k0 += BK * UNROLL)
      [[unroll]] for (uint j = 0; j < UNROLL; ++j) STAGE(fw, fx, k0 + j * BK)
  } else {
    for (uint k = 0; k < pc.cols; k += BK) STAGE(lw, lx, k)
  }
  coopMatPerElementNV(acc, acc, scale_token, t0);
  tensorLayoutNV<2, gl_CooperativeMatrixClampModeConstantNV> ly =
      createTensorLayoutNV(2, gl_CooperativeMatrixClampModeConstantNV);
  ly = setTensorLayoutDimensionNV(ly, pc.n, pc.rows);
  ly = setTensorLayoutStrideNV(ly, pc.ys, 1);
  coopMatStoreTensorNV(acc, Y32(pc.y).v, 0, sliceTensorLayoutNV(ly, t0, BN, r0, BM), tr);
}
