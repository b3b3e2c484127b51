// Placeholder until the block formats land: f32/f16 only.
#include "quant/quant.h"

#include "core/errors.h"
#include "cpu/kernels.h"
#include "quant/types.h"

namespace dl {

void dequantize_row(uint32_t type, const void* src, float* dst, int64_t n) {
  if (!cpu::kernels().dequant_row(type, src, dst, n)) {
    const TypeTraits* t = type_traits(type);
    throw UnsupportedModelError(std::string("no dequantizer for tensor type ") + (t ? t->name : std::to_string(type)));
  }
}

void quantize_row(uint32_t type, const float*, void*, int64_t) {
  throw UnsupportedModelError("quantize_row: type " + std::to_string(type) + " not supported yet");
}

}  // namespace dl
