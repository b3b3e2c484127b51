// Prefill attention over an f16 cache in q8 mode on NVIDIA's f16 cooperative matrices (flash2's
// online softmax, FlashAttention-2's tiles): a workgroup takes BR = 16 NSG query rows of one head,
// NSG subgroups of 16 rows, and walks the keys BC at a time (NSG 4, BC 32; head size 256: 2, 16,
// so its tiles fit 48 KB). Each subgroup's scores
// S = (Q * scale) K^T come from 16 x TN x 16 products (Q's rows rounded to f16 once, held as
// matrices for the whole walk; K's f16 rows exact operands), go through shared memory, where two
// lanes a row take its softmax (a lane half the tile's keys; maxima and sums joined by one
// shuffle), round the probabilities to f16 and leave them beside the scores; O (f32 accumulators, 16 x HD a
// subgroup) is rescaled by each row's correction and gains P V from the same products, V's f16
// rows exact. So Q and P are rounded to f16 (11 bits, as llama.cpp's flash attention rounds
// them), everything else is f32 (accumulators, maxima, sums): q8 mode's kind of error, never
// fp32 mode's. The tile's K and V are read in 16-byte units held in registers a tile ahead, as
// flash2's units path reads them. Which row and column each of a lane's accumulator elements is
// belongs to the driver: a matrix of positions loaded as the accumulators' type says
// (gemm_f16c.comp's way). HD: the head size (64, 128 or 256, exactly); TN: 8 or 16.
// COOP=0 (flash_cme*: DASLLAMA_VULKAN_FLASH_CM=emu): the same tiles, roundings and softmax with
// the products in f32 FMAs, a lane's Q row in registers (lavapipe's check, which has no matrices).
#version 450
#include "common.glsl"
#include "kv.glsl"
#extension GL_KHR_shader_subgroup_shuffle : require
#ifndef COOP
#define COOP 1
#endif
#if COOP
#extension GL_NV_cooperative_matrix : require
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
#extension GL_KHR_memory_scope_semantics : require
#extension GL_KHR_shader_subgroup_basic : require
#endif
#ifndef TN
#define TN 8
#endif
#ifndef NSG
#define NSG 4  // subgroups of 32 lanes (16 query rows each)
#endif
#ifndef BCK
#define BCK 32  // keys a tile
#endif
#define NTH (32 * NSG)

layout(local_size_x = NTH) in;
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

const uint BR = 16u * NSG, BC = BCK, HALF = BC / 2u;
const uint RS = HD / 8u + 1u;     // a K / V / Q row's stride in uvec4s (16 bytes of padding)
const uint UT = BC * HD / 8u / NTH;  // 16-byte units of K, and of V, an invocation loads a tile
const uint SRS = BC + BC / 2u;    // a row of Su: BC scores (f32 bits), then BC probabilities (f16 pairs)
shared uvec4 Ks[BC * RS];         // the tile's keys [key][dim]
shared uvec4 Vs[BC * RS];         // and values
shared uint Su[BR * SRS];
shared float Cs[BR];              // each row's correction of this tile, then its 1 / L
#if COOP
shared uvec4 Qs[BR * RS];         // Q * scale in f16, [row][dim] (read once, into matrices)
shared float Idx[16u * TN];       // positions r * TN + c, loaded as an accumulator
fcoopmatNV<32, gl_ScopeSubgroup, 16, TN> acc_t;  // its length() sizes a lane's share of a product
#define AL (acc_t.length())
#endif

void main() {
  const uint tid = gl_LocalInvocationID.x;
  const int h = int(gl_WorkGroupID.y), t0 = int(gl_WorkGroupID.x * BR);
  const int n_tok = pc.n_tok, n_kv = NKV;
  const int kvh = h / (NH / NKVH);
  const uint koff = pc.k_off + uint(kvh) * HD * 2u, voff = pc.v_off + uint(kvh) * HD * 2u;

  // The workgroup's keys: the union of its rows' (window, causal) ranges.
  int lo = 0x7fffffff, hi = 0;
  for (int r = 0; r < int(BR) && t0 + r < n_tok; ++r) {
    const int p = I32(pc.q_pos).v[t0 + r];
    hi = max(hi, min(n_kv, p + 1));
    lo = min(lo, pc.window > 0 ? max(0, p - pc.window + 1) : 0);
  }
  // This lane's row of the softmax (R) and half of the tile's keys (hf): lanes R * 2, R * 2 + 1
  // (one subgroup: row R belongs to subgroup R / 16's products as well).
  const uint R = tid >> 1, hf = tid & 1u;
  const int t = t0 + int(R);
  const int pos = t < n_tok ? I32(pc.q_pos).v[t] : -1;  // -1: a padding row, every key masked
  const int rlo = pc.window > 0 ? pos - pc.window + 1 : -0x7fffffff;
  const uint64_t qrow = pc.q + (uint64_t(t) * uint64_t(pc.q_stride) + uint64_t(h) * HD) * 4u;

#if COOP
  const uint g = gl_SubgroupID;  // rows 16 g .. 16 g + 15
  for (uint i = tid; i < BR * HD / 8u; i += NTH) {
    const uint r = i / (HD / 8u), u = i % (HD / 8u);
    uvec4 w = uvec4(0u);
    if (t0 + int(r) < n_tok) {
      V4 p = V4(pc.q + (uint64_t(t0 + int(r)) * uint64_t(pc.q_stride) + uint64_t(h) * HD + u * 8u) * 4u);
      const vec4 a = p.v[0] * pc.scale, b = p.v[1] * pc.scale;
      w = uvec4(f2h(a.x) | f2h(a.y) << 16, f2h(a.z) | f2h(a.w) << 16, f2h(b.x) | f2h(b.y) << 16,
                f2h(b.z) | f2h(b.w) << 16);
    }
    Qs[r * RS + u] = w;
  }
  for (uint i = tid; i < 16u * TN; i += NTH) Idx[i] = float(i);
  barrier();
  fcoopmatNV<32, gl_ScopeSubgroup, 16, TN> im;
  coopMatLoadNV(im, Idx, 0, TN, false);
  uint er[AL], ec[AL];
  [[unroll]] for (int e = 0; e < AL; ++e) er[e] = uint(im[e]) / TN, ec[e] = uint(im[e]) % TN;
  fcoopmatNV<16, gl_ScopeSubgroup, 16, 16> qa[HD / 16u];
  [[unroll]] for (uint kk = 0u; kk < HD / 16u; ++kk) coopMatLoadNV(qa[kk], Qs, (16u * g) * RS + 2u * kk, RS, false);
  fcoopmatNV<32, gl_ScopeSubgroup, 16, TN> oacc[HD / TN];
  [[unroll]] for (uint j = 0u; j < HD / TN; ++j) oacc[j] = fcoopmatNV<32, gl_ScopeSubgroup, 16, TN>(0.0f);
#else
  float qr[HD], o[HD / 2u];  // this lane's row of Q * scale (f16-rounded), its half of O's dims
  [[unroll]] for (uint d = 0u; d < HD; ++d) qr[d] = t < n_tok ? h2f(f2h(F32(qrow).v[d] * pc.scale)) : 0.0f;
  [[unroll]] for (uint d = 0u; d < HD / 2u; ++d) o[d] = 0.0f;
#endif

  float m = NEG_INF, l = 0.0f;
  const int first = lo >= hi ? hi : lo - lo % int(BC);
  uvec4 kr[UT], vr[UT];
#define LOAD_UNITS(j0_)                                                                            \
  [[unroll]] for (uint i = 0u; i < UT; ++i) {                                                      \
    const uint id = tid + NTH * i, j = id / (HD / 8u), u = id % (HD / 8u);                        \
    kr[i] = uvec4(0u), vr[i] = uvec4(0u);                                                          \
    if ((j0_) + int(j) < hi) {                                                                     \
      const uint64_t rb = kv_row_at(pc.base, pc.pages, pc.page_bytes, pc.row_bytes, PSHIFT, (j0_) + int(j)); \
      kr[i] = V4U(rb + koff + u * 16u).v[0];                                                       \
      vr[i] = V4U(rb + voff + u * 16u).v[0];                                                       \
    }                                                                                              \
  }
  if (first < hi) LOAD_UNITS(first)
  for (int j0 = first; j0 < hi; j0 += int(BC)) {
    barrier();  // the previous tile's Ks / Vs / Su are read
    [[unroll]] for (uint i = 0u; i < UT; ++i) {
      const uint id = tid + NTH * i, j = id / (HD / 8u), u = id % (HD / 8u);
      Ks[j * RS + u] = kr[i];
      Vs[j * RS + u] = vr[i];
    }
    barrier();
    if (j0 + int(BC) < hi) LOAD_UNITS(j0 + int(BC))  // in flight during this tile's math

    // Scores into Su[row][0, BC).
#if COOP
    [[unroll]] for (uint jn = 0u; jn < BC / TN; ++jn) {
      fcoopmatNV<32, gl_ScopeSubgroup, 16, TN> s = fcoopmatNV<32, gl_ScopeSubgroup, 16, TN>(0.0f);
      [[unroll]] for (uint kk = 0u; kk < HD / 16u; ++kk) {
        // K^T is dims x keys: a key's dims adjacent, so column-major over Ks's [key][dim] rows.
        fcoopmatNV<16, gl_ScopeSubgroup, 16, TN> kb;
        coopMatLoadNV(kb, Ks, (TN * jn) * RS + 2u * kk, RS, true);
        s = coopMatMulAddNV(qa[kk], kb, s);
      }
      coopMatStoreNV(s, Su, (16u * g) * SRS + TN * jn, SRS, false);
    }
#else
    [[unroll]] for (uint c = 0u; c < HALF; ++c) {
      const uint key = hf * HALF + c;
      float s = 0.0f;
      [[unroll]] for (uint u = 0u; u < HD / 8u; ++u) {
        const uvec4 w = Ks[key * RS + u];
        [[unroll]] for (uint e = 0u; e < 4u; ++e) {
          const vec2 kv = unpackHalf2x16(w[e]);
          s = fma(qr[8u * u + 2u * e], kv.x, s);
          s = fma(qr[8u * u + 2u * e + 1u], kv.y, s);
        }
      }
      Su[R * SRS + key] = floatBitsToUint(s);
    }
#endif
    barrier();

    // The softmax of row R over this lane's half of the keys: masked, capped, joined with the
    // partner lane's half; the probabilities rounded to f16 into Su[row][BC, 2 BC) as pairs.
    float s[HALF];
    float mx = NEG_INF;
    [[unroll]] for (uint c = 0u; c < HALF; ++c) {
      const uint key = hf * HALF + c;
      const int j = j0 + int(key);
      float v = uintBitsToFloat(Su[R * SRS + key]);
      if (pc.softcap > 0.0f) v = pc.softcap * tanh_safe(v / pc.softcap);
      s[c] = j < hi && j <= pos && j >= rlo ? v : NEG_INF;
      mx = max(mx, s[c]);
    }
    mx = max(mx, subgroupShuffleXor(mx, 1u));
    const float mn = max(m, mx);
    const float corr = mn == NEG_INF ? 1.0f : exp(m - mn);  // m = -inf before any key: 0
    float sum = 0.0f;
    [[unroll]] for (uint c = 0u; c < HALF; c += 2u) {
      const uint p0 = s[c] == NEG_INF ? 0u : f2h(exp(s[c] - mn));
      const uint p1 = s[c + 1u] == NEG_INF ? 0u : f2h(exp(s[c + 1u] - mn));
      sum += h2f(p0) + h2f(p1);
      Su[R * SRS + BC + (hf * HALF + c) / 2u] = p0 | p1 << 16;
    }
    sum += subgroupShuffleXor(sum, 1u);
    l = l * corr + sum;
    m = mn;
    if (hf == 0u) Cs[R] = corr;
    barrier();

    // O = O * corr + P V.
#if COOP
    [[unroll]] for (uint j = 0u; j < HD / TN; ++j)
      [[unroll]] for (int e = 0; e < AL; ++e) oacc[j][e] *= Cs[16u * g + er[e]];
    [[unroll]] for (uint kc = 0u; kc < BC / 16u; ++kc) {
      fcoopmatNV<16, gl_ScopeSubgroup, 16, 16> pa;
      coopMatLoadNV(pa, Su, (16u * g) * SRS + BC + 8u * kc, SRS, false);
      [[unroll]] for (uint j = 0u; j < HD / TN; ++j) {
        fcoopmatNV<16, gl_ScopeSubgroup, 16, TN> vb;  // V is keys x dims: [key][dim] rows, row-major
        coopMatLoadNV(vb, Vs, (16u * kc) * RS + (TN / 8u) * j, RS, false);
        oacc[j] = coopMatMulAddNV(pa, vb, oacc[j]);
      }
    }
#else
    [[unroll]] for (uint d = 0u; d < HD / 2u; ++d) o[d] *= corr;
    [[unroll]] for (uint c = 0u; c < BC; c += 2u) {
      const vec2 p = unpackHalf2x16(Su[R * SRS + BC + c / 2u]);
      [[unroll]] for (uint u = 0u; u < HD / 16u; ++u) {
        const uvec4 w0 = Vs[c * RS + hf * (HD / 16u) + u], w1 = Vs[(c + 1u) * RS + hf * (HD / 16u) + u];
        [[unroll]] for (uint e = 0u; e < 4u; ++e) {
          const vec2 v0 = unpackHalf2x16(w0[e]), v1 = unpackHalf2x16(w1[e]);
          o[8u * u + 2u * e] = fma(p.y, v1.x, fma(p.x, v0.x, o[8u * u + 2u * e]));
          o[8u * u + 2u * e + 1u] = fma(p.y, v1.y, fma(p.x, v0.y, o[8u * u + 2u * e + 1u]));
        }
      }
    }
#endif
  }

  // 1 / L of each row (the sink joining the denominator as flash2's does), then O's rows out.
  float f = 1.0f, L = l;
  if (pc.sinks != 0ul) {
    const float sink = F32(pc.sinks).v[h], M2 = max(m, sink);
    f = m == NEG_INF ? 0.0f : exp(m - M2);
    L = L * f + exp(sink - M2);
  }
  const float inv = L > 0.0f ? f / L : 0.0f;
  barrier();  // the last tile's Cs is read
  if (hf == 0u) Cs[R] = inv;
  barrier();
#if COOP
  [[unroll]] for (uint j = 0u; j < HD / TN; ++j)
    [[unroll]] for (int e = 0; e < AL; ++e) {
      const uint r = 16u * g + er[e];
      const int tr = t0 + int(r);
      if (tr < n_tok)
        F32(pc.out_ + (uint64_t(tr) * uint64_t(pc.out_stride) + uint64_t(h) * HD + TN * j + ec[e]) * 4u).v[0] =
            oacc[j][e] * Cs[r];
    }
#else
  if (t < n_tok) {
    F32 orow = F32(pc.out_ + (uint64_t(t) * uint64_t(pc.out_stride) + uint64_t(h) * HD + hf * (HD / 2u)) * 4u);
    [[unroll]] for (uint d = 0u; d < HD / 2u; ++d) orow.v[d] = o[d] * inv;
  }
#endif
}
