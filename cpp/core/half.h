// float -> IEEE half, rounded to nearest even (decoding lives per ISA in quant/dequant_impl.h).
#pragma once
#include <cstdint>
#include <cstring>

namespace dl {

inline float fp32_from_bits(uint32_t w) {
  float f;
  std::memcpy(&f, &w, 4);
  return f;
}
inline uint32_t fp32_to_bits(float f) {
  uint32_t w;
  std::memcpy(&w, &f, 4);
  return w;
}

// Round to nearest even, as numpy's astype(float16) does.
inline uint16_t f32_to_f16(float f) {
  uint32_t x = fp32_to_bits(f);
  uint32_t sign = (x >> 16) & 0x8000;
  uint32_t ax = x & 0x7fffffff;
  if (ax >= 0x7f800000u) return (uint16_t)(sign | 0x7c00 | (ax > 0x7f800000u ? 0x200 : 0));
  if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00);  // overflow to inf
  if (ax < 0x38800000u) {                                    // subnormal or zero in half
    if (ax < 0x33000000u) return (uint16_t)sign;             // below half of smallest subnormal
    uint32_t e = ax >> 23;
    uint32_t m = (ax & 0x7fffff) | 0x800000;
    // value = m * 2^(e-150); in units of the half subnormal 2^-24 that is m >> (126 - e)
    uint32_t drop = 126 - e;
    uint32_t q = m >> drop;
    uint32_t rem = m & ((1u << drop) - 1);
    uint32_t half = 1u << (drop - 1);
    if (rem > half || (rem == half && (q & 1))) ++q;
    return (uint16_t)(sign | q);
  }
  uint32_t e = (ax >> 23) - 127 + 15;
  uint32_t m = ax & 0x7fffff;
  uint32_t q = (e << 10) | (m >> 13);
  uint32_t rem = m & 0x1fff;
  if (rem > 0x1000 || (rem == 0x1000 && (q & 1))) ++q;  // may carry into exponent: still correct
  return (uint16_t)(sign | q);
}


}  // namespace dl
