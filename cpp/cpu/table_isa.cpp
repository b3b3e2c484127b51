// Fills the kernel table of the ISA this translation unit is compiled for (DL_ISA).
#include "cpu/isa_impl.h"
#include "cpu/isa_kernels.h"

namespace dl::cpu::DL_ISA {

void fill_table(KernelTable& t) {
  t.dequant_row = &dequant_row;
}

}  // namespace dl::cpu::DL_ISA
