// Elementwise float kernels per ISA: gated activations.
#include "cpu/isa_kernels.h"
#include "cpu/vmath.h"

namespace dl::cpu::DL_ISA {

void glu_f32(const float* gate, const float* up, float* out, int64_t n, int act) {
  if (act == 0)
    for (int64_t i = 0; i < n; ++i) out[i] = silu(gate[i]) * up[i];
  else
    for (int64_t i = 0; i < n; ++i) out[i] = gelu_tanh(gate[i]) * up[i];
}

}  // namespace dl::cpu::DL_ISA
