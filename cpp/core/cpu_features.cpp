// cpuid / auxv based feature detection and the ISA selection policy.
#include "core/cpu_features.h"

#include <atomic>
#include <cstdlib>
#include <fstream>
#include <mutex>
#include <set>
#include <thread>

#include "core/errors.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#define DL_X86 1
#endif
#if defined(__aarch64__) && defined(__linux__)
#include <asm/hwcap.h>
#include <sys/auxv.h>
// Older kernel headers lack it; the bit is the kernel's ABI (Linux 5.10+ sets it).
#ifndef HWCAP2_I8MM
#define HWCAP2_I8MM (1 << 13)
#endif
#endif

namespace dl {

namespace {

#ifdef DL_X86
unsigned long long xgetbv0() {
  unsigned eax, edx;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return ((unsigned long long)edx << 32) | eax;
}
#endif

int count_physical_cores(int logical) {
#ifdef __linux__
  // Distinct (physical id, core id) pairs; falls back to logical count.
  std::ifstream f("/proc/cpuinfo");
  std::set<std::pair<int, int>> cores;
  std::string line;
  int phys = 0, core = -1;
  while (std::getline(f, line)) {
    if (line.rfind("physical id", 0) == 0) phys = std::atoi(line.substr(line.find(':') + 1).c_str());
    if (line.rfind("core id", 0) == 0) {
      core = std::atoi(line.substr(line.find(':') + 1).c_str());
      cores.insert({phys, core});
    }
  }
  if (!cores.empty()) return std::min<int>((int)cores.size(), logical);
#endif
  return logical;
}

CpuFeatures detect() {
  CpuFeatures f;
  f.logical_cores = std::max(1u, std::thread::hardware_concurrency());
  f.physical_cores = count_physical_cores(f.logical_cores);
#ifdef DL_X86
  f.arch = "x86_64";
  unsigned a, b, c, d;
  if (__get_cpuid(1, &a, &b, &c, &d)) {
    f.sse42 = c & (1u << 20);
    f.fma = c & (1u << 12);
    f.f16c = c & (1u << 29);
    bool osxsave = c & (1u << 27);
    bool avx_hw = c & (1u << 28);
    unsigned long long xcr0 = osxsave ? xgetbv0() : 0;
    bool ymm_os = (xcr0 & 0x6) == 0x6;
    bool zmm_os = (xcr0 & 0xe6) == 0xe6;
    f.avx = avx_hw && ymm_os;
    if (!f.avx) f.fma = f.f16c = false;
    if (__get_cpuid_count(7, 0, &a, &b, &c, &d)) {
      f.avx2 = f.avx && (b & (1u << 5));
      f.bmi2 = b & (1u << 8);
      f.avx512f = zmm_os && (b & (1u << 16));
      f.avx512dq = f.avx512f && (b & (1u << 17));
      f.avx512bw = f.avx512f && (b & (1u << 30));
      f.avx512vl = f.avx512f && (b & (1u << 31));
      f.avx512vnni = f.avx512f && (c & (1u << 11));
      f.amx_int8 = d & (1u << 25);
      unsigned a1, b1, c1, d1;
      if (__get_cpuid_count(7, 1, &a1, &b1, &c1, &d1)) {
        f.avxvnni = f.avx && (a1 & (1u << 4));
        f.avx512bf16 = f.avx512f && (a1 & (1u << 5));
      }
    }
  }
#elif defined(__aarch64__)
  f.arch = "aarch64";
  f.neon = true;
#if defined(__linux__)
  unsigned long hw = getauxval(AT_HWCAP);
  unsigned long hw2 = getauxval(AT_HWCAP2);
  f.dotprod = hw & HWCAP_ASIMDDP;
  f.fp16 = hw & HWCAP_FPHP;
  f.i8mm = hw2 & HWCAP2_I8MM;
#elif defined(__APPLE__)
  f.dotprod = true;
  f.fp16 = true;
#endif
#else
  f.arch = "unknown";
#endif
  return f;
}

std::mutex g_isa_mu;
std::atomic<int> g_isa{-1};

}  // namespace

const CpuFeatures& cpu_features() {
  static const CpuFeatures f = detect();
  return f;
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::baseline: return "baseline";
    case Isa::avx2: return "avx2";
    case Isa::avx512: return "avx512";
    case Isa::neon: return "neon";
    case Isa::i8mm: return "i8mm";
  }
  return "?";
}

Isa parse_isa(const std::string& name) {
  for (Isa i : {Isa::baseline, Isa::avx2, Isa::avx512, Isa::neon, Isa::i8mm})
    if (name == isa_name(i)) return i;
  throw Error("unknown ISA '" + name + "' (expected baseline, avx2, avx512, neon or i8mm)");
}

std::vector<Isa> isas_compiled() {
  std::vector<Isa> v{Isa::baseline};
#ifdef DL_HAVE_ISA_AVX2
  v.push_back(Isa::avx2);
#endif
#ifdef DL_HAVE_ISA_AVX512
  v.push_back(Isa::avx512);
#endif
#ifdef DL_HAVE_ISA_NEON
  v.push_back(Isa::neon);
#endif
#ifdef DL_HAVE_ISA_I8MM
  v.push_back(Isa::i8mm);  // after neon: the best supported one is picked
#endif
  return v;
}

bool isa_supported(Isa isa) {
  bool compiled = false;
  for (Isa i : isas_compiled()) compiled |= (i == isa);
  if (!compiled) return false;
  const CpuFeatures& f = cpu_features();
  switch (isa) {
    case Isa::baseline: return true;
    case Isa::avx2: return f.avx2 && f.fma && f.f16c && f.bmi2;
    case Isa::avx512:
      return f.avx2 && f.fma && f.f16c && f.bmi2 && f.avx512f && f.avx512bw && f.avx512vl && f.avx512dq &&
             f.avx512vnni;
    case Isa::neon: return f.neon && f.dotprod && f.fp16;
    case Isa::i8mm: return f.neon && f.dotprod && f.fp16 && f.i8mm;
  }
  return false;
}

void set_active_isa(Isa isa) {
  if (!isa_supported(isa))
    throw Error(std::string("ISA '") + isa_name(isa) + "' is not compiled into this build or not supported by this CPU");
  g_isa.store((int)isa);
}

Isa active_isa() {
  int v = g_isa.load(std::memory_order_acquire);
  if (v >= 0) return (Isa)v;
  std::lock_guard<std::mutex> lk(g_isa_mu);
  v = g_isa.load();
  if (v >= 0) return (Isa)v;
  const char* env = std::getenv("DASLLAMA_ISA");
  if (env && *env) {
    Isa want = parse_isa(env);
    set_active_isa(want);
    return want;
  }
  Isa best = Isa::baseline;
  for (Isa i : isas_compiled())
    if (isa_supported(i)) best = i;
  g_isa.store((int)best);
  return best;
}

}  // namespace dl
