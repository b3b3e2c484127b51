// Attention of many query rows (prefill chunks, encoder towers) in key tiles shared by a
// workgroup's rows, as cuda/flash.cu: a workgroup takes BR query rows of one head and walks the
// keys BC at a time; each K / V tile is read from the paged cache once for all BR rows
// (attention.comp reads every key again for every row). 128 invocations as 8 row groups (ty) x
// 16 lanes (tx): a lane scores RT rows x CT keys and accumulates RT rows x HD / 16 output
// dims (tx + 16 c). Row maxima and sums meet in shared memory (lavapipe's subgroups are 8 wide).
// HD (compile time): head_dim rounded up to 64 or 128, zero padded; tiles sized for 32 KB of
// shared memory (Vulkan's guaranteed minimum is 16 KB: the host checks the device's limit).
#version 450
#include "common.glsl"
#include "kv.glsl"

layout(local_size_x = 128) in;
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
#define HDIM int(pc.shape & 0xffffu)
#define PSHIFT int((pc.shape >> 16) & 0xffu)
#define KVTYPE int(pc.shape >> 24)
#define NKV (pc.n_kv_ >= 0 ? pc.n_kv_ : I32(pc.args).v[-pc.n_kv_ - 1])

#if HD <= 64
#define BR 32
#define BC 32
#else
#define BR 16
#define BC 16
#endif
#define RT (BR / 8)
#define CT (BC / 16)
#define OC (HD / 16)
#define KS (BC + 4)

shared float Qt[HD * BR];   // Q transposed: [d][row]
shared float Kt[HD * KS];   // the tile's keys transposed: [d][key]
shared float Vs[BC * HD];   // [key][d]
shared float Ps[BR * KS];   // the tile's probabilities: [row][key]
shared float red[BR * 16];  // a row's 16 lanes' maxima / sums
shared uint64_t rowb[BC];   // the tile's row starts

#define NEG_INF uintBitsToFloat(0xff800000u)

void main() {
  const int tid = int(gl_LocalInvocationID.x), tx = tid & 15, ty = tid >> 4;
  const int h = int(gl_WorkGroupID.y), t0 = int(gl_WorkGroupID.x) * BR;
  const int hd = HDIM, n_tok = pc.n_tok, n_kv = NKV;
  const int kvh = h / (NH / NKVH);
  const uint head_off = KVTYPE == 0 ? uint(kvh * hd * 4) : KVTYPE == 1 ? uint(kvh * hd * 2)
                                                                             : uint(kvh * (hd / 32) * 34);
  const uint koff = pc.k_off + head_off, voff = pc.v_off + head_off;

  // The workgroup's keys: the union of its rows' (window, causal) ranges.
  int lo = 0x7fffffff, hi = 0;
  for (int r = 0; r < BR && t0 + r < n_tok; ++r) {
    const int p = I32(pc.q_pos).v[t0 + r];
    hi = max(hi, min(n_kv, p + 1));
    lo = min(lo, pc.window > 0 ? max(0, p - pc.window + 1) : 0);
  }
  int pos[RT];
  [[unroll]] for (int i = 0; i < RT; ++i) {
    const int t = t0 + ty * RT + i;
    pos[i] = t < n_tok ? I32(pc.q_pos).v[t] : -1;  // -1: a padding row, every key masked
  }
  for (int idx = tid; idx < HD * BR; idx += 128) {
    const int r = idx / HD, d = idx % HD, t = t0 + r;
    float v = 0.0f;
    if (t < n_tok && d < hd) v = F32(pc.q + (uint64_t(t) * uint64_t(pc.q_stride) + uint64_t(h * hd + d)) * 4u).v[0];
    Qt[d * BR + r] = v;
  }
  float o[RT][OC], m[RT], l[RT];
  [[unroll]] for (int i = 0; i < RT; ++i) {
    m[i] = NEG_INF, l[i] = 0.0f;
    [[unroll]] for (int c = 0; c < OC; ++c) o[i][c] = 0.0f;
  }
  const int first = lo >= hi ? hi : lo - lo % BC;
  for (int j0 = first; j0 < hi; j0 += BC) {
    barrier();  // the previous tile's Kt / Vs / Ps / rowb are read
    if (tid < BC && j0 + tid < hi)
      rowb[tid] = kv_row_at(pc.base, pc.pages, pc.page_bytes, pc.row_bytes, PSHIFT, j0 + tid);
    barrier();
    for (int idx = tid; idx < BC * HD; idx += 128) {
      const int j = idx / HD, d = idx % HD;
      float kv = 0.0f, vv = 0.0f;
      if (j0 + j < hi && d < hd) {
        kv = kv_value(rowb[j] + koff, d, KVTYPE);
        vv = kv_value(rowb[j] + voff, d, KVTYPE);
      }
      Kt[d * KS + j] = kv;
      Vs[j * HD + d] = vv;
    }
    barrier();
    float s[RT][CT];
    [[unroll]] for (int i = 0; i < RT; ++i)
      [[unroll]] for (int c = 0; c < CT; ++c) s[i][c] = 0.0f;
    for (int d = 0; d < HD; ++d) {
      float q[RT], k[CT];
      [[unroll]] for (int i = 0; i < RT; ++i) q[i] = Qt[d * BR + ty * RT + i];
      [[unroll]] for (int c = 0; c < CT; ++c) k[c] = Kt[d * KS + tx * CT + c];
      [[unroll]] for (int i = 0; i < RT; ++i)
        [[unroll]] for (int c = 0; c < CT; ++c) s[i][c] = fma(q[i], k[c], s[i][c]);
    }
    [[unroll]] for (int i = 0; i < RT; ++i) {
      const int p = pos[i];
      const int rlo = pc.window > 0 ? p - pc.window + 1 : -0x7fffffff;
      float mx = NEG_INF;
      [[unroll]] for (int c = 0; c < CT; ++c) {
        const int j = j0 + tx * CT + c;
        const float v = pc.softcap > 0.0f ? pc.softcap * tanh_safe(s[i][c] * pc.scale / pc.softcap) : s[i][c] * pc.scale;
        s[i][c] = j < hi && j <= p && j >= rlo ? v : NEG_INF;
        mx = max(mx, s[i][c]);
      }
      red[(ty * RT + i) * 16 + tx] = mx;
    }
    barrier();
    [[unroll]] for (int i = 0; i < RT; ++i) {
      float mx = m[i];
      for (int u = 0; u < 16; ++u) mx = max(mx, red[(ty * RT + i) * 16 + u]);
      const float corr = mx == NEG_INF ? 1.0f : exp(m[i] - mx);  // m = -inf before any key: 0
      m[i] = mx;
      l[i] *= corr;
      [[unroll]] for (int c = 0; c < OC; ++c) o[i][c] *= corr;
      [[unroll]] for (int c = 0; c < CT; ++c) {
        const float pv = s[i][c] == NEG_INF ? 0.0f : exp(s[i][c] - mx);
        l[i] += pv;
        Ps[(ty * RT + i) * KS + tx * CT + c] = pv;
      }
    }
    barrier();
    const int jn = min(BC, hi - j0);
    for (int j = 0; j < jn; ++j) {
      float v[OC];
      [[unroll]] for (int c = 0; c < OC; ++c) v[c] = Vs[j * HD + tx + 16 * c];
      [[unroll]] for (int i = 0; i < RT; ++i) {
        const float p = Ps[(ty * RT + i) * KS + j];
        [[unroll]] for (int c = 0; c < OC; ++c) o[i][c] = fma(p, v[c], o[i][c]);
      }
    }
  }
  barrier();  // red is read (the last tile's maxima)
  [[unroll]] for (int i = 0; i < RT; ++i) red[(ty * RT + i) * 16 + tx] = l[i];
  barrier();
  [[unroll]] for (int i = 0; i < RT; ++i) {
    const int t = t0 + ty * RT + i;
    if (t >= n_tok) continue;
    float L = 0.0f;
    for (int u = 0; u < 16; ++u) L += red[(ty * RT + i) * 16 + u];
    float f = 1.0f;
    if (pc.sinks != 0ul) {  // the sink joins the denominator: rescale to the joint max
      const float sink = F32(pc.sinks).v[h], M2 = max(m[i], sink);
      f = m[i] == NEG_INF ? 0.0f : exp(m[i] - M2);
      L = L * f + exp(sink - M2);
    }
    const float inv = L > 0.0f ? f / L : 0.0f;
    F32 out_row = F32(pc.out_ + (uint64_t(t) * uint64_t(pc.out_stride) + uint64_t(h * hd)) * 4u);
    [[unroll]] for (int c = 0; c < OC; ++c) {
      const int d = tx + 16 * c;
      if (d < hd) out_row.v[d] = o[i][c] * inv;
    }
  }
}
