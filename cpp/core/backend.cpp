// What every backend shares: KV row sizes, the default weight policy, the registry
// that turns a device string into a backend, and host -> backend helpers.
#include "core/backend.h"

#include <algorithm>
#include <cstdlib>

#include "core/errors.h"
#include "core/threadpool.h"
#include "quant/blocks.h"
#include "quant/types.h"

#ifdef DL_HAVE_CUDA
#include "cuda/cuda_backend.h"
#endif
#ifdef DL_HAVE_VULKAN
#include "vulkan/vulkan_backend.h"
#endif

namespace dl {

ThreadPool* Backend::host_threads() {
  // Eight threads at most: the work is copies and samples of a few dozen rows.
  std::call_once(host_pool_once_, [this] { host_pool_ = std::make_shared<ThreadPool>(std::min(8, default_threads())); });
  return host_pool_.get();
}

size_t kv_row_bytes(KVType t, int64_t dim) {
  switch (t) {
    case KVType::f32: return (size_t)dim * 4;
    case KVType::f16: return (size_t)dim * 2;
    case KVType::q8_0: return (size_t)(dim / 32) * sizeof(quant::block_q8_0);
  }
  return 0;
}

// The CPU's policy: fp32 dequantizes everything (the reference); q8 / q4_0 requantize
// float matrices (whose rows are whole 32-blocks) and keep quantized planes as they are.
void Backend::matmul_multi_ex(const Weight* const* ws, float* const* ys, int count, const float* x, int64_t n,
                              const MatmulEpilogue* eps) {
  matmul_multi(ws, ys, count, x, n);
  for (int i = 0; eps && i < count; ++i) {
    if (eps[i].bias) add_bias(ys[i], eps[i].bias, n, ws[i]->rows);
    if (eps[i].gelu_erf) gelu_erf(ys[i], n * ws[i]->rows);
  }
}

void Backend::matmul_step(const MatmulStep& s) {
  if (s.count < 1 || s.count > 3 || (s.residual && s.count != 1))
    throw Error("matmul_step: 1 to 3 matmuls, and a residual only with one");
  const int64_t cols = s.w[0]->cols;
  const float* in = s.x;
  if (s.norm) {
    rms_norm(s.x, s.norm_w, s.xn, s.n, cols, s.eps);
    in = s.xn;
  }
  matmul_multi(s.w, s.y, s.count, in, s.n);
  if (s.residual) add(s.residual, s.y[0], s.n * s.w[0]->rows);
}

uint32_t Backend::weight_type(uint32_t type, int64_t cols, QuantMode mode) const {
  if (mode == QuantMode::fp32) return (uint32_t)GGMLType::F32;
  const bool is_float =
      type == (uint32_t)GGMLType::F32 || type == (uint32_t)GGMLType::F16 || type == (uint32_t)GGMLType::BF16;
  if (is_float && cols % 32 == 0) return mode == QuantMode::q4_0 ? (uint32_t)GGMLType::Q4_0 : (uint32_t)GGMLType::Q8_0;
  return type;
}

Vec upload_vec(Backend& be, const std::vector<float>& v, const char* what) {
  Vec out;
  if (v.empty()) return out;
  out.n = (int64_t)v.size();
  out.buf = be.alloc(v.size() * sizeof(float), what);
  be.upload(out.buf->data(), v.data(), v.size() * sizeof(float));
  return out;
}

namespace {

// "cuda:1" -> ("cuda", 1); "cuda" -> ("cuda", 0).
std::pair<std::string, int> parse_device(const std::string& device) {
  const size_t colon = device.find(':');
  std::string kind = device.substr(0, colon);
  int index = 0;
  if (colon != std::string::npos) {
    const std::string num = device.substr(colon + 1);
    char* end = nullptr;
    const long v = num.empty() ? -1 : std::strtol(num.c_str(), &end, 10);
    if (num.empty() || *end != '\0' || v < 0 || v > 1024)
      throw Error("device '" + device + "': the index after ':' must be a number >= 0");
    index = (int)v;
  }
  return {kind, index};
}

}  // namespace

std::shared_ptr<Backend> make_backend(const std::string& device, int n_threads) {
  auto [kind, index] = parse_device(device.empty() ? std::string("cpu") : device);
  if (kind == "cpu") {
    if (index != 0) throw Error("device '" + device + "': the CPU has no index");
    return make_cpu_backend(n_threads);
  }
  if (kind == "cuda") {
#ifdef DL_HAVE_CUDA
    return make_cuda_backend(index);
#else
    throw DeviceError("device '" + device +
                      "': this build of dasllama has no CUDA backend (it was built without nvcc; "
                      "rebuild with the CUDA toolkit on PATH or -DDASLLAMA_CUDA=ON)");
#endif
  }
  if (kind == "vulkan") {
#ifdef DL_HAVE_VULKAN
    return make_vulkan_backend(index);
#else
    throw DeviceError("device '" + device +
                      "': this build of dasllama has no Vulkan backend (it was built without the Vulkan "
                      "headers and glslc; install them, e.g. Debian's libvulkan-dev and glslc, and rebuild)");
#endif
  }
  if (kind == "metal")
    throw DeviceError("device '" + device + "': this build of dasllama has no " + kind + " backend");
  throw Error("unknown device '" + device + "' (expected cpu, cuda, cuda:N, vulkan, vulkan:N or metal)");
}

std::vector<BackendProbe> probe_backends() {
  auto not_built = [](const char* name, const char* why) {
    BackendProbe p;
    p.backend = name;
    p.error = why;
    return p;
  };
  std::vector<BackendProbe> out;
  BackendProbe cpu;
  cpu.backend = "cpu";
  cpu.built = true;
  cpu.devices.push_back(make_cpu_backend(1)->info());
  out.push_back(cpu);
#ifdef DL_HAVE_CUDA
  out.push_back(probe_cuda());
#else
  // The CPU wheels leave CUDA out on purpose: it ships as the dasllama-cuda13 wheel (docs/wheels.md).
  out.push_back(not_built("cuda", "not built into this module (pip install dasllama-cuda13, or build from source "
                                  "where nvcc is on PATH)"));
#endif
#ifdef DL_HAVE_VULKAN
  out.push_back(probe_vulkan());
#else
  out.push_back(not_built("vulkan", "not built (no Vulkan headers or glslc when this module was compiled)"));
#endif
  out.push_back(not_built("metal", "not built"));
  return out;
}

}  // namespace dl
