// Row dequantization per ISA: the portable block decoders of quant/ compiled with
// this ISA's flags (plain arithmetic, no contraction, so every ISA is bit-exact).
#include <cstring>

#include "core/half.h"
#include "cpu/isa_kernels.h"
#include "quant/types.h"

namespace dl::cpu::DL_ISA {

bool dequant_row(uint32_t type, const void* src, float* dst, int64_t n) {
  switch ((GGMLType)type) {
    case GGMLType::F32: std::memcpy(dst, src, (size_t)n * 4); return true;
    case GGMLType::F16: {
      const uint16_t* s = (const uint16_t*)src;
      for (int64_t i = 0; i < n; ++i) dst[i] = f16_to_f32(s[i]);
      return true;
    }
    default: return false;
  }
}

}  // namespace dl::cpu::DL_ISA
