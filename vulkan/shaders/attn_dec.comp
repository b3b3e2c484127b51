// Decode attention (1-4 query rows, head_dim up to 256, 512 at NU 8 and 16): a workgroup per
// (head, row, key split) as CUDA's decode attention (cuda/attn.cuh) does it. attention.comp walks a split's keys as a
// chain of memory round trips (the block table, then each key's row, then V eight keys a pass);
// here a subgroup takes KB keys a round with their K and V loads issued together (the scores do
// not gate V's reads), lanes across the head's dims (two a lane a unit: an f16 pair is one
// 32-bit load), the KB scores summed by subgroupAdd. The workgroup's subgroups then meet in
// shared memory, and the splits as attention.comp's do: partials (m, l, acc[hd]) and a counter
// per (row, head); the last split to finish joins them. The split count is the grid's z and
// each split takes ceil(keys / z) of its row's keys, so a replayed step (n_kv from args) keeps
// its grid while n_kv grows. Push constants as attention.comp's (split > 0: join by counter,
// 0: one split); shape bit 31: the output rounded to int8 as attention.comp rounds it.
// NU 8 (attn_dec_8) and NU 16, KB 2 (attn_dec_w): heads up to 16 and 32 dims a lane, for head
// sizes past 8 dims a lane (Gemma-4's 512 on 32 lanes; 128 and 256 where subgroups are narrow:
// lavapipe's 8 lanes, Intel's); attn_dec_w takes fewer keys a round, so that its key and value
// registers stay attn_dec_8's.
// KVF 1 (attn_dec_kf): a one-row step's KV store folded in (vulkan_backend.cpp, attention): pc.sinks
// holds kv_store's parameters (KvFold); the row's key is rotated and rounded as kv_store.comp
// stores it and read from shared memory by the split that holds it, a workgroup per KV head
// stores the row, and each workgroup rotates its own query head (kv_store's third row did).
#version 450
#extension GL_EXT_shader_explicit_arithmetic_types_float64 : require
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_KHR_shader_subgroup_arithmetic : require
#include "common.glsl"
#include "kv.glsl"
#include "qact.glsl"
#ifndef KVF
#define KVF 0
#endif
#if KVF
shared float kvrow[512];  // the new row's key (0-255) and value (256-511) slices
shared float kvamax[32];
uint kv_sel = 0u;         // which of them kv_put stores
#define KV_H(e) kvrow[kv_sel * 256u + (e)]
#define KV_AMAX(i) kvamax[i]
#include "kvtail.glsl"
// After kvtail.glsl's KvP (104 bytes) in the same constant block: the row's K and V sources, and
// whether the queries are still to be rotated.
layout(buffer_reference, std430, buffer_reference_align = 8) buffer KvF { uint64_t k, v; uint qrope; };
// kvrow[e] as the cache gives it back once stored (kv_put's rounding, kv_pair's read).
float kv_back(uint e, int kvtype) {
  const float x = kvrow[e];
  if (kvtype == 0) return x;
  if (kvtype == 1) return unpackHalf2x16(f2h(x)).x;
  const uint b0 = e & ~31u;
  float mx = 0.0f;
  for (uint k = 0u; k < 32u; ++k) mx = max(mx, abs(kvrow[b0 + k]));
  const float d = float(double(mx) / 127.0lf);
  const float id = d == 0.0f ? 0.0f : float(1.0lf / double(d));
  precise float xs = x * id;
  return float(int(roundf_away(xs))) * h2f(f2h(d));
}
// Pairs j of a head's slice at `at` (in kvrow, or qs) turned as kv_store.comp turns them.
#define KVF_ROPE(ARR, at)                                                           \
  for (uint j = uint(tid); j < half_; j += 128u) {                                  \
    float c, s;                                                                     \
    rope_cs(P.inv, P.factors, j, rp, P.freq_scale, P.mscale, c, s);                 \
    const uint i0 = (at) + (neox ? j : 2u * j), i1 = (at) + (neox ? j + half_ : 2u * j + 1u); \
    const float a = ARR[i0], b = ARR[i1];                                           \
    precise float ac = a * c, bs = b * s, as_ = a * s, bc = b * c;                  \
    ARR[i0] = ac - bs;                                                              \
    ARR[i1] = as_ + bc;                                                             \
  }
#endif

#ifndef KB
#define KB 4   // keys a subgroup scores a round
#endif
#ifndef NU
#define NU 4   // units (dim pairs) a lane at most: head_dim <= 2 NU x the subgroup size (the host checks)
#endif

layout(local_size_x = 128) in;
layout(buffer_reference, std430, buffer_reference_align = 4) coherent buffer PartF { float v[]; };
layout(push_constant, std430) uniform PC {
  uint64_t q, base, pages, q_pos, out_, sinks;
  uint64_t part;
  uint64_t args;
  uint64_t cnt;
  uint page_bytes, k_off, v_off, row_bytes;
  int q_stride, out_stride, n_kv_;
  uint heads;
  uint shape;
  int window;
  float scale, softcap;
  int split;
} pc;

#define NH int(pc.heads & 0xffffu)
#define NKVH int(pc.heads >> 16)
#define HD int(pc.shape & 0xffffu)
#define PSHIFT int((pc.shape >> 16) & 0xffu)
#define KVTYPE int((pc.shape >> 24) & 0x7fu)
#define QFOLD ((pc.shape >> 31) != 0u)
#define NKV (pc.n_kv_ >= 0 ? pc.n_kv_ : I32(pc.args).v[-pc.n_kv_ - 1])

shared float s_m[16], s_l[16], s_f[16];
// [subgroup][dim]: (128 / SG) subgroups x head_dim <= 2 NU x SG floats (NU 4: as before, twice that)
shared float s_acc[NU == 4 ? 2048 : 256 * NU];
shared float qs[NU == 4 ? 256 : 512];  // the output row (for its int8 rounding)
shared bool last;
shared float s_pm[64], s_pl[64];  // the splits' maxima and sums (64 splits at most: the host's cap)

// Dims 2u, 2u + 1 of a head's slice of a cache row at r (4-aligned rows; the host checks).
vec2 kv_pair(uint64_t r, uint u) {
  if (KVTYPE == 0) return vec2(F32(r).v[2u * u], F32(r).v[2u * u + 1u]);
  if (KVTYPE == 1) return unpackHalf2x16(U32(r).v[u]);
  const uint64_t b = r + uint64_t(u >> 4) * 34u;  // 16 pairs a 32-block
  const float s = h2f(rd16(b));
  const uint w = rd16(b + 2u + uint(u & 15u) * 2u);
  return vec2(float(sbyte(w, 0u)), float(sbyte(w, 1u))) * s;
}

uint64_t kv_base(int j) { return kv_row_at(pc.base, pc.pages, pc.page_bytes, pc.row_bytes, PSHIFT, j); }

void main() {
  const int h = int(gl_WorkGroupID.x), t = int(gl_WorkGroupID.y), z = int(gl_WorkGroupID.z);
  const int nz = int(gl_NumWorkGroups.z);
  const int tid = int(gl_LocalInvocationID.x);
  const uint SG = gl_SubgroupSize, lane = gl_SubgroupInvocationID;
  const int g = int(gl_SubgroupID), NSG = int(gl_NumSubgroups);
  const int hd = HD, np = hd / 2;
  const int kvh = h / (NH / NKVH);
  const int pos = I32(pc.q_pos).v[t];
  const int hi = min(NKV, pos + 1);
  const int lo = pc.window > 0 ? max(0, pos - pc.window + 1) : 0;
  const int len = max(hi - lo, 0);
  const int chunk = (len + nz - 1) / nz;
  const int j0 = lo + z * chunk, j1 = min(hi, j0 + chunk);
  const uint head_off = KVTYPE == 0 ? uint(kvh * hd * 4) : KVTYPE == 1 ? uint(kvh * hd * 2)
                                                                             : uint(kvh * (hd / 32) * 34);
  const uint koff = pc.k_off + head_off, voff = pc.v_off + head_off;

  F32 qr = F32(pc.q + (uint64_t(t) * uint64_t(pc.q_stride) + uint64_t(h * hd)) * 4u);
#if KVF
  // One row (t 0): the store's row is key kf. Where this split reads it, or where this workgroup
  // stores it (the first query head of its KV head, split 0), the key is rotated and both are
  // rounded here; everything below is uniform in the workgroup.
  KvP P = KvP(pc.sinks);
  KvF X = KvF(pc.sinks + 104ul);
  const int kf = P.first_ >= 0 ? P.first_ : I32(P.args).v[-P.first_ - 1];
  const bool writer = h % (NH / NKVH) == 0 && z == 0, need = j0 <= kf && kf < j1;
  const uint half_ = (P.rope & 0xffffu) / 2u;
  const bool neox = ((P.rope >> 16) & 1u) != 0u;
  const int rp = I32(P.pos).v[0];
  if (X.qrope != 0u) {
    for (int e = tid; e < hd; e += 128) qs[e] = qr.v[e];
    barrier();
    KVF_ROPE(qs, 0u)
    barrier();
  }
  if (need || writer) {
    F32 ks = F32(X.k + uint64_t(kvh * hd) * 4u), vs = F32(X.v + uint64_t(kvh * hd) * 4u);
    for (int e = tid; e < hd; e += 128) kvrow[e] = ks.v[e], kvrow[256 + e] = vs.v[e];
    barrier();
    KVF_ROPE(kvrow, 0u)
    barrier();
    if (writer) {
      const uint64_t row = kv_row_at(P.base, P.pages, P.page_bytes, P.row_bytes, P.page_shift, kf);
      kv_sel = 0u;
      kv_put(P, row + P.k_off, uint(kvh), uint(hd), uint(tid), 128u);
      barrier();
      kv_sel = 1u;
      kv_put(P, row + P.v_off, uint(kvh), uint(hd), uint(tid), 128u);
    }
    float r[4];
    [[unroll]] for (int k2 = 0; k2 < 4; ++k2) {
      const int e = tid + 128 * (k2 & 1);
      r[k2] = e < hd ? kv_back(uint(e + 256 * (k2 >> 1)), P.kvtype) : 0.0f;
    }
    barrier();
    [[unroll]] for (int k2 = 0; k2 < 4; ++k2) {
      const int e = tid + 128 * (k2 & 1);
      if (e < hd) kvrow[e + 256 * (k2 >> 1)] = r[k2];
    }
    barrier();
  }
#endif
  vec2 q[NU], acc[NU];
  [[unroll]] for (int i = 0; i < NU; ++i) {
    const uint u = lane + SG * uint(i);
#if KVF
    if (X.qrope != 0u) q[i] = u < uint(np) ? vec2(qs[2u * u], qs[2u * u + 1u]) : vec2(0.0f);
    else
#endif
    q[i] = u < uint(np) ? vec2(qr.v[2u * u], qr.v[2u * u + 1u]) : vec2(0.0f);
    acc[i] = vec2(0.0f);
  }
  float m = uintBitsToFloat(0xff800000u), l = 0.0f;
  for (int j = j0 + g * KB; j < j1; j += NSG * KB) {  // uniform in the subgroup
    float sc[KB];
    vec2 vv[KB][NU];
    [[unroll]] for (int b = 0; b < KB; ++b) {
      float p = 0.0f;
      const bool ok = j + b < j1;
      const uint64_t rb = ok ? kv_base(j + b) : 0ul;
#if KVF
      const bool nw = need && j + b == kf;  // the store's row: from kvrow, not the cache
#endif
      [[unroll]] for (int i = 0; i < NU; ++i) {
        const uint u = lane + SG * uint(i);
        vv[b][i] = vec2(0.0f);
        if (ok && u < uint(np)) {
#if KVF
          vec2 kk, vn;
          if (nw) {
            kk = vec2(kvrow[2u * u], kvrow[2u * u + 1u]), vn = vec2(kvrow[256u + 2u * u], kvrow[257u + 2u * u]);
          } else {
            kk = kv_pair(rb + koff, u), vn = kv_pair(rb + voff, u);
          }
          p += dot(q[i], kk);
          vv[b][i] = vn;
#else
          p += dot(q[i], kv_pair(rb + koff, u));
          vv[b][i] = kv_pair(rb + voff, u);
#endif
        }
      }
      sc[b] = p;
    }
    [[unroll]] for (int b = 0; b < KB; ++b) sc[b] = subgroupAdd(sc[b]);
    float mx = m;
    [[unroll]] for (int b = 0; b < KB; ++b) {
      if (j + b < j1) {
        const float s = sc[b];
        sc[b] = pc.softcap > 0.0f ? pc.softcap * tanh_safe(s * pc.scale / pc.softcap) : s * pc.scale;
        mx = max(mx, sc[b]);
      }
    }
    const float corr = exp(m - mx);  // m = -inf on the first keys: 0
    l *= corr;
    [[unroll]] for (int i = 0; i < NU; ++i) acc[i] *= corr;
    [[unroll]] for (int b = 0; b < KB; ++b) {
      if (j + b < j1) {
        const float p = exp(sc[b] - mx);
        l += p;
        [[unroll]] for (int i = 0; i < NU; ++i) acc[i] += p * vv[b][i];
      }
    }
    m = mx;
  }
  // The subgroups' states joined.
  if (lane == 0u) s_m[g] = m, s_l[g] = l;
  [[unroll]] for (int i = 0; i < NU; ++i) {
    const uint u = lane + SG * uint(i);
    if (u < uint(np)) s_acc[g * hd + int(2u * u)] = acc[i].x, s_acc[g * hd + int(2u * u) + 1] = acc[i].y;
  }
  barrier();
  float M = uintBitsToFloat(0xff800000u);
  for (int w = 0; w < NSG; ++w) M = max(M, s_m[w]);
  float L = 0.0f;
  for (int w = 0; w < NSG; ++w) L += s_l[w] * (s_l[w] > 0.0f ? exp(s_m[w] - M) : 0.0f);
  if (tid < NSG) s_f[tid] = s_l[tid] > 0.0f ? exp(s_m[tid] - M) : 0.0f;
  barrier();
  if (nz > 1) {
    const uint64_t mine = pc.part + uint64_t((t * NH + h) * nz) * uint64_t(hd + 2) * 4u;
    PartF pr = PartF(mine + uint64_t(z * (hd + 2)) * 4u);
    if (tid == 0) pr.v[0] = M, pr.v[1] = L;
    for (int d = tid; d < hd; d += 128) {
      float v = 0.0f;
      for (int w = 0; w < NSG; ++w) v += s_acc[w * hd + d] * s_f[w];
      pr.v[2 + d] = v;
    }
    // The partials out before the count; the last workgroup of (t, h) reads all of them.
    memoryBarrierBuffer();
    barrier();
    if (tid == 0) {
      U32 cnt = U32(pc.cnt);
      const uint done = atomicAdd(cnt.v[t * NH + h], 1u);
      last = done == uint(nz - 1);
      if (last) cnt.v[t * NH + h] = 0u;  // every split has counted: ready for the next call
    }
    barrier();
    if (!last) return;
    memoryBarrierBuffer();
    // The join: each split's (m, l) loaded once (an invocation a split), each output dim's
    // partials 8 loads at a time (a loop over the splits waited on an L2 round trip a split, three
    // times over: H100 decode +3%, fortieth session), summed in split order.
    if (tid < nz) {
      PartF p = PartF(mine + uint64_t(tid * (hd + 2)) * 4u);
      s_pm[tid] = p.v[0], s_pl[tid] = p.v[1];
    }
    barrier();
    M = uintBitsToFloat(0xff800000u);
    for (int s2 = 0; s2 < nz; ++s2)
      if (s_pl[s2] > 0.0f) M = max(M, s_pm[s2]);
    L = 0.0f;
    for (int s2 = 0; s2 < nz; ++s2)
      if (s_pl[s2] > 0.0f) L += s_pl[s2] * exp(s_pm[s2] - M);
    for (int d = tid; d < hd; d += 128) {
      float v = 0.0f;
      for (int s0 = 0; s0 < nz; s0 += 8) {
        float pv[8];
        [[unroll]] for (int k = 0; k < 8; ++k)
          pv[k] = s0 + k < nz ? PartF(mine + uint64_t((s0 + k) * (hd + 2) + 2 + d) * 4u).v[0] : 0.0f;
        [[unroll]] for (int k = 0; k < 8; ++k)
          if (s0 + k < nz && s_pl[s0 + k] > 0.0f) v += pv[k] * exp(s_pm[s0 + k] - M);
      }
      qs[d] = v;
    }
  } else {
    for (int d = tid; d < hd; d += 128) {
      float v = 0.0f;
      for (int w = 0; w < NSG; ++w) v += s_acc[w * hd + d] * s_f[w];
      qs[d] = v;
    }
  }
  // No visible key anywhere: M stays -inf, L 0, the output 0 (as attention.comp).
  float c = 1.0f;
#if KVF
  if (false) {  // (pc.sinks holds the store's parameters)
#else
  if (pc.sinks != 0ul && !QFOLD) {  // the sink joins the denominator: rescale to the joint max
#endif
    const float sink = F32(pc.sinks).v[h], mx = max(M, sink);
    c = L > 0.0f ? exp(M - mx) : 0.0f;
    L = L * c + exp(sink - mx);
  }
  const float inv = L > 0.0f ? c / L : 0.0f;
  F32 o = F32(pc.out_ + (uint64_t(t) * uint64_t(pc.out_stride) + uint64_t(h * hd)) * 4u);
  for (int d = tid; d < hd; d += 128) {
    const float val = qs[d] * inv;
    o.v[d] = val;
    qs[d] = val;
  }
  if (!QFOLD) return;
  barrier();  // uniform: a workgroup that joins no splits has left as a whole
  if (tid < hd / 32) {
    vec4 v[8];
    [[unroll]] for (uint i = 0u; i < 8u; ++i)
      v[i] = vec4(qs[tid * 32 + 4 * i], qs[tid * 32 + 4 * i + 1], qs[tid * 32 + 4 * i + 2], qs[tid * 32 + 4 * i + 3]);
    uint w[8];
    const float dq = qa_round(v, w);
    const uint cols = uint(pc.out_stride), blk = uint(h * hd / 32 + tid);
    const uint64_t xq = pc.sinks, qb = (uint64_t(gl_NumWorkGroups.y) * cols + 255u) & ~uint64_t(255);
    V4U qq = V4U(xq + uint64_t(t) * cols + uint64_t(blk) * 32u);
    qq.v[0] = uvec4(w[0], w[1], w[2], w[3]);
    qq.v[1] = uvec4(w[4], w[5], w[6], w[7]);
    F32(xq + qb + (uint64_t(t) * (cols / 32u) + blk) * 4u).v[0] = dq;
  }
}
