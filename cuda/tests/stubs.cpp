// Link stubs for the standalone CUDA op check only: the reference dequantizer table
// (quant/dequant_impl.h's scalar decoders) and the base weight_type, so the check
// builds from cuda/ + cpp/quant without the CPU backend.
#include "core/backend.h"
#include "cpu/kernels.h"
#include "quant/dequant_impl.h"
#include "quant/types.h"

namespace dl {

uint32_t Backend::weight_type(uint32_t type, int64_t, QuantMode) const { return type; }

namespace cpu {
namespace {
using namespace dl::quant;
template <class B, int QK>
void rows(const void* src, float* dst, int64_t n, void (*f)(const B*, float*)) {
  const B* b = static_cast<const B*>(src);
  for (int64_t i = 0; i < n / QK; ++i) f(b + i, dst + i * QK);
}
bool dequant(uint32_t type, const void* src, float* dst, int64_t n) {
  switch ((GGMLType)type) {
    case GGMLType::F32: for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<const float*>(src)[i]; return true;
    case GGMLType::F16: for (int64_t i = 0; i < n; ++i) dst[i] = h2f(static_cast<const uint16_t*>(src)[i]); return true;
    case GGMLType::BF16: for (int64_t i = 0; i < n; ++i) dst[i] = bf2f(static_cast<const uint16_t*>(src)[i]); return true;
    case GGMLType::Q8_0: rows<block_q8_0, 32>(src, dst, n, dq_q8_0); return true;
    case GGMLType::Q4_0: rows<block_q4_0, 32>(src, dst, n, dq_q4_0); return true;
    case GGMLType::Q4_1: rows<block_q4_1, 32>(src, dst, n, dq_q4_1); return true;
    case GGMLType::Q5_0: rows<block_q5_0, 32>(src, dst, n, dq_q5_0); return true;
    case GGMLType::Q5_1: rows<block_q5_1, 32>(src, dst, n, dq_q5_1); return true;
    case GGMLType::Q4_K: rows<block_q4_K, 256>(src, dst, n, dq_q4_K); return true;
    case GGMLType::Q5_K: rows<block_q5_K, 256>(src, dst, n, dq_q5_K); return true;
    case GGMLType::Q6_K: rows<block_q6_K, 256>(src, dst, n, dq_q6_K); return true;
    default: return false;
  }
}
KernelTable make() {
  KernelTable t;
  t.dequant_row = dequant;
  return t;
}
}  // namespace
const KernelTable& kernels() {
  static const KernelTable t = make();
  return t;
}
}  // namespace cpu
}  // namespace dl
