// Run-time CPU feature detection and the choice of kernel ISA (DASLLAMA_ISA overrides).
#pragma once
#include <string>
#include <vector>

namespace dl {

struct CpuFeatures {
  std::string arch;  // "x86_64", "aarch64", ...
  bool sse42 = false, avx = false, avx2 = false, fma = false, f16c = false, bmi2 = false;
  bool avx512f = false, avx512bw = false, avx512vl = false, avx512dq = false;
  bool avx512vnni = false, avx512bf16 = false, avxvnni = false, amx_int8 = false;
  bool neon = false, dotprod = false, i8mm = false, fp16 = false;
  int logical_cores = 1;
  int physical_cores = 1;
};

const CpuFeatures& cpu_features();

// neon: ARMv8.2 dot product and fp16 (sdot); i8mm: the same plus the int8 matrix multiply
// (smmla, ARMv8.6; e.g. Graviton3, not Graviton2 or the Raspberry Pi 5).
enum class Isa { baseline = 0, avx2 = 1, avx512 = 2, neon = 3, i8mm = 4 };

const char* isa_name(Isa isa);
// ISAs this build compiled kernels for.
std::vector<Isa> isas_compiled();
// Compiled and runnable on this CPU.
bool isa_supported(Isa isa);
// The ISA in use: DASLLAMA_ISA if set (an unknown or unsupported value throws
// dl::Error at first use), else the best supported one.
Isa active_isa();
// Force an ISA (tests); throws dl::Error if it cannot run here.
void set_active_isa(Isa isa);
Isa parse_isa(const std::string& name);

}  // namespace dl
