// The KV tail of a Q/K/V GEMV (gemv_i8x.comp flags 8, gemv.comp -DKVT): the step's ropes and
// KV store done by the last workgroup to finish each head's rows, as kv_store.comp does them
// (rope_cs, f2h, q8_0's blocks), so the kv_store dispatch and its barrier are taken back.
// The includer defines KV_H(e) (a head's row, 256 values, in shared memory) and KV_AMAX(i) (32
// floats in shared memory), and calls with NL invocations, l its own index; every invocation
// calls (barriers inside). Needs GL_EXT_shader_explicit_arithmetic_types_float64.
layout(buffer_reference, std430, buffer_reference_align = 8) buffer KvP {  // vulkan_backend.cpp's KvTailParams
  uint64_t base, pages, args, pos, inv, factors;
  uint page_bytes, k_off, v_off, row_bytes;
  int first_, page_shift, kvtype;
  uint rope, head_dim;  // rope: n_rot | neox << 16
  float freq_scale, mscale;
  uint64_t cnt;  // the counters, a head each (queries', then KV heads'): gemv.comp's
};
float roundf_away(float x) {  // kv_store.comp's
  const float a = abs(x), f = floor(a);
  return sign(x) * (f + floor(2.0f * (a - f)));
}
// KV_H's head_dim values into the cache row at dst, head `head`, as kv_store.comp stores a row.
void kv_put(KvP P, uint64_t dst, uint head, uint hd, uint l, uint NL) {
  if (P.kvtype == 0) {
    for (uint e = l; e < hd; e += NL) F32(dst).v[head * hd + e] = float(KV_H(e));
  } else if (P.kvtype == 1) {
    if ((dst & 3ul) == 0ul && hd % 2u == 0u) {
      U32 o = U32(dst + uint64_t(head * hd) * 2u);
      for (uint e = 2u * l; e < hd; e += 2u * NL) o.v[e / 2u] = f2h(float(KV_H(e))) | f2h(float(KV_H(e + 1u))) << 16;
    } else {
      for (uint e = l; e < hd; e += NL) wr16(dst + uint64_t(head * hd + e) * 2u, f2h(float(KV_H(e))));
    }
  } else {  // q8_0: a block of 32 at a time over invocations 0-31
    for (uint b = 0u; b < hd / 32u; ++b) {
      const float x = l < 32u ? float(KV_H(b * 32u + l)) : 0.0f;
      if (l < 32u) KV_AMAX(l) = abs(x);
      barrier();
      float mx = 0.0f;
      for (uint k = 0u; k < 32u; ++k) mx = max(mx, KV_AMAX(k));
      barrier();
      const float d = float(double(mx) / 127.0lf);
      const float id = d == 0.0f ? 0.0f : float(1.0lf / double(d));
      const uint64_t blk = dst + uint64_t(head * (hd / 32u) + b) * 34u;
      precise float xs = x * id;
      if (l < 32u) wr8(blk + 2u + l, uint(int(roundf_away(xs))) & 0xffu);
      if (l == 0u) wr16(blk, f2h(d));
    }
  }
}
// Head `head` of weight mi (0: a query head, rotated in place in y0; 1 or 2: a KV head, its keys
// rotated (written back to y1, as the rope would leave them) and stored with its values from y2)
// for each of n tokens. y0..y2 rows are rows0..rows2 wide; the GEMV's writes are visible (its
// writers' memoryBarrierBuffer, then the counter), and they are read through coherent views.
void kv_tail(KvP P, uint mi, uint head, uint n, uint64_t y0, uint64_t y1, uint64_t y2, uint rows0, uint rows1,
             uint rows2, uint l, uint NL) {
  const uint hd = P.head_dim, half_ = (P.rope & 0xffffu) / 2u;
  const bool neox = ((P.rope >> 16) & 1u) != 0u;
  const int first = P.first_ >= 0 ? P.first_ : I32(P.args).v[-P.first_ - 1];
  for (uint t = 0u; t < n; ++t) {
    const int p = I32(P.pos).v[t];
    if (mi == 0u) {  // a query head, in place (kv_store.comp's rotation, pair by pair)
      F32C qy = F32C(y0 + (uint64_t(t) * rows0 + head * hd) * 4u);
      for (uint j = l; j < half_; j += NL) {
        float c, s;
        rope_cs(P.inv, P.factors, j, p, P.freq_scale, P.mscale, c, s);
        const uint i0 = neox ? j : 2u * j, i1 = neox ? j + half_ : 2u * j + 1u;
        const float a = qy.v[i0], b = qy.v[i1];
        precise float ac = a * c, bs = b * s, as_ = a * s, bc = b * c;
        qy.v[i0] = ac - bs;
        qy.v[i1] = as_ + bc;
      }
      continue;
    }
    // The cache row of token t (kv_store.comp's kv_row).
    const int64_t jj = int64_t(first) + int64_t(t);
    const int64_t page = int64_t(I32(P.pages).v[uint(jj >> P.page_shift)]);
    const uint64_t row = P.base + uint64_t(page) * P.page_bytes + uint64_t(jj & ((int64_t(1) << P.page_shift) - 1)) * P.row_bytes;
    F32C ky = F32C(y1 + (uint64_t(t) * rows1 + head * hd) * 4u);
    for (uint e = l; e < hd; e += NL) KV_H(e) = ky.v[e];
    barrier();
    for (uint j = l; j < half_; j += NL) {
      float c, s;
      rope_cs(P.inv, P.factors, j, p, P.freq_scale, P.mscale, c, s);
      const uint i0 = neox ? j : 2u * j, i1 = neox ? j + half_ : 2u * j + 1u;
      const float a = float(KV_H(i0)), b = float(KV_H(i1));
      precise float ac = a * c, bs = b * s, as_ = a * s, bc = b * c;
      KV_H(i0) = ac - bs;
      KV_H(i1) = as_ + bc;
    }
    barrier();
    for (uint e = l; e < hd; e += NL) ky.v[e] = float(KV_H(e));
    kv_put(P, row + P.k_off, head, hd, l, NL);
    barrier();
    F32C vy = F32C(y2 + (uint64_t(t) * rows2 + head * hd) * 4u);
    for (uint e = l; e < hd; e += NL) KV_H(e) = vy.v[e];
    barrier();
    kv_put(P, row + P.v_off, head, hd, l, NL);
    barrier();
  }
}
