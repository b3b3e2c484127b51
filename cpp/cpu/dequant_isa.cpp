// Row dequantization per ISA: the block decoders of quant/dequant_impl.h compiled
// with this ISA's flags. Plain float32 arithmetic without contraction, so the
// vectorized copies stay bit-identical with each other and with gguf-py.
#include <cstring>

#include "cpu/isa_kernels.h"
#include "quant/dequant_impl.h"
#include "quant/types.h"

namespace dl::cpu::DL_ISA {

namespace {
using namespace dl::quant;

template <typename Block, int QK, void (*Decode)(const Block*, float*)>
void rows(const void* src, float* dst, int64_t n) {
  const Block* b = static_cast<const Block*>(src);
  const int64_t nb = n / QK;
  for (int64_t i = 0; i < nb; ++i) Decode(b + i, dst + i * QK);
}
}  // namespace

bool dequant_row(uint32_t type, const void* src, float* dst, int64_t n) {
  switch ((GGMLType)type) {
    case GGMLType::F32: std::memcpy(dst, src, (size_t)n * 4); return true;
    case GGMLType::F16: {
      const uint16_t* s = static_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < n; ++i) dst[i] = h2f(s[i]);
      return true;
    }
    case GGMLType::BF16: {
      const uint16_t* s = static_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < n; ++i) dst[i] = bf2f(s[i]);
      return true;
    }
    case GGMLType::Q4_0: rows<block_q4_0, QK4, dq_q4_0>(src, dst, n); return true;
    case GGMLType::Q4_1: rows<block_q4_1, QK4, dq_q4_1>(src, dst, n); return true;
    case GGMLType::Q5_0: rows<block_q5_0, QK4, dq_q5_0>(src, dst, n); return true;
    case GGMLType::Q5_1: rows<block_q5_1, QK4, dq_q5_1>(src, dst, n); return true;
    case GGMLType::Q8_0: rows<block_q8_0, QK4, dq_q8_0>(src, dst, n); return true;
    case GGMLType::Q2_K: rows<block_q2_K, QK_K, dq_q2_K>(src, dst, n); return true;
    case GGMLType::Q3_K: rows<block_q3_K, QK_K, dq_q3_K>(src, dst, n); return true;
    case GGMLType::Q4_K: rows<block_q4_K, QK_K, dq_q4_K>(src, dst, n); return true;
    case GGMLType::Q5_K: rows<block_q5_K, QK_K, dq_q5_K>(src, dst, n); return true;
    case GGMLType::Q6_K: rows<block_q6_K, QK_K, dq_q6_K>(src, dst, n); return true;
    case GGMLType::Q8_K: rows<block_q8_K, QK_K, dq_q8_K>(src, dst, n); return true;
    case GGMLType::MXFP4: rows<block_mxfp4, QK4, dq_mxfp4>(src, dst, n); return true;
    case GGMLType::IQ4_NL: rows<block_iq4_nl, QK4, dq_iq4_nl>(src, dst, n); return true;
    case GGMLType::IQ4_XS: rows<block_iq4_xs, QK_K, dq_iq4_xs>(src, dst, n); return true;
    default: return false;
  }
}

}  // namespace dl::cpu::DL_ISA
