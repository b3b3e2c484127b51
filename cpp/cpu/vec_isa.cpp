// Elementwise float kernels per ISA (plain loops the compiler vectorizes for each ISA).
#include "cpu/isa_kernels.h"

namespace dl::cpu::DL_ISA {

void axpy_f32(float* y, const float* x, float a, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

}  // namespace dl::cpu::DL_ISA
