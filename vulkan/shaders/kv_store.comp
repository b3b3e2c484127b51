// Writes rows of K (workgroup y 0) and V (y 1) into cache rows first.. through the block
// table: f32 as is, f16 rounded to nearest even, q8_0 as gguf-py / ggml quantize it
// (d = amax / 127, q = round-half-away(x / d), d stored as f16): byte-exact with them.
#version 450
#include "common.glsl"

layout(local_size_x = 64) in;
layout(push_constant, std430) uniform PC {
  uint64_t base, pages, k, v;
  uint64_t args;  // first < 0: the first row is args[-first - 1] (a replayed step's value)
  uint64_t pos, inv_freq, factors;  // rope != 0: rope.comp's, for K rows rotated on the way
  uint page_bytes, k_off, v_off, row_bytes;
  int first_, src_stride, dim, page_shift, kvtype, row_base;
  uint rope;  // n_rot | neox << 16 | query heads << 17, or 0
  uint head_dim;
  float freq_scale, mscale;
  uint64_t q;  // query heads > 0: workgroup y 2 rotates the query rows here (q_stride = heads * head_dim)
} pc;
// With rope set, a K row is rotated (as rope.comp would, in place) before it is stored: the
// step's rope of the keys folded in (vulkan_backend.cpp, kv_store). The rotated row is also
// written back, leaving k as the rope would have. With query heads set too, the queries' rope
// is folded in as well: workgroups y 2 rotate a query row each, in place, and store nothing.
shared float rowk[4096];
int first_row() { return pc.first_ >= 0 ? pc.first_ : I32(pc.args).v[-pc.first_ - 1]; }

shared float amax[64];

uint64_t kv_row(uint off, int j) {
  const int64_t jj = int64_t(j);
  const int64_t page = int64_t(I32(pc.pages).v[uint(jj >> pc.page_shift)]);
  const int64_t mask = (int64_t(1) << pc.page_shift) - 1;
  return pc.base + uint64_t(page) * pc.page_bytes + off + uint64_t(jj & mask) * pc.row_bytes;
}

float roundf_away(float x) {  // C roundf, in exact steps (as gguf-py's np_roundf)
  const float a = abs(x), f = floor(a);
  return sign(x) * (f + floor(2.0f * (a - f)));
}

void main() {
  const int i = pc.row_base + int(gl_WorkGroupID.x), tid = int(gl_LocalInvocationID.x);
  const bool is_v = gl_WorkGroupID.y == 1u, is_q = gl_WorkGroupID.y == 2u;
  const int dim = is_q ? int((pc.rope >> 17) * pc.head_dim) : pc.dim;
  F32 src = F32(is_q ? pc.q + uint64_t(i) * uint64_t(dim) * 4u
                     : (is_v ? pc.v : pc.k) + uint64_t(i) * uint64_t(pc.src_stride) * 4u);
  const bool rot = !is_v && pc.rope != 0u;  // uniform in the workgroup
  const uint64_t sa = is_q ? pc.q + uint64_t(i) * uint64_t(dim) * 4u
                           : (is_v ? pc.v : pc.k) + uint64_t(i) * uint64_t(pc.src_stride) * 4u;
  if (rot) {
    if ((sa & 15ul) == 0ul && dim % 4 == 0) {
      // 16-byte loads, four an invocation in flight (a query row is 2048 values in one workgroup).
      V4 s4 = V4(sa);
      const int d4 = dim / 4;
      for (int e0 = tid; e0 < d4; e0 += 256) {
        vec4 t4[4];
        [[unroll]] for (int u = 0; u < 4; ++u) t4[u] = e0 + 64 * u < d4 ? s4.v[e0 + 64 * u] : vec4(0.0f);
        [[unroll]] for (int u = 0; u < 4; ++u) {
          const int e = 4 * (e0 + 64 * u);
          if (e < dim) rowk[e] = t4[u].x, rowk[e + 1] = t4[u].y, rowk[e + 2] = t4[u].z, rowk[e + 3] = t4[u].w;
        }
      }
    } else {
      for (int e = tid; e < dim; e += 64) rowk[e] = src.v[e];
    }
    barrier();
    const uint n_rot = pc.rope & 0xffffu, half_ = n_rot / 2u, hd = pc.head_dim;
    const bool neox = ((pc.rope >> 16) & 1u) != 0u;
    const uint pairs = uint(dim) / hd * half_;
    const int p = I32(pc.pos).v[i];
    if (half_ > 0u && 64u % half_ == 0u) {
      // Pair j of every head turns by the same angle: its cos and sin once an invocation (the
      // same values each head's own call would give), then the heads 64 / half_ apart.
      const uint j = uint(tid) % half_;
      float c, s;
      rope_cs(pc.inv_freq, pc.factors, j, p, pc.freq_scale, pc.mscale, c, s);
      for (uint h = uint(tid) / half_; h * half_ < pairs; h += 64u / half_) {
        const uint i0 = h * hd + (neox ? j : 2u * j);
        const uint i1 = h * hd + (neox ? j + half_ : 2u * j + 1u);
        const float a = rowk[i0], b = rowk[i1];
        precise float ac = a * c, bs = b * s, as_ = a * s, bc = b * c;
        rowk[i0] = ac - bs;
        rowk[i1] = as_ + bc;
      }
    } else {
      for (uint idx = uint(tid); idx < pairs; idx += 64u) {
        const uint h = idx / half_, j = idx % half_;
        float c, s;
        rope_cs(pc.inv_freq, pc.factors, j, p, pc.freq_scale, pc.mscale, c, s);
        const uint i0 = h * hd + (neox ? j : 2u * j);
        const uint i1 = h * hd + (neox ? j + half_ : 2u * j + 1u);
        const float a = rowk[i0], b = rowk[i1];
        precise float ac = a * c, bs = b * s, as_ = a * s, bc = b * c;
        rowk[i0] = ac - bs;
        rowk[i1] = as_ + bc;
      }
    }
    barrier();
    if ((sa & 15ul) == 0ul && dim % 4 == 0) {
      V4 o4 = V4(sa);
      for (int e = tid; e < dim / 4; e += 64) o4.v[e] = vec4(rowk[4 * e], rowk[4 * e + 1], rowk[4 * e + 2], rowk[4 * e + 3]);
    } else {
      for (int e = tid; e < dim; e += 64) src.v[e] = rowk[e];
    }
  }
  if (is_q) return;
  const uint64_t dst = kv_row(is_v ? pc.v_off : pc.k_off, first_row() + i);
  if (pc.kvtype == 0) {
    for (int e = tid; e < pc.dim; e += 64) F32(dst).v[e] = rot ? rowk[e] : src.v[e];
  } else if (pc.kvtype == 1) {
    if (!rot && (sa & 15ul) == 0ul && (dst & 7ul) == 0ul && pc.dim % 4 == 0) {
      // A V row (or keys not rotated): 16-byte loads, four halves two words a store.
      V4 s4 = V4(sa);
      U2 o = U2(dst);
      const int d4 = pc.dim / 4;
      for (int e0 = tid; e0 < d4; e0 += 128) {
        vec4 t4[2];
        [[unroll]] for (int u = 0; u < 2; ++u) t4[u] = e0 + 64 * u < d4 ? s4.v[e0 + 64 * u] : vec4(0.0f);
        [[unroll]] for (int u = 0; u < 2; ++u)
          if (e0 + 64 * u < d4)
            o.v[e0 + 64 * u] = uvec2(f2h(t4[u].x) | f2h(t4[u].y) << 16, f2h(t4[u].z) | f2h(t4[u].w) << 16);
      }
    } else if ((dst & 3ul) == 0ul && pc.dim % 2 == 0) {
      // Two halves a word, both this invocation's: plain stores, not two atomics a half.
      U32 o = U32(dst);
      for (int e = 2 * tid; e < pc.dim; e += 128) {
        const uint lo = f2h(rot ? rowk[e] : src.v[e]), hi = f2h(rot ? rowk[e + 1] : src.v[e + 1]);
        o.v[e / 2] = lo | hi << 16;
      }
    } else {
      for (int e = tid; e < pc.dim; e += 64) wr16(dst + uint64_t(e) * 2u, f2h(rot ? rowk[e] : src.v[e]));
    }
  } else {
    // Two 32-blocks per pass: invocations 0..31 and 32..63.
    const int lane = tid & 31, half_ = tid >> 5;
    for (int b0 = 0; b0 < pc.dim / 32; b0 += 2) {
      const int b = b0 + half_;
      const bool ok = b < pc.dim / 32;
      const float x = ok ? (rot ? rowk[b * 32 + lane] : src.v[b * 32 + lane]) : 0.0f;
      amax[tid] = abs(x);
      barrier();
      float mx = 0.0f;
      for (int k = 0; k < 32; ++k) mx = max(mx, amax[half_ * 32 + k]);
      barrier();
      if (ok) {
        // In double, then rounded once: the f32 quotient correctly rounded, as on the CPU
        // (a driver's f32 division may be off by an ulp and flip a rounding).
        const float d = float(double(mx) / 127.0lf);
        const float id = d == 0.0f ? 0.0f : float(1.0lf / double(d));
        const uint64_t blk = dst + uint64_t(b) * 34u;
        precise float xs = x * id;
        wr8(blk + 2u + uint(lane), uint(int(roundf_away(xs))) & 0xffu);
        if (lane == 0) wr16(blk, f2h(d));
      }
    }
  }
}
