// Shared by every shader: raw device addresses (buffer_reference), byte and half reads of
// packed formats, exact f32 -> f16 rounding, and the activation helpers.
#extension GL_EXT_buffer_reference : require
#extension GL_EXT_shader_explicit_arithmetic_types_int64 : require
#extension GL_EXT_control_flow_attributes : require

// Backend "pointers" are device addresses; these views read/write at any 4-aligned address.
layout(buffer_reference, std430, buffer_reference_align = 4) buffer F32 { float v[]; };
layout(buffer_reference, std430, buffer_reference_align = 4) buffer U32 { uint v[]; };
layout(buffer_reference, std430, buffer_reference_align = 4) buffer I32 { int v[]; };
layout(buffer_reference, std430, buffer_reference_align = 8) buffer F64 { double v[]; };
layout(buffer_reference, std430, buffer_reference_align = 16) buffer V4 { vec4 v[]; };  // 16-aligned only
layout(buffer_reference, std430, buffer_reference_align = 16) buffer V4U { uvec4 v[]; };  // 16-aligned only
layout(buffer_reference, std430, buffer_reference_align = 8) buffer U2 { uvec2 v[]; };  // 8-aligned only
// Values other workgroups of the same dispatch wrote (a last workgroup's reads): not from a stale cache.
layout(buffer_reference, std430, buffer_reference_align = 4) coherent buffer F32C { float v[]; };

// Packed formats sit at 1- or 2-byte alignment: read the covering 32-bit words.
uint rd8(uint64_t a) { return (U32(a & ~uint64_t(3)).v[0] >> (uint(a & 3) * 8u)) & 0xffu; }
uint rd16(uint64_t a) { return (U32(a & ~uint64_t(3)).v[0] >> (uint(a & 2) * 8u)) & 0xffffu; }
// 4 bytes from any address; the second word is read only when the bytes reach into it.
uint rd32(uint64_t a) {
  U32 p = U32(a & ~uint64_t(3));
  const uint sh = uint(a & 3) * 8u;
  return sh == 0u ? p.v[0] : (p.v[0] >> sh) | (p.v[1] << (32u - sh));
}
int sbyte(uint w, uint i) { return bitfieldExtract(int(w), int(i * 8u), 8); }
float h2f(uint h) { return unpackHalf2x16(h).x; }
float bf2f(uint h) { return uintBitsToFloat(h << 16); }

// f32 -> f16 bits, round to nearest even (as numpy and the CPU), in integer ops so the
// result does not depend on the driver's conversion rounding.
uint f2h(float f) {
  const uint x = floatBitsToUint(f);
  const uint sign = (x >> 16) & 0x8000u;
  const uint ax = x & 0x7fffffffu;
  if (ax >= 0x7f800000u) return sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u : 0u);  // inf / nan
  if (ax >= 0x477ff000u) return sign | 0x7c00u;                                       // overflows to inf
  if (ax < 0x38800000u) {                                                             // f16 subnormal or 0
    if (ax < 0x33000000u) return sign;  // below half the smallest subnormal (ties to 0 as well)
    const uint m = (ax & 0x7fffffu) | 0x800000u;
    const uint sh = 126u - (ax >> 23);  // 14..24
    uint r = m >> sh;
    const uint rem = m & ((1u << sh) - 1u), hf = 1u << (sh - 1u);
    if (rem > hf || (rem == hf && (r & 1u) != 0u)) r += 1u;
    return sign | r;
  }
  uint r = ((ax >> 13) - (112u << 10));
  const uint rem = ax & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (r & 1u) != 0u)) r += 1u;
  return sign | r;
}

// Byte writes into words other invocations may write too (f16 / q8_0 cache rows).
void wr8(uint64_t a, uint b) {
  U32 p = U32(a & ~uint64_t(3));
  const uint sh = uint(a & 3) * 8u;
  atomicAnd(p.v[0], ~(0xffu << sh));
  atomicOr(p.v[0], (b & 0xffu) << sh);
}
void wr16(uint64_t a, uint h) {  // a is 2-aligned
  U32 p = U32(a & ~uint64_t(3));
  const uint sh = uint(a & 2) * 8u;
  atomicAnd(p.v[0], ~(0xffffu << sh));
  atomicOr(p.v[0], (h & 0xffffu) << sh);
}

// tanh from exp, finite for every input (a driver's tanh may overflow to nan).
float tanh_safe(float x) {
  const float ax = abs(x);
  if (ax < 0.004f) return x * (1.0f - x * x / 3.0f);
  const float e = exp(-2.0f * ax);
  return sign(x) * (1.0f - e) / (1.0f + e);
}
// RoPE's cos and sin (times mscale) for pair i at position p (rope.comp, and kv_store.comp when
// it rotates keys as it stores them): the angle p * freq_scale * inv_freq[i] (/ factors[i]) in
// double (inv_freq from a table the host computes in double: GLSL has no double pow), reduced
// to [-pi, pi] in double, then f32 cos / sin: long positions keep their precision.
void rope_cs(uint64_t inv_freq, uint64_t factors, uint i, int p, float freq_scale, float mscale, out float c,
             out float s) {
  double inv = F64(inv_freq).v[i];
  if (factors != 0ul) inv /= double(F32(factors).v[i]);
  const double theta = double(p) * double(freq_scale) * inv;
  const double two_pi = 6.283185307179586476925lf;
  const float r = float(theta - floor(theta / two_pi + 0.5lf) * two_pi);
  precise float cc = cos(r) * mscale;
  precise float ss = sin(r) * mscale;
  c = cc, s = ss;
}
// The GLU activations (ops.comp, and gemv.comp computing its input from gate and up).
float silu(float x) {
  const float e = exp(-abs(x));
  return (x >= 0.0f ? x : x * e) / (1.0f + e);
}
// precise: the same bits in every shader that inlines it (ops.comp's glu, the GEMVs that fold
// it in), whatever a driver would contract there.
float gelu_tanh(float x) {
  precise float inner = x + 0.044715f * x * x * x;
  precise float y = 0.5f * x * (1.0f + tanh_safe(0.7978845608028654f * inner));
  return y;
}
// erf (Abramowitz-Stegun 7.1.26 is too coarse): a W. J. Cody-style rational form is long,
// so erf(x) = 1 - erfc(x) with erfc from the Numerical Recipes Chebyshev fit (|rel err| < 1.2e-7).
float erf_f(float x) {
  const float z = abs(x);
  const float t = 1.0f / (1.0f + 0.5f * z);
  const float r = t * exp(-z * z - 1.26551223f +
                          t * (1.00002368f + t * (0.37409196f + t * (0.09678418f + t * (-0.18628806f +
                          t * (0.27886807f + t * (-1.13520398f + t * (1.48851587f +
                          t * (-0.82215223f + t * 0.17087277f)))))))));
  return x >= 0.0f ? 1.0f - r : r - 1.0f;
}
