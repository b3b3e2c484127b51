// q8 mode's prefill attention over an f16 cache on NVIDIA's workgroup-scope cooperative matrices
// (VK_NV_cooperative_matrix2): flash_cm.comp's walk (BR query rows of one head a workgroup, the
// keys BC at a time, FlashAttention-2's online softmax), but every tile is one matrix of the whole
// workgroup and nothing goes through shared memory by hand. The scores S = (Q * scale) K^T stay in
// accumulators; the row maxima come from row reductions, the masks and exponentials from
// per-element operations, and the probabilities are converted to an A operand in registers for
// P V. flash_cm.comp instead wrote the scores to shared memory for two lanes a row to take the
// softmax, and read them back, behind four barriers a tile of 32 keys: 132 us a layer of an H100
// pp512, about 8 TFLOPS; this takes 51 (64-row tiles). This is the form of llama.cpp's
// flash_attn_cm2.
// K and V tiles load straight from the paged cache through tensor layouts: a tile of BC keys lies
// in one page (the backend takes this shader only where a page holds a multiple of BC rows), so
// its rows are a plain strided matrix there. A tile past the last key clamps (zeros), and its
// missing keys are masked.
// Roundings as flash_cm.comp: Q * scale and the probabilities to f16 (as llama.cpp's flash
// attention rounds them), the sums of the rounded probabilities (a product with a matrix of
// ones), the maxima, sums and O in f32. The order of the sums is the driver's: held to float64
// numpy (test_paged_attention_q8_mode), not to flash_cm's bits.
// HD: the head size (64, 128 or 256); BR x BC: query rows x keys a tile (the backend's: 32 x 64,
// 64 x 64 at 128, 32 x 32 at 256). Needs glslang 15, the
// device's workgroup scope, tensor addressing, per-element operations, reductions and
// conversions (I8Caps::cm2's bit 8).
#version 450
#extension GL_GOOGLE_include_directive : require  // (glslangValidator; glslc has it on)
#include "common.glsl"
#include "kv.glsl"
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
#extension GL_EXT_shader_16bit_storage : require
#extension GL_EXT_shader_explicit_arithmetic_types_int32 : require
#extension GL_KHR_memory_scope_semantics : require
#extension GL_KHR_cooperative_matrix : require
#extension GL_NV_cooperative_matrix2 : require
#extension GL_KHR_shader_subgroup_arithmetic : require

#ifndef HD
#define HD 64
#endif
#ifndef BR
#define BR 64
#endif
#ifndef BC
#define BC 64
#endif
#define NTH 128

layout(local_size_x = NTH) in;
// flash_cm.comp's constants (the backend fills one struct for both).
layout(push_constant, std430) uniform PC {
  uint64_t q, base, pages, q_pos, out_, sinks;
  uint64_t args;  // n_kv_ < 0: n_kv is args[-n_kv_ - 1]
  uint page_bytes, k_off, v_off, row_bytes;
  int q_stride, out_stride, n_kv_;
  uint heads;  // n_heads | n_kv_heads << 16
  uint shape;  // head_dim | page_shift << 16 | kvtype << 24
  int window;
  float scale, softcap;
  int n_tok;
} pc;

#define NH int(pc.heads & 0xffffu)
#define NKVH int(pc.heads >> 16)
#define PSHIFT int((pc.shape >> 16) & 0xffu)
#define NKV (pc.n_kv_ >= 0 ? pc.n_kv_ : I32(pc.args).v[-pc.n_kv_ - 1])
#define NEG_INF uintBitsToFloat(0xff800000u)
// M's start: finite, so a row that has seen only masked keys gets exp(-inf - M) = 0, not nan.
#define M_START uintBitsToFloat(0xfeffffffu)  // -FLT_MAX / 2

layout(buffer_reference, std430, buffer_reference_align = 16) buffer H16 { float16_t v[]; };

#define SMAT coopmat<float, gl_ScopeWorkgroup, BR, BC, gl_MatrixUseAccumulator>
#define OMAT coopmat<float, gl_ScopeWorkgroup, BR, HD, gl_MatrixUseAccumulator>
#define PMAT coopmat<float16_t, gl_ScopeWorkgroup, BR, BC, gl_MatrixUseA>

// Each row's query position (every column), -1 past the last row: all its keys masked.
float row_pos(const in uint32_t r, const in uint32_t c, const in float e, const in uint32_t t0) {
  const int t = int(t0 + r);
  return t < pc.n_tok ? float(I32(pc.q_pos).v[t]) : -1.0f;
}
// Key j0 + c of row r, at position p (exact in f32 below 2^24): past the causal edge, the
// window or the last key, -inf.
float mask_key(const in uint32_t r, const in uint32_t c, const in float s, const in float p, const in uint32_t j0,
               const in uint32_t hi) {
  const float j = float(j0 + c);
  const bool ok = j0 + c < hi && j <= p && (pc.window <= 0 || j > p - float(pc.window));
  return ok ? s : NEG_INF;
}
float max_of(const in float a, const in float b) { return max(a, b); }
float keep_first(const in float a, const in float b) { return a; }  // a row's value across its columns
float max_el(const in uint32_t r, const in uint32_t c, const in float a, const in float b) { return max(a, b); }
float exp_el(const in uint32_t r, const in uint32_t c, const in float a) { return exp(a); }

shared int red[4 * NTH];  // each subgroup's lo, hi, min and max position

void main() {
  const uint tid = gl_LocalInvocationID.x;
  const int h = int(gl_WorkGroupID.y), t0 = int(gl_WorkGroupID.x * BR);
  const int n_tok = pc.n_tok, n_kv = NKV;
  const int kvh = h / (NH / NKVH);

  // The workgroup's keys: the union of its rows' (window, causal) ranges, a row a lane; and the
  // least and greatest position, which say which tiles need no mask.
  int lo = 0x7fffffff, hi = 0, pmin = 0x7fffffff, pmax = -1;
  for (uint r = tid; r < BR; r += NTH)
    if (t0 + int(r) < n_tok) {
      const int p = I32(pc.q_pos).v[t0 + int(r)];
      hi = max(hi, min(n_kv, p + 1));
      lo = min(lo, pc.window > 0 ? max(0, p - pc.window + 1) : 0);
      pmin = min(pmin, p), pmax = max(pmax, p);
    }
  lo = subgroupMin(lo), hi = subgroupMax(hi), pmin = subgroupMin(pmin), pmax = subgroupMax(pmax);
  if (subgroupElect()) {
    const uint g = 4u * gl_SubgroupID;
    red[g] = lo, red[g + 1u] = hi, red[g + 2u] = pmin, red[g + 3u] = pmax;
  }
  barrier();
  for (uint g = 0u; g < gl_NumSubgroups; ++g)
    lo = min(lo, red[4u * g]), hi = max(hi, red[4u * g + 1u]), pmin = min(pmin, red[4u * g + 2u]),
    pmax = max(pmax, red[4u * g + 3u]);

  // Q * scale, rounded to f16 once: rows past the last read zeros.
  tensorLayoutNV<2, gl_CooperativeMatrixClampModeConstantNV> lq =
      createTensorLayoutNV(2, gl_CooperativeMatrixClampModeConstantNV);
  lq = setTensorLayoutDimensionNV(lq, uint(n_tok), uint(pc.q_stride));
  lq = setTensorLayoutStrideNV(lq, uint(pc.q_stride), 1);
  OMAT qf;
  coopMatLoadTensorNV(qf, F32(pc.q).v, 0, sliceTensorLayoutNV(lq, uint(t0), BR, uint(h) * HD, HD));
  qf = qf * pc.scale;
  const coopmat<float16_t, gl_ScopeWorkgroup, BR, HD, gl_MatrixUseA> qa =
      coopmat<float16_t, gl_ScopeWorkgroup, BR, HD, gl_MatrixUseA>(qf);

  SMAT pos = SMAT(0.0f);
  coopMatPerElementNV(pos, pos, row_pos, uint(t0));
  const coopmat<float16_t, gl_ScopeWorkgroup, BC, BC, gl_MatrixUseB> ones =
      coopmat<float16_t, gl_ScopeWorkgroup, BC, BC, gl_MatrixUseB>(1.0);
  SMAT m = SMAT(M_START), l = SMAT(0.0f);
  OMAT o = OMAT(0.0f);

  // A page's rows of this head's keys (values): a [row][dim] matrix of row_bytes / 2 halves a
  // row (16-byte rows and offsets: flash_cm_pick). A whole tile's layout is unclamped.
  const uint rs = pc.row_bytes / 2u;
  const uint koff = pc.k_off + uint(kvh) * HD * 2u, voff = pc.v_off + uint(kvh) * HD * 2u;
  tensorLayoutNV<2> lw = createTensorLayoutNV(2);
  lw = setTensorLayoutDimensionNV(lw, BC, HD);
  lw = setTensorLayoutStrideNV(lw, rs & ~7u, 1);
  tensorViewNV<2, false, 1, 0> tr = createTensorViewNV(2, false, 1, 0);
  const int first = lo >= hi ? hi : lo - lo % BC;
  for (int j0 = first; j0 < hi; j0 += BC) {
    const uint64_t rb = kv_row_at(pc.base, pc.pages, pc.page_bytes, pc.row_bytes, PSHIFT, j0);
    const bool whole = j0 + BC <= hi;
    coopmat<float16_t, gl_ScopeWorkgroup, HD, BC, gl_MatrixUseB> kt;  // K^T: dims x keys
    coopmat<float16_t, gl_ScopeWorkgroup, BC, HD, gl_MatrixUseB> v;
    tensorLayoutNV<2, gl_CooperativeMatrixClampModeConstantNV> lc =
        createTensorLayoutNV(2, gl_CooperativeMatrixClampModeConstantNV);
    lc = setTensorLayoutDimensionNV(lc, uint(hi - j0), HD);
    lc = setTensorLayoutStrideNV(lc, rs, 1);
    if (whole)
      coopMatLoadTensorNV(kt, H16(rb + koff).v, 0, sliceTensorLayoutNV(lw, 0, BC, 0, HD), tr);
    else
      coopMatLoadTensorNV(kt, H16(rb + koff).v, 0, sliceTensorLayoutNV(lc, 0, BC, 0, HD), tr);
    SMAT s = SMAT(0.0f);
    s = coopMatMulAdd(qa, kt, s);
    if (pc.softcap > 0.0f)
      [[unroll]] for (int e = 0; e < s.length(); ++e) s[e] = pc.softcap * tanh_safe(s[e] / pc.softcap);
    // Tiles wholly below every row's causal edge and inside every row's window skip the mask.
    if (!whole || j0 + BC - 1 > pmin || (pc.window > 0 && j0 + pc.window <= pmax))
      coopMatPerElementNV(s, s, mask_key, pos, uint(j0), uint(hi));

    SMAT mx, mold = m, p, em;
    coopMatReduceNV(mx, s, gl_CooperativeMatrixReduceRowNV, max_of);
    coopMatPerElementNV(m, mx, max_el, mold);
    coopMatPerElementNV(p, s - m, exp_el);
    coopMatPerElementNV(em, mold - m, exp_el);
    const PMAT pa = PMAT(p);
    SMAT sum = SMAT(0.0f);
    sum = coopMatMulAdd(pa, ones, sum);
    l = em * l + sum;
    OMAT emo;  // each row's correction across O's columns
    coopMatReduceNV(emo, em, gl_CooperativeMatrixReduceRowNV, keep_first);
    o = o * emo;
    // (V's load and the next tile's K issued before the softmax measured slower: H100 F16 pp512
    // 59,207 -> 58,419.)
    if (whole)
      coopMatLoadTensorNV(v, H16(rb + voff).v, 0, sliceTensorLayoutNV(lw, 0, BC, 0, HD));
    else
      coopMatLoadTensorNV(v, H16(rb + voff).v, 0, sliceTensorLayoutNV(lc, 0, BC, 0, HD));
    o = coopMatMulAdd(pa, v, o);
  }

  // 1 / L of each row (the sink joining the denominator as flash_cm's does), then O's rows out.
  OMAT inv, mo;
  coopMatReduceNV(inv, l, gl_CooperativeMatrixReduceRowNV, keep_first);
  coopMatReduceNV(mo, m, gl_CooperativeMatrixReduceRowNV, keep_first);
  const float sink = pc.sinks != 0ul ? F32(pc.sinks).v[h] : 0.0f;
  [[unroll]] for (int e = 0; e < inv.length(); ++e) {
    float f = 1.0f, L = inv[e];
    if (pc.sinks != 0ul) {
      const float M2 = max(mo[e], sink);
      f = exp(mo[e] - M2);
      L = L * f + exp(sink - M2);
    }
    inv[e] = L > 0.0f ? f / L : 0.0f;
  }
  o = o * inv;
  tensorLayoutNV<2, gl_CooperativeMatrixClampModeConstantNV> lo_ =
      createTensorLayoutNV(2, gl_CooperativeMatrixClampModeConstantNV);
  lo_ = setTensorLayoutDimensionNV(lo_, uint(n_tok), uint(pc.out_stride));
  lo_ = setTensorLayoutStrideNV(lo_, uint(pc.out_stride), 1);
  coopMatStoreTensorNV(o, F32(pc.out_).v, 0, sliceTensorLayoutNV(lo_, uint(t0), BR, uint(h) * HD, HD));
}
