// UTF-8 decoding of one sequence with the Unicode "maximal subpart" rule for invalid input.
#pragma once
#include <cstddef>
#include <cstdint>

namespace dl::utf8 {

// Decodes the sequence at p[i] (i < n). Returns its length > 0 with *cp set when it is complete and
// valid; 0 when it is a valid but unfinished prefix cut off by the end; -k when invalid, k being
// the length of the maximal subpart to replace by one U+FFFD.
inline int next(const uint8_t* p, size_t n, size_t i, uint32_t* cp) {
  uint32_t c = p[i];
  if (c < 0x80) {
    *cp = c;
    return 1;
  }
  int need;
  uint8_t lo = 0x80, hi = 0xBF;  // allowed range of the second byte
  if (c >= 0xC2 && c <= 0xDF) need = 1, c &= 0x1F;
  else if (c == 0xE0) need = 2, lo = 0xA0, c &= 0x0F;
  else if (c == 0xED) need = 2, hi = 0x9F, c &= 0x0F;
  else if (c >= 0xE1 && c <= 0xEF) need = 2, c &= 0x0F;
  else if (c == 0xF0) need = 3, lo = 0x90, c &= 0x07;
  else if (c >= 0xF1 && c <= 0xF3) need = 3, c &= 0x07;
  else if (c == 0xF4) need = 3, hi = 0x8F, c &= 0x07;
  else return -1;
  for (int k = 1; k <= need; ++k) {
    if (i + k >= n) return 0;
    uint8_t b = p[i + k];
    if (k == 1 ? (b < lo || b > hi) : (b < 0x80 || b > 0xBF)) return -k;
    c = (c << 6) | (b & 0x3F);
  }
  *cp = c;
  return need + 1;
}

}  // namespace dl::utf8
