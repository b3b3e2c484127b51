// Builds one KernelTable per compiled ISA once and hands out the active one.
#include <array>
#include <mutex>

#include "core/errors.h"
#include "cpu/isa_impl.h"
#include "quant/quant.h"

namespace dl::cpu {

namespace {
std::array<KernelTable, 5> g_tables;  // indexed by Isa
std::once_flag g_once;

// quant/'s dequantize_row runs the active ISA's decoders once the tables exist (same bits).
bool fast_dequant(uint32_t type, const void* src, float* dst, int64_t n) {
  return g_tables[(int)active_isa()].dequant_row(type, src, dst, n);
}

void build() {
  for (Isa isa : isas_compiled()) {
    KernelTable& t = g_tables[(int)isa];
    t.isa = isa;
    switch (isa) {
#ifdef DL_HAVE_ISA_BASELINE
      case Isa::baseline: baseline::fill_table(t); break;
#endif
#ifdef DL_HAVE_ISA_AVX2
      case Isa::avx2: avx2::fill_table(t); break;
#endif
#ifdef DL_HAVE_ISA_AVX512
      case Isa::avx512: avx512::fill_table(t); break;
#endif
#ifdef DL_HAVE_ISA_NEON
      case Isa::neon: neon::fill_table(t); break;
#endif
#ifdef DL_HAVE_ISA_I8MM
      case Isa::i8mm: i8mm::fill_table(t); break;
#endif
      default: break;
    }
  }
  set_fast_dequantizer(&fast_dequant);
}
}  // namespace

const KernelTable& kernels_for(Isa isa) {
  std::call_once(g_once, build);
  if (!isa_supported(isa)) throw Error(std::string("ISA '") + isa_name(isa) + "' is not available here");
  return g_tables[(int)isa];
}

// Hot path (called per op): active_isa() was validated when it was chosen, so
// only the one-time table build is checked here.
const KernelTable& kernels() {
  std::call_once(g_once, build);
  return g_tables[(int)active_isa()];
}

}  // namespace dl::cpu
