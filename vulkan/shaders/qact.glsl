// The rounding of a 32-block of activations to int8 in q8 mode, shared by quant_act.comp (its
// own dispatch) and gemv_q.comp (which rounds x itself as it starts), so that both give the
// same bits: the CPU's q8 mode (cpp/cpu/matmul_isa.cpp, quant_block) and CUDA (quantize_act_k)
// round alike: d = amax / 127, q = rint(x * (127 / amax)) clamped to +-127 (NaN to -127). The
// two divisions in f64 rounded to f32, since Vulkan's f32 division need not be correctly rounded.
// Needs GL_EXT_shader_explicit_arithmetic_types_float64.

// v times the RMS scale sc, then times the norm weight nw (where not 0) at elements e0..e0+31:
// the values norm.comp would write, rounded as it rounds them.
void qa_norm(inout vec4 v[8], float sc, uint64_t nw, uint e0) {
  [[unroll]] for (uint i = 0u; i < 8u; ++i)
    [[unroll]] for (uint c = 0u; c < 4u; ++c) {
      precise float e = v[i][c] * sc;
      if (nw != 0ul) e = e * F32(nw).v[e0 + i * 4u + c];
      v[i][c] = e;
    }
}

// The block's 32 quants packed 4 a word (w) and its scale (returned).
float qa_round(vec4 v[8], out uint w[8]) {
  float amax = 0.0f;
  [[unroll]] for (uint i = 0u; i < 8u; ++i) {
    const vec4 a = abs(v[i]);
    amax = max(amax, max(max(a.x, a.y), max(a.z, a.w)));
  }
  const float id = amax > 0.0f ? float(127.0lf / double(amax)) : 0.0f;
  [[unroll]] for (uint i = 0u; i < 8u; ++i) {
    uint packed = 0u;
    [[unroll]] for (uint c = 0u; c < 4u; ++c) {
      precise float s = v[i][c] * id;
      if (!(s >= -127.0f)) s = -127.0f;
      if (s > 127.0f) s = 127.0f;
      packed |= (uint(int(roundEven(s))) & 0xffu) << (8u * c);
    }
    w[i] = packed;
  }
  return float(double(amax) / 127.0lf);
}

// The RMS scale of a row in one order for every shader that rounds x: lane l of 256 sums the
// squares of elements l, l + 256, ... in turn (qa_partial), then the 256 partials are added
// pairwise, red[l] += red[l + h] for h = 128, 64, ..., 1, and red[0] goes to qa_scale.
// `precise`: each square rounded, then added (no fused multiply-add), in every shader alike
// (gemv_i8x.comp's last workgroup sums the same way).
double qa_partial(F32 xr, uint cols, uint l) {
  precise double ss = 0.0lf;
  for (uint i = l; i < cols; i += 256u) ss += double(xr.v[i]) * double(xr.v[i]);
  return ss;
}

float qa_scale(double ss, uint cols, float eps) { return float(1.0lf / sqrt(ss / double(cols) + double(eps))); }
