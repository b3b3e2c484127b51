// Row dequantization per ISA: the block decoders of quant/dequant_impl.h compiled
// with this ISA's flags. Plain float32 arithmetic without contraction, so the
// vectorized copies stay bit-identical with each other and with gguf-py.
#include <cstring>

#include "cpu/isa_kernels.h"
#include "quant/dequant_impl.h"
#include "quant/types.h"

namespace dl::cpu::DL_ISA {

// The shared decoders (quant/dequant_impl.h) compiled with this ISA's flags.
bool dequant_row(uint32_t type, const void* src, float* dst, int64_t n) {
  return dl::quant::dequant_row_impl(type, src, dst, n);
}

}  // namespace dl::cpu::DL_ISA
