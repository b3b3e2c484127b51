// dq8: elements 8g..8g+7 of a weight row in ggml format TYPE (a compile-time define), the
// values of cpp/quant's reference decoders (products rounded on their own: `precise`).
// Float rows may end mid-group (elements past cols read 0); quantized rows are whole blocks.
#define T_F32 0
#define T_F16 1
#define T_Q4_0 2
#define T_Q4_1 3
#define T_Q5_0 6
#define T_Q5_1 7
#define T_Q8_0 8
#define T_Q4_K 12
#define T_Q5_K 13
#define T_Q6_K 14
#define T_BF16 30
#define T_MXFP4 39
// Not file types: q8_0 and q4_0 in this backend's split layout (vulkan_backend.cpp, load_weight).
#define T_Q8_0S 40
#define T_Q4_0S 41

// q4_K / q5_K: sub-block j's 6-bit scale and min from the block's 12 packed bytes (three words,
// little-endian), and the same from the bytes at s (any alignment).
uint kbyte(uvec3 w, uint i) { return (w[i >> 2] >> ((i & 3u) * 8u)) & 0xFFu; }
void k_scale_min_w(uvec3 w, uint j, out uint sc, out uint mn) {
  if (j < 4u) {
    sc = kbyte(w, j) & 0x3Fu;
    mn = kbyte(w, j + 4u) & 0x3Fu;
  } else {
    sc = (kbyte(w, j + 4u) & 0xFu) | ((kbyte(w, j - 4u) >> 2) & 0x30u);
    mn = (kbyte(w, j + 4u) >> 4) | ((kbyte(w, j) >> 2) & 0x30u);
  }
}
void k_scale_min(uint64_t s, uint j, out uint sc, out uint mn) {
  k_scale_min_w(uvec3(rd32(s), rd32(s + 4u), rd32(s + 8u)), j, sc, mn);
}

void dq8(uint64_t row, uint g, uint cols, out float v[8]) {
  const uint e0 = g * 8u;
#if TYPE == T_F32
  F32 p = F32(row);
  [[unroll]] for (uint i = 0u; i < 8u; ++i) {
    v[i] = 0.0f;
    if (e0 + i < cols) v[i] = p.v[e0 + i];
  }
#elif TYPE == T_F16 || TYPE == T_BF16
  [[unroll]] for (uint i = 0u; i < 8u; ++i) {
    uint h = 0u;
    if (e0 + i < cols) h = rd16(row + 2u * (e0 + i));
#if TYPE == T_F16
    v[i] = h2f(h);
#else
    v[i] = bf2f(h);
#endif
  }
#elif TYPE == T_Q8_0
  const uint64_t b = row + uint64_t(g >> 2) * 34u;
  const float d = h2f(rd16(b));
  const uint64_t q = b + 2u + (g & 3u) * 8u;
  const uint w0 = rd32(q), w1 = rd32(q + 4u);
  [[unroll]] for (uint i = 0u; i < 4u; ++i) {
    precise float a = float(sbyte(w0, i)) * d, c = float(sbyte(w1, i)) * d;
    v[i] = a, v[i + 4u] = c;
  }
#elif TYPE == T_Q8_0S
  // A row's cols quants (group g: one aligned 8-byte load, adjacent lanes adjacent bytes),
  // then its f16 scales: the values of q8_0's blocks, without their 34-byte stride.
  const float d = h2f(rd16(row + uint64_t(cols) + uint64_t(g >> 2) * 2u));
  const uvec2 w = U2(row + uint64_t(g) * 8u).v[0];
  [[unroll]] for (uint i = 0u; i < 4u; ++i) {
    precise float a = float(sbyte(w.x, i)) * d, c = float(sbyte(w.y, i)) * d;
    v[i] = a, v[i + 4u] = c;
  }
#elif TYPE == T_Q4_0S
  // A row's cols / 2 quant bytes (block b's 16 bytes: elements 0-15 the low nibbles, 16-31 the
  // high ones), then its f16 scales. Group g: 8 bytes at one aligned load, one nibble each.
  const uint o = (g & 3u) * 8u;
  const float d = h2f(rd16(row + uint64_t(cols / 2u) + uint64_t(g >> 2) * 2u));
  const uvec2 w = U2(row + uint64_t(g >> 2) * 16u + uint64_t(o & 15u)).v[0];
  const uint sh = (o >> 4) * 4u;
  [[unroll]] for (uint i = 0u; i < 8u; ++i) {
    const int n = int(((i < 4u ? w.x : w.y) >> ((i & 3u) * 8u + sh)) & 0xFu);
    v[i] = d * float(n - 8);
  }
#elif TYPE == T_MXFP4
  // e2m1 doubled ({0, 1, 2, 3, 4, 6, 8, 12}, bit 3 the sign) times the e8m0 scale halved.
  const uint64_t b = row + uint64_t(g >> 2) * 17u;
  const uint e = rd8(b);
  const float d = uintBitsToFloat(e < 2u ? 0x00200000u << e : (e - 1u) << 23);
  const uint o = (g & 3u) * 8u;
  const uint sh = (o >> 4) * 4u;
  const uint64_t q = b + 1u + (o & 15u);
  [[unroll]] for (uint i = 0u; i < 8u; ++i) {
    const uint n = (rd8(q + i) >> sh) & 0xFu, m = n & 7u;
    const uint a = m <= 4u ? m : (m == 5u ? 6u : (m == 6u ? 8u : 12u));
    if (e >= 2u) {
      precise float p = d * float((n & 8u) != 0u ? -int(a) : int(a));  // code 8 (-0) is +0, as in ggml
      v[i] = p;
    } else {
      // d is subnormal (2^-128 or 2^-127), which GPUs flush to zero in arithmetic: the exact
      // product a * d built from its bits. Below 2^-126 a float's bits are linear in its value
      // (units of 2^-149); above, float(a) with its exponent lowered by 128 - e.
      const uint lin = a << (e + 21u);
      const uint bits = a == 0u ? 0u : (lin < 0x800000u ? lin : floatBitsToUint(float(a)) - ((128u - e) << 23));
      v[i] = uintBitsToFloat(a == 0u ? 0u : bits | ((n & 8u) << 28));
    }
  }
#elif TYPE == T_Q4_0 || TYPE == T_Q4_1 || TYPE == T_Q5_0 || TYPE == T_Q5_1
#if TYPE == T_Q4_0
  const uint BYTES = 18u, QS = 2u;
#elif TYPE == T_Q4_1
  const uint BYTES = 20u, QS = 4u;
#elif TYPE == T_Q5_0
  const uint BYTES = 22u, QS = 6u;
#else
  const uint BYTES = 24u, QS = 8u;
#endif
  const uint64_t b = row + uint64_t(g >> 2) * BYTES;
  const float d = h2f(rd16(b));
  const uint o = (g & 3u) * 8u;      // first element inside the 32-block
  const uint sh = (o >> 4) * 4u;     // elements 16..31 are the high nibbles of bytes 0..15
  const uint64_t q = b + QS + (o & 15u);
  const uint w0 = rd32(q), w1 = rd32(q + 4u);
#if TYPE == T_Q5_0 || TYPE == T_Q5_1
  const uint qh = rd32(b + (TYPE == T_Q5_1 ? 4u : 2u)) >> o;  // bit j: element j's fifth bit
#endif
  [[unroll]] for (uint i = 0u; i < 8u; ++i) {
    int n = int(((i < 4u ? w0 : w1) >> ((i & 3u) * 8u + sh)) & 0xFu);
#if TYPE == T_Q5_0 || TYPE == T_Q5_1
    n |= int((qh >> i) & 1u) << 4;
#endif
#if TYPE == T_Q4_1 || TYPE == T_Q5_1
    const float m = h2f(rd16(b + 2u));
    precise float p = d * float(n);
    v[i] = p + m;
#elif TYPE == T_Q4_0
    v[i] = d * float(n - 8);
#else
    v[i] = d * float(n - 16);
#endif
  }
#elif TYPE == T_Q4_K || TYPE == T_Q5_K
  const uint64_t b = row + uint64_t(g >> 5) * (TYPE == T_Q4_K ? 144u : 176u);
  const uint e = (g & 31u) * 8u;
  const uint j = e >> 5, l0 = e & 31u;
  const float d = h2f(rd16(b)), dmin = h2f(rd16(b + 2u));
  uint sc, mn;
  k_scale_min(b + 4u, j, sc, mn);
  precise float dl = d * float(sc);
  precise float ml = dmin * float(mn);
  const uint64_t q = b + (TYPE == T_Q4_K ? 16u : 48u) + (j >> 1) * 32u + l0;
  const uint w0 = rd32(q), w1 = rd32(q + 4u);
  const uint nsh = (j & 1u) * 4u;
#if TYPE == T_Q5_K
  const uint h0 = rd32(b + 16u + l0), h1 = rd32(b + 20u + l0);
#endif
  [[unroll]] for (uint i = 0u; i < 8u; ++i) {
    uint n = ((i < 4u ? w0 : w1) >> ((i & 3u) * 8u + nsh)) & 0xFu;
#if TYPE == T_Q5_K
    n |= (((i < 4u ? h0 : h1) >> ((i & 3u) * 8u + j)) & 1u) << 4;
#endif
    precise float p = dl * float(n);
    v[i] = p - ml;
  }
#elif TYPE == T_Q6_K
  const uint64_t b = row + uint64_t(g >> 5) * 210u;
  const uint e = (g & 31u) * 8u;
  const uint h = e >> 7, s = (e >> 5) & 3u, l0 = e & 31u;
  const float d = h2f(rd16(b + 208u));
  precise float dl = d * float(sbyte(rd8(b + 192u + (e >> 4)), 0u));
  const uint64_t ql = b + h * 64u + (s & 1u) * 32u + l0, qh = b + 128u + h * 32u + l0;
  const uint l0w = rd32(ql), l1w = rd32(ql + 4u), h0w = rd32(qh), h1w = rd32(qh + 4u);
  const uint shl = (s >> 1) * 4u, shh = 2u * s;
  [[unroll]] for (uint i = 0u; i < 8u; ++i) {
    const uint bl = ((i < 4u ? l0w : l1w) >> ((i & 3u) * 8u)) & 0xFFu;
    const uint bh = ((i < 4u ? h0w : h1w) >> ((i & 3u) * 8u)) & 0xFFu;
    const int n = int(((bl >> shl) & 0xFu) | (((bh >> shh) & 3u) << 4)) - 32;
    v[i] = dl * float(n);
  }
#else
#error "dq8: unknown TYPE"
#endif
}
