// Prefill attention in key tiles (flash.comp's algorithm, same f32 FMAs, other tiles): a
// workgroup takes BR = 16 RT query rows of one head and walks the keys 32 at a time. 128
// invocations as 16 row groups (ty) x 8 lanes (tx): a lane scores RT rows x 4 keys (tx * 4 + c)
// and accumulates RT rows x HD / 8 output dims (32 g + tx * 4 + e). Every shared-memory read is
// a vec4 (Q: RT rows of a dim, K: 4 keys of a dim, V: 4 dims of a key, P: RT rows of a key): at
// RT 4 a lane does 8 FMAs a read (4 to 5.3 at RT 2) where flash.comp's P V does 2 a float read:
// on a desktop GPU the shared-memory pipe, not the FMAs, bounds such tiles. SG: a row's 8 lanes are adjacent
// invocations of one subgroup (the device's subgroups are 8 wide or more and shuffle), so its
// maxima and sums meet by subgroupShuffleXor, not through shared memory and barriers.
// f16 caches whose head slices are 16-byte aligned are read in 16-byte units held in registers a
// tile ahead: the next tile's loads (its block-table reads, then its rows) are in flight while
// this one is scored, where a tile's global round trips otherwise stalled the workgroup every
// tile (the longest row block of a causal prefill walks every tile in turn). Other f16 caches are
// read two values a 32-bit load where the rows allow.
// HD (compile time): head_dim rounded up to 32 or 64, zero padded. RT 2 or 4 (at HD 64 30 KB of
// shared memory or 42 KB: the host checks the device's limit).
#version 450
#include "common.glsl"
#include "kv.glsl"
#if SG
#extension GL_KHR_shader_subgroup_shuffle : require
#endif

layout(local_size_x = 128) in;
layout(push_constant, std430) uniform PC {
  uint64_t q, base, pages, q_pos, out_, sinks;
  uint64_t args;  // n_kv_ < 0: n_kv is args[-n_kv_ - 1]
  uint page_bytes, k_off, v_off, row_bytes;
  int q_stride, out_stride, n_kv_;
  uint heads;  // n_heads | n_kv_heads << 16
  uint shape;  // head_dim | page_shift << 16 | kvtype << 24 | no_units << 31
  int window;
  float scale, softcap;
  int n_tok;
} pc;

#define NH int(pc.heads & 0xffffu)
#define NKVH int(pc.heads >> 16)
#define HDIM int(pc.shape & 0xffffu)
#define PSHIFT int((pc.shape >> 16) & 0xffu)
#define KVTYPE int((pc.shape >> 24) & 0x7fu)
#define NO_UNITS ((pc.shape >> 31) != 0u)  // DASLLAMA_VULKAN_FLASH_UNITS=0 (A/B runs)
#define NKV (pc.n_kv_ >= 0 ? pc.n_kv_ : I32(pc.args).v[-pc.n_kv_ - 1])

#define BR (16 * RT)
#define BC 32
#define BR4 (BR / 4)
#define KS4 ((BC + 4) / 4)  // Kt's row stride in vec4s (padded: the transposed stores spread over banks)
#define PS4 (BR4 + 1)       // Ps's row stride in vec4s
#define HD4 (HD / 4)
#define OG (HD / 32)        // a lane's output dims: 32 g + tx * 4 + e, g < OG
#define UR (HD / 8)         // 16-byte units of a key's (padded) head slice
#define UT (BC * UR / 128)  // units of K, and of V, an invocation loads a tile

shared vec4 Qt[HD * BR4];   // Q transposed: [d][row / 4]
shared vec4 Kt[HD * KS4];   // the tile's keys transposed: [d][key / 4]
shared vec4 Vs[BC * HD4];   // [key][d / 4]
shared vec4 Ps[BC * PS4];   // the tile's probabilities transposed: [key][row / 4]
#if !SG
shared float red[BR * 8];   // a row's 8 lanes' maxima / sums
#endif

#define NEG_INF uintBitsToFloat(0xff800000u)

// A row's value over its 8 lanes (adjacent invocations): max (mx) or sum.
float row_max(float v) {
#if SG
  v = max(v, subgroupShuffleXor(v, 1u));
  v = max(v, subgroupShuffleXor(v, 2u));
  v = max(v, subgroupShuffleXor(v, 4u));
#endif
  return v;
}
float row_sum(float v) {
#if SG
  v += subgroupShuffleXor(v, 1u);
  v += subgroupShuffleXor(v, 2u);
  v += subgroupShuffleXor(v, 4u);
#endif
  return v;
}

// This lane's RT rows of a [..][row / 4] vec4 array at vec4 index base (rows ty * RT ..).
#if RT == 4
#define ROWS(arr, base, ty, out4) { out4 = arr[(base) + (ty)]; }
#else
#define ROWS(arr, base, ty, out4) { const vec4 w_ = arr[(base) + ((ty) >> 1)]; out4 = ((ty) & 1) == 0 ? w_ : w_.zwxy; }
#endif

void main() {
  const int tid = int(gl_LocalInvocationID.x), tx = tid & 7, ty = tid >> 3;
  const int h = int(gl_WorkGroupID.y), t0 = int(gl_WorkGroupID.x) * BR;
  const int hd = HDIM, n_tok = pc.n_tok, n_kv = NKV;
  const int kvh = h / (NH / NKVH);
  const int kvtype = KVTYPE;
  const uint head_off = kvtype == 0 ? uint(kvh * hd * 4) : kvtype == 1 ? uint(kvh * hd * 2)
                                                                         : uint(kvh * (hd / 32) * 34);
  const uint koff = pc.k_off + head_off, voff = pc.v_off + head_off;
  // f16 rows whose K and V slices start 4-aligned: two values a 32-bit load.
  const uint align = uint(pc.base) | pc.page_bytes | pc.row_bytes | koff | voff;
  const bool pairs = kvtype == 1 && (hd & 1) == 0 && (align & 3u) == 0u;
  const bool units = kvtype == 1 && (hd & 7) == 0 && (align & 15u) == 0u && !NO_UNITS;

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
    Qt[d * BR4 + (r >> 2)][r & 3] = v;
  }
  float o[RT][OG * 4], m[RT], l[RT];
  [[unroll]] for (int i = 0; i < RT; ++i) {
    m[i] = NEG_INF, l[i] = 0.0f;
    [[unroll]] for (int c = 0; c < OG * 4; ++c) o[i][c] = 0.0f;
  }
  const int first = lo >= hi ? hi : lo - lo % BC;
  // The units path's registers: K's units are taken key-fastest (a subgroup's stores into Kt's
  // transposed rows land on distinct banks), V's unit-fastest (its vec4 rows likewise).
  uvec4 kr[UT], vr[UT];
#define LOAD_UNITS(j0_)                                                                            \
  [[unroll]] for (int i = 0; i < UT; ++i) {                                                        \
    const int id = tid + 128 * i, jk = id % BC, uk = id / BC, jv = id / UR, uv = id % UR;          \
    kr[i] = uvec4(0u), vr[i] = uvec4(0u);                                                          \
    if ((j0_) + jk < hi && uk * 8 < hd)                                                            \
      kr[i] = V4U(kv_row_at(pc.base, pc.pages, pc.page_bytes, pc.row_bytes, PSHIFT, (j0_) + jk) +  \
                  koff + uint(uk) * 16u).v[0];                                                     \
    if ((j0_) + jv < hi && uv * 8 < hd)                                                            \
      vr[i] = V4U(kv_row_at(pc.base, pc.pages, pc.page_bytes, pc.row_bytes, PSHIFT, (j0_) + jv) +  \
                  voff + uint(uv) * 16u).v[0];                                                     \
  }
  if (units && first < hi) LOAD_UNITS(first)
  for (int j0 = first; j0 < hi; j0 += BC) {
    barrier();  // the previous tile's Kt / Vs / Ps (and red) are read
    if (units) {
      [[unroll]] for (int i = 0; i < UT; ++i) {
        const int id = tid + 128 * i, jk = id % BC, dk = (id / BC) * 8, jv = id / UR, dv = (id % UR) * 8;
        const uvec4 k = kr[i], v = vr[i];
        [[unroll]] for (int e = 0; e < 4; ++e) {
          const vec2 f = unpackHalf2x16(k[e]);
          Kt[(dk + 2 * e) * KS4 + (jk >> 2)][jk & 3] = f.x;
          Kt[(dk + 2 * e + 1) * KS4 + (jk >> 2)][jk & 3] = f.y;
        }
        Vs[jv * HD4 + (dv >> 2)] = vec4(unpackHalf2x16(v.x), unpackHalf2x16(v.y));
        Vs[jv * HD4 + (dv >> 2) + 1] = vec4(unpackHalf2x16(v.z), unpackHalf2x16(v.w));
      }
    } else if (pairs) {
      for (int idx = tid; idx < BC * HD / 2; idx += 128) {
        const int j = idx / (HD / 2), d = (idx % (HD / 2)) * 2;
        vec2 kv = vec2(0.0f), vv = vec2(0.0f);
        if (j0 + j < hi && d < hd) {
          const uint64_t rb = kv_row_at(pc.base, pc.pages, pc.page_bytes, pc.row_bytes, PSHIFT, j0 + j);
          kv = unpackHalf2x16(U32(rb + koff + uint(d) * 2u).v[0]);
          vv = unpackHalf2x16(U32(rb + voff + uint(d) * 2u).v[0]);
        }
        Kt[d * KS4 + (j >> 2)][j & 3] = kv.x;
        Kt[(d + 1) * KS4 + (j >> 2)][j & 3] = kv.y;
        Vs[j * HD4 + (d >> 2)][d & 3] = vv.x;
        Vs[j * HD4 + (d >> 2)][(d & 3) + 1] = vv.y;
      }
    } else {
      for (int idx = tid; idx < BC * HD; idx += 128) {
        const int j = idx / HD, d = idx % HD;
        float kv = 0.0f, vv = 0.0f;
        if (j0 + j < hi && d < hd) {
          const uint64_t rb = kv_row_at(pc.base, pc.pages, pc.page_bytes, pc.row_bytes, PSHIFT, j0 + j);
          kv = kv_value(rb + koff, d, kvtype);
          vv = kv_value(rb + voff, d, kvtype);
        }
        Kt[d * KS4 + (j >> 2)][j & 3] = kv;
        Vs[j * HD4 + (d >> 2)][d & 3] = vv;
      }
    }
    barrier();
    if (units && j0 + BC < hi) LOAD_UNITS(j0 + BC)
    float s[RT][4];
    [[unroll]] for (int i = 0; i < RT; ++i)
      [[unroll]] for (int c = 0; c < 4; ++c) s[i][c] = 0.0f;
    [[unroll]] for (int d = 0; d < HD; ++d) {
      const vec4 k = Kt[d * KS4 + tx];
      vec4 q;
      ROWS(Qt, d * BR4, ty, q)
      [[unroll]] for (int i = 0; i < RT; ++i)
        [[unroll]] for (int c = 0; c < 4; ++c) s[i][c] = fma(q[i], k[c], s[i][c]);
    }
    float p4[4][RT];  // the probabilities, [key][row] as Ps takes them
#if !SG
    [[unroll]] for (int i = 0; i < RT; ++i) {
      const int p = pos[i];
      const int rlo = pc.window > 0 ? p - pc.window + 1 : -0x7fffffff;
      float mx = NEG_INF;
      [[unroll]] for (int c = 0; c < 4; ++c) {
        const int j = j0 + tx * 4 + c;
        const float v = pc.softcap > 0.0f ? pc.softcap * tanh_safe(s[i][c] * pc.scale / pc.softcap) : s[i][c] * pc.scale;
        s[i][c] = j < hi && j <= p && j >= rlo ? v : NEG_INF;
        mx = max(mx, s[i][c]);
      }
      red[(ty * RT + i) * 8 + tx] = mx;
    }
    barrier();
#endif
    [[unroll]] for (int i = 0; i < RT; ++i) {
      float mx = m[i];
#if SG
      const int p = pos[i];
      const int rlo = pc.window > 0 ? p - pc.window + 1 : -0x7fffffff;
      [[unroll]] for (int c = 0; c < 4; ++c) {
        const int j = j0 + tx * 4 + c;
        const float v = pc.softcap > 0.0f ? pc.softcap * tanh_safe(s[i][c] * pc.scale / pc.softcap) : s[i][c] * pc.scale;
        s[i][c] = j < hi && j <= p && j >= rlo ? v : NEG_INF;
        mx = max(mx, s[i][c]);
      }
      mx = row_max(mx);
#else
      [[unroll]] for (int u = 0; u < 8; ++u) mx = max(mx, red[(ty * RT + i) * 8 + u]);
#endif
      const float corr = mx == NEG_INF ? 1.0f : exp(m[i] - mx);  // m = -inf before any key: 0
      m[i] = mx;
      l[i] *= corr;
      [[unroll]] for (int c = 0; c < OG * 4; ++c) o[i][c] *= corr;
      [[unroll]] for (int c = 0; c < 4; ++c) {
        const float pv = s[i][c] == NEG_INF ? 0.0f : exp(s[i][c] - mx);
        l[i] += pv;
        p4[c][i] = pv;
      }
    }
    [[unroll]] for (int c = 0; c < 4; ++c) {
#if RT == 4
      Ps[(tx * 4 + c) * PS4 + ty] = vec4(p4[c][0], p4[c][1], p4[c][2], p4[c][3]);
#else
      Ps[(tx * 4 + c) * PS4 + (ty >> 1)][(ty & 1) * 2] = p4[c][0];
      Ps[(tx * 4 + c) * PS4 + (ty >> 1)][(ty & 1) * 2 + 1] = p4[c][1];
#endif
    }
    barrier();
    // Keys past hi have p = 0 and V = 0: the whole tile adds exactly what its keys add.
    [[unroll]] for (int j = 0; j < BC; ++j) {
      vec4 p;
      ROWS(Ps, j * PS4, ty, p)
      [[unroll]] for (int g = 0; g < OG; ++g) {
        const vec4 v = Vs[j * HD4 + g * 8 + tx];
        [[unroll]] for (int i = 0; i < RT; ++i)
          [[unroll]] for (int e = 0; e < 4; ++e) o[i][g * 4 + e] = fma(p[i], v[e], o[i][g * 4 + e]);
      }
    }
  }
#if !SG
  barrier();  // red is read (the last tile's maxima)
  [[unroll]] for (int i = 0; i < RT; ++i) red[(ty * RT + i) * 8 + tx] = l[i];
  barrier();
#endif
  [[unroll]] for (int i = 0; i < RT; ++i) {
    const int t = t0 + ty * RT + i;
#if SG
    float L = row_sum(l[i]);
#else
    float L = 0.0f;
    for (int u = 0; u < 8; ++u) L += red[(ty * RT + i) * 8 + u];
#endif
    if (t >= n_tok) continue;
    float f = 1.0f;
    if (pc.sinks != 0ul) {  // the sink joins the denominator: rescale to the joint max
      const float sink = F32(pc.sinks).v[h], M2 = max(m[i], sink);
      f = m[i] == NEG_INF ? 0.0f : exp(m[i] - M2);
      L = L * f + exp(sink - M2);
    }
    const float inv = L > 0.0f ? f / L : 0.0f;
    F32 out_row = F32(pc.out_ + (uint64_t(t) * uint64_t(pc.out_stride) + uint64_t(h * hd)) * 4u);
    [[unroll]] for (int g = 0; g < OG; ++g)
      [[unroll]] for (int e = 0; e < 4; ++e) {
        const int d = g * 32 + tx * 4 + e;
        if (d < hd) out_row.v[d] = o[i][g * 4 + e] * inv;
      }
  }
}
