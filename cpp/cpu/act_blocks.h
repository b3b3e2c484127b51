// Internal activation row formats the matmul kernels read (made by quantize_act); no code beyond sizes.
//
// Every format rounds each element the same way on every ISA: per block,
// amax = max|x|, d = amax / 127, q = rint(x * (127 / amax)) clamped to [-127, 127]
// (q = 0 when amax == 0), so tests can rebuild the quantized activations exactly.
//
// A8 (named by GGMLType::Q8_1; used by every 32-block weight format): one row is
//   int8  qs[kp]        kp = k rounded up to 64 (two blocks per 512-bit load), pad zero
//   float d[kp / 32]    block scales, pad zero
//   float s[kp / 32]    d * sum(qs of the block): the weight's zero point / min times
//                       the block sum, so unsigned-nibble weights need no per-element offset
// Struct-of-arrays rather than ggml's block_q8_1 so 64 qs load with one instruction.
//
// K8 (GGMLType::Q8_K; the k-quants and iq4_xs): block_q8_K[k / 256] (quant/blocks.h),
//   f32 d, 256 qs, and the 16 sums of 16 qs that the weight mins multiply.
//
// F32 (GGMLType::F32; f32/f16/bf16 and every other dequantizable type): float[k].
#pragma once
#include <cstddef>
#include <cstdint>

#include "quant/blocks.h"
#include "quant/types.h"

namespace dl::cpu {

inline int64_t act_a8_padded_k(int64_t k) { return (k + 63) / 64 * 64; }

// Row t of an A8 activation buffer (kp = act_a8_padded_k(k)): its quants, block scales d and sums s.
inline void a8_row(const void* act, size_t row_bytes, int64_t t, int64_t kp, const uint8_t*& q, const float*& d,
                   const float*& s) {
  q = static_cast<const uint8_t*>(act) + (size_t)t * row_bytes;
  d = reinterpret_cast<const float*>(q + kp);
  s = d + kp / 32;
}

// Bytes of one activation row of k elements, rounded up to 64 so rows stay cache-line aligned;
// 0 for a format id the kernels do not produce.
inline size_t act_row_bytes(uint32_t act_type, int64_t k) {
  size_t n = 0;
  switch ((GGMLType)act_type) {
    case GGMLType::Q8_1: {
      const int64_t kp = act_a8_padded_k(k);
      n = (size_t)kp + (size_t)(kp / 32) * 8;
      break;
    }
    case GGMLType::Q8_K: n = (size_t)(k / quant::QK_K) * sizeof(quant::block_q8_K); break;
    case GGMLType::F32: n = (size_t)k * 4; break;
    default: return 0;
  }
  return (n + 63) / 64 * 64;
}

}  // namespace dl::cpu
