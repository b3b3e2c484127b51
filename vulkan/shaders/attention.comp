// Paged attention: a workgroup per (query head, token). Keys come 64 at a time: each
// invocation scores one key (full dot with q from shared memory), then the chunk's
// probabilities update a running softmax (max m, sum l) and each invocation's output dims.
// KV rows are read through the block table (once per key, kept in shared memory for the V
// pass); GQA maps head h to kv head h / (H / KVH).
// Split over keys (decode: few (head, token) pairs, many keys): workgroup z takes keys
// [z * S, (z + 1) * S), S = |split|, and writes its unnormalized (m, l, acc) to part.
// split > 0: the last of a (token, head)'s workgroups to finish (a counter per pair at cnt,
// left at 0 again) joins them and writes the output, so the split costs no second dispatch;
// split < 0: attention_merge.comp joins them. split == 0: no split.
// shape bit 31 (split >= 0, no sinks): the output rows are also rounded to int8 blocks of 32 as
// quant_act.comp rounds them (qact.glsl), into the rows at the sinks field's address (quants
// [n][cols], then scales [n][cols / 32] at the next 256-byte boundary, as the backend lays
// them out; cols = out_stride): the O projection's quant_act dispatch taken back.
#version 450
#extension GL_EXT_shader_explicit_arithmetic_types_float64 : require
#include "common.glsl"
#include "kv.glsl"
#include "qact.glsl"

#ifndef HDMAX
#define HDMAX 256  // the largest head size (attention_512: 512, Gemma-4's global layers)
#endif
#define NA (HDMAX / 64)  // an invocation's output dims: tid + 64 i, i < NA

layout(local_size_x = 64) in;
// The splits' partials as other workgroups see them: coherent (not from a stale cache).
layout(buffer_reference, std430, buffer_reference_align = 4) coherent buffer PartF { float v[]; };
layout(push_constant, std430) uniform PC {
  uint64_t q, base, pages, q_pos, out_, sinks;  // sinks: a logit per head joining the denominator, or 0
  uint64_t part;                                // split: (m, l, acc[head_dim]) per (token, head, split)
  uint64_t args;                                // n_kv_ < 0: n_kv is args[-n_kv_ - 1] (a replayed step's value)
  uint64_t cnt;                                 // split > 0: a counter per (token, head)
  uint page_bytes, k_off, v_off, row_bytes;
  int q_stride, out_stride, n_kv_;
  uint heads;   // n_heads | n_kv_heads << 16
  uint shape;   // head_dim | page_shift << 16 | kvtype << 24
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

shared float qs[HDMAX];
shared float sc[64];

float kv_elem(uint64_t r, int d) { return kv_value(r, d, KVTYPE); }

// q . (key row at kr): whole words per load where the row's alignment allows, 16 dims a pass
// with their loads issued together (a loop of unknown length is not pipelined for us).
float kv_dot(uint64_t kr) {
  const int hd = HD;
  float p = 0.0f;
  if (KVTYPE == 0) {
    if ((kr & 15ul) == 0ul && hd % 16 == 0) {
      V4 r = V4(kr);
      for (int d = 0; d < hd; d += 16) {
        vec4 k[4];
        [[unroll]] for (int i = 0; i < 4; ++i) k[i] = r.v[(d >> 2) + i];
        [[unroll]] for (int i = 0; i < 4; ++i) {
          p += qs[d + 4 * i] * k[i].x;
          p += qs[d + 4 * i + 1] * k[i].y;
          p += qs[d + 4 * i + 2] * k[i].z;
          p += qs[d + 4 * i + 3] * k[i].w;
        }
      }
    } else {
      for (int d = 0; d < hd; ++d) p += qs[d] * F32(kr).v[d];
    }
  } else if (KVTYPE == 1) {
    if ((kr & 3ul) == 0ul && hd % 16 == 0) {
      U32 r = U32(kr);
      for (int d = 0; d < hd; d += 16) {
        uint w[8];
        [[unroll]] for (int i = 0; i < 8; ++i) w[i] = r.v[(d >> 1) + i];
        [[unroll]] for (int i = 0; i < 8; ++i) {
          const vec2 k = unpackHalf2x16(w[i]);
          p += qs[d + 2 * i] * k.x;
          p += qs[d + 2 * i + 1] * k.y;
        }
      }
    } else {
      for (int d = 0; d < hd; ++d) p += qs[d] * h2f(rd16(kr + uint64_t(d) * 2u));
    }
  } else {
    for (int b0 = 0; b0 < hd; b0 += 32) {
      const uint64_t b = kr + uint64_t(b0 >> 5) * 34u;
      const float sc = h2f(rd16(b));
      uint q[8];
      [[unroll]] for (int w = 0; w < 8; ++w) q[w] = rd32(b + 2u + uint(w) * 4u);
      [[unroll]] for (int w = 0; w < 8; ++w)
        [[unroll]] for (int i = 0; i < 4; ++i) p += qs[b0 + w * 4 + i] * (float(sbyte(q[w], uint(i))) * sc);
    }
  }
  return p;
}

// The start of key j's row (before the K / V offsets), through the block table.
uint64_t kv_base(int j) { return kv_row_at(pc.base, pc.pages, pc.page_bytes, pc.row_bytes, PSHIFT, j); }

shared uint64_t rowb[64];
shared bool last;  // this workgroup joins the splits  // the chunk's row starts, looked up once per key (by the scoring lane)

void main() {
  const int h = int(gl_WorkGroupID.x), t = int(gl_WorkGroupID.y), tid = int(gl_LocalInvocationID.x);
  const int hd = HD;
  const int kvh = h / (NH / NKVH);
  F32 qr = F32(pc.q + (uint64_t(t) * uint64_t(pc.q_stride) + uint64_t(h * hd)) * 4u);
  for (int d = tid; d < hd; d += 64) qs[d] = qr.v[d];
  const int pos = I32(pc.q_pos).v[t];
  int hi = min(NKV, pos + 1);
  int lo = pc.window > 0 ? max(0, pos - pc.window + 1) : 0;
  const int z = int(gl_WorkGroupID.z);
  const int S = abs(pc.split);
  if (S > 0) lo = max(lo, z * S), hi = min(hi, (z + 1) * S);
  const uint head_off = KVTYPE == 0 ? uint(kvh * hd * 4) : KVTYPE == 1 ? uint(kvh * hd * 2)
                                                                             : uint(kvh * (hd / 32) * 34);
  const uint koff = pc.k_off + head_off, voff = pc.v_off + head_off;
  float acc[NA];  // dims tid + 64 i
  [[unroll]] for (int i = 0; i < NA; ++i) acc[i] = 0.0f;
  float m = uintBitsToFloat(0xff800000u), l = 0.0f;
  barrier();
  for (int j0 = lo; j0 < hi; j0 += 64) {
    const int j = j0 + tid;
    float s = uintBitsToFloat(0xff800000u);
    if (j < hi) {
      const uint64_t rb = kv_base(j);
      rowb[tid] = rb;
      const float p = kv_dot(rb + koff);
      s = pc.softcap > 0.0f ? pc.softcap * tanh_safe(p * pc.scale / pc.softcap) : p * pc.scale;
    }
    sc[tid] = s;
    barrier();
    const int cnt = min(64, hi - j0);
    float mx = m;
    for (int k = 0; k < cnt; ++k) mx = max(mx, sc[k]);
    const float corr = exp(m - mx);  // 0 on the first chunk (m = -inf)
    l *= corr;
    for (int i = 0; i < NA; ++i) acc[i] *= corr;
    // Eight keys a pass, their V loads issued together; the sums run key by key as before.
    int k = 0;
    for (; k < cnt; k += 8) {
      const int nk = min(8, cnt - k);
      float pk[8], ev[8][NA];
      [[unroll]] for (int u = 0; u < 8; ++u) {
        pk[u] = 0.0f;
        if (u < nk) pk[u] = exp(sc[k + u] - mx);
        const uint64_t vr = rowb[k + min(u, nk - 1)] + voff;
        [[unroll]] for (int i = 0; i < NA; ++i) {
          const int d = tid + 64 * i;
          ev[u][i] = d < hd && u < nk ? kv_elem(vr, d) : 0.0f;
        }
      }
      [[unroll]] for (int u = 0; u < 8; ++u) {
        if (u >= nk) break;
        l += pk[u];
        [[unroll]] for (int i = 0; i < NA; ++i) acc[i] += pk[u] * ev[u][i];
      }
    }
    m = mx;
    barrier();  // sc and rowb are rewritten by the next chunk
  }
  if (S > 0) {
    const int nz = int(gl_NumWorkGroups.z);
    const uint64_t mine = pc.part + uint64_t((t * NH + h) * nz) * uint64_t(hd + 2) * 4u;
    PartF pr = PartF(mine + uint64_t(z * (hd + 2)) * 4u);
    if (tid == 0) pr.v[0] = m, pr.v[1] = l;
    for (int i = 0; i < NA; ++i) {
      const int d = tid + 64 * i;
      if (d < hd) pr.v[2 + d] = acc[i];
    }
    if (pc.split < 0) return;  // attention_merge.comp joins them
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
    m = uintBitsToFloat(0xff800000u);
    for (int s2 = 0; s2 < nz; ++s2) {
      PartF p = PartF(mine + uint64_t(s2 * (hd + 2)) * 4u);
      if (p.v[1] > 0.0f) m = max(m, p.v[0]);
    }
    l = 0.0f;
    for (int i = 0; i < NA; ++i) acc[i] = 0.0f;
    for (int s2 = 0; s2 < nz; ++s2) {
      PartF p = PartF(mine + uint64_t(s2 * (hd + 2)) * 4u);
      const float ls = p.v[1];
      if (!(ls > 0.0f)) continue;
      const float w = exp(p.v[0] - m);
      l += ls * w;
      for (int i = 0; i < NA; ++i) {
        const int d = tid + 64 * i;
        if (d < hd) acc[i] += p.v[2 + d] * w;
      }
    }
    // No visible key in any split: m stays -inf, l 0, as unsplit.
  }
  if (pc.sinks != 0ul && !QFOLD) {
    const float sink = F32(pc.sinks).v[h], mx = max(m, sink);
    const float corr = exp(m - mx);
    l = l * corr + exp(sink - mx);
    for (int i = 0; i < NA; ++i) acc[i] *= corr;
  }
  F32 o = F32(pc.out_ + (uint64_t(t) * uint64_t(pc.out_stride) + uint64_t(h * hd)) * 4u);
  const float inv = l > 0.0f ? 1.0f / l : 0.0f;
  for (int i = 0; i < NA; ++i) {
    const int d = tid + 64 * i;
    if (d < hd) {
      const float val = acc[i] * inv;
      o.v[d] = val;
      qs[d] = val;  // q is read no more
    }
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
    V4U q = V4U(xq + uint64_t(t) * cols + uint64_t(blk) * 32u);
    q.v[0] = uvec4(w[0], w[1], w[2], w[3]);
    q.v[1] = uvec4(w[4], w[5], w[6], w[7]);
    F32(xq + qb + (uint64_t(t) * (cols / 32u) + blk) * 4u).v[0] = dq;
  }
}
