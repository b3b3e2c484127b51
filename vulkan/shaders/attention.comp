// Paged attention: a workgroup per (query head, token). Keys come 64 at a time: each
// invocation scores one key (full dot with q from shared memory), then the chunk's
// probabilities update a running softmax (max m, sum l) and each invocation's output dims.
// KV rows are read through the block table; GQA maps head h to kv head h / (H / KVH).
#version 450
#include "common.glsl"

layout(local_size_x = 64) in;
layout(push_constant, std430) uniform PC {
  uint64_t q, base, pages, q_pos, out_, sinks;  // sinks: a logit per head joining the denominator, or 0
  uint page_bytes, k_off, v_off, row_bytes;
  int q_stride, out_stride, n_kv, n_heads, n_kv_heads, head_dim, page_shift, window, kvtype;
  float scale, softcap;
} pc;

shared float qs[256];
shared float sc[64];

uint64_t kv_row(uint off, int j) {
  const int64_t jj = int64_t(j);
  const int64_t page = int64_t(I32(pc.pages).v[uint(jj >> pc.page_shift)]);
  const int64_t mask = (int64_t(1) << pc.page_shift) - 1;
  return pc.base + uint64_t(page) * pc.page_bytes + off + uint64_t(jj & mask) * pc.row_bytes;
}

float kv_elem(uint64_t r, int d) {
  if (pc.kvtype == 0) return F32(r).v[d];
  if (pc.kvtype == 1) return h2f(rd16(r + uint64_t(d) * 2u));
  const uint64_t b = r + uint64_t(d >> 5) * 34u;
  return float(sbyte(rd8(b + 2u + uint(d & 31)), 0u)) * h2f(rd16(b));
}

void main() {
  const int h = int(gl_WorkGroupID.x), t = int(gl_WorkGroupID.y), tid = int(gl_LocalInvocationID.x);
  const int hd = pc.head_dim;
  const int kvh = h / (pc.n_heads / pc.n_kv_heads);
  F32 qr = F32(pc.q + (uint64_t(t) * uint64_t(pc.q_stride) + uint64_t(h * hd)) * 4u);
  for (int d = tid; d < hd; d += 64) qs[d] = qr.v[d];
  const int pos = I32(pc.q_pos).v[t];
  const int hi = min(pc.n_kv, pos + 1);
  const int lo = pc.window > 0 ? max(0, pos - pc.window + 1) : 0;
  const uint head_off = pc.kvtype == 0 ? uint(kvh * hd * 4) : pc.kvtype == 1 ? uint(kvh * hd * 2)
                                                                             : uint(kvh * (hd / 32) * 34);
  const uint koff = pc.k_off + head_off, voff = pc.v_off + head_off;
  float acc[4] = float[4](0.0f, 0.0f, 0.0f, 0.0f);  // dims tid + 64 i
  float m = uintBitsToFloat(0xff800000u), l = 0.0f;
  barrier();
  for (int j0 = lo; j0 < hi; j0 += 64) {
    const int j = j0 + tid;
    float s = uintBitsToFloat(0xff800000u);
    if (j < hi) {
      const uint64_t kr = kv_row(koff, j);
      float p = 0.0f;
      for (int d = 0; d < hd; ++d) p += qs[d] * kv_elem(kr, d);
      s = pc.softcap > 0.0f ? pc.softcap * tanh_safe(p * pc.scale / pc.softcap) : p * pc.scale;
    }
    sc[tid] = s;
    barrier();
    const int cnt = min(64, hi - j0);
    float mx = m;
    for (int k = 0; k < cnt; ++k) mx = max(mx, sc[k]);
    const float corr = exp(m - mx);  // 0 on the first chunk (m = -inf)
    l *= corr;
    for (int i = 0; i < 4; ++i) acc[i] *= corr;
    for (int k = 0; k < cnt; ++k) {
      const float p = exp(sc[k] - mx);
      l += p;
      const uint64_t vr = kv_row(voff, j0 + k);
      for (int i = 0; i < 4; ++i) {
        const int d = tid + 64 * i;
        if (d < hd) acc[i] += p * kv_elem(vr, d);
      }
    }
    m = mx;
    barrier();  // sc is rewritten by the next chunk
  }
  if (pc.sinks != 0ul) {
    const float sink = F32(pc.sinks).v[h], mx = max(m, sink);
    const float corr = exp(m - mx);
    l = l * corr + exp(sink - mx);
    for (int i = 0; i < 4; ++i) acc[i] *= corr;
  }
  F32 o = F32(pc.out_ + (uint64_t(t) * uint64_t(pc.out_stride) + uint64_t(h * hd)) * 4u);
  const float inv = l > 0.0f ? 1.0f / l : 0.0f;
  for (int i = 0; i < 4; ++i) {
    const int d = tid + 64 * i;
    if (d < hd) o.v[d] = acc[i] * inv;
  }
}
