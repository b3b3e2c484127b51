// The CUDA backend: device memory, the stream, the weight policy and the op dispatch
// onto the kernels of matmul.cu, attention.cu and ops.cu.
#include "cuda_backend.h"

#include <cstdio>
#include <string>

#include "common.cuh"
#include "core/errors.h"
#include "kernels.h"
#include "quant/types.h"

namespace dl {
namespace {

using cuda::check;

std::string mib(size_t b) {
  char s[64];
  std::snprintf(s, sizeof s, "%zu bytes (%.1f MiB)", b, b / 1048576.0);
  return s;
}

std::string version_str(int v) { return std::to_string(v / 1000) + "." + std::to_string(v % 1000 / 10); }

// Why cudaGetDeviceCount failed, in words a user can act on.
std::string no_device_reason(cudaError_t e) {
  int drv = 0, rt = 0;
  cudaDriverGetVersion(&drv);
  cudaRuntimeGetVersion(&rt);
  if (e == cudaErrorInsufficientDriver && drv == 0) return "no NVIDIA driver found (libcuda.so is not installed)";
  if (e == cudaErrorInsufficientDriver)
    return "the NVIDIA driver supports CUDA " + version_str(drv) + ", older than the runtime " + version_str(rt) +
           " this build needs: update the driver";
  if (e == cudaErrorNoDevice) return "no CUDA device found";
  return std::string("no usable CUDA device: ") + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")";
}

// Device memory freed on the owning device when the last owner lets go.
class CudaBuffer final : public Buffer {
 public:
  CudaBuffer(void* p, size_t n, int dev) : dev_(dev) { ptr_ = p, size_ = n; }
  ~CudaBuffer() override {
    if (!ptr_) return;
    int cur = -1;
    cudaGetDevice(&cur);
    if (cur != dev_) cudaSetDevice(dev_);
    cudaFree(ptr_);  // errors here (a driver shut down at exit) cannot be reported from a destructor
    if (cur != dev_ && cur >= 0) cudaSetDevice(cur);
  }

 private:
  int dev_;
};

// Memory left free below every allocation: the context's and cuBLAS-free kernels' own
// needs (launch buffers, printf, local memory) come from the same pool.
constexpr size_t kHeadroom = size_t(64) << 20;

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(int dev) : dev_(dev) {
    check(cudaSetDevice(dev_), "cudaSetDevice");
    check(cudaGetDeviceProperties(&prop_, dev_), "cudaGetDeviceProperties");
    check(cudaStreamCreateWithFlags(&st_, cudaStreamNonBlocking), "cudaStreamCreate");
  }
  ~CudaBackend() override {
    cudaSetDevice(dev_);
    cudaStreamSynchronize(st_);
    scratch_.reset();
    cudaStreamDestroy(st_);
  }

  const char* name() const override { return "cuda"; }

  DeviceInfo info() const override {
    DeviceInfo d;
    d.backend = "cuda";
    d.index = dev_;
    d.name = prop_.name;
    d.cc_major = prop_.major;
    d.cc_minor = prop_.minor;
    cudaSetDevice(dev_);
    size_t fr = 0, tot = 0;
    if (cudaMemGetInfo(&fr, &tot) == cudaSuccess) d.free_bytes = fr, d.total_bytes = tot;
    int drv = 0, rt = 0;
    cudaDriverGetVersion(&drv);
    cudaRuntimeGetVersion(&rt);
    d.driver = "driver " + version_str(drv) + ", runtime " + version_str(rt);
    return d;
  }

  // ---- memory ----
  BufferPtr alloc(size_t bytes, const char* what) override {
    use();
    if (bytes == 0) return std::make_shared<CudaBuffer>(nullptr, 0, dev_);
    check_fits(bytes, what);
    void* p = nullptr;
    const cudaError_t e = cudaMalloc(&p, bytes);
    if (e != cudaSuccess) {
      cudaGetLastError();  // clear the sticky-free error state of a failed cudaMalloc
      throw DeviceError(where() + ": cannot allocate " + mib(bytes) + " for " + what + ": " + cudaGetErrorString(e));
    }
    return std::make_shared<CudaBuffer>(p, bytes, dev_);
  }
  void check_fits(size_t bytes, const char* what) override {
    use();
    size_t fr = 0, tot = 0;
    check(cudaMemGetInfo(&fr, &tot), "cudaMemGetInfo");
    if (bytes + kHeadroom > fr)
      throw DeviceError(where() + ": out of device memory for " + what + ": needs " + mib(bytes) + ", " + mib(fr) +
                        " free of " + mib(tot) + " (" + mib(kHeadroom) + " kept back)");
  }
  // Pageable sources are staged by the driver before cudaMemcpyAsync returns, so the
  // caller may reuse them; a pinned (registered) source is copied asynchronously and
  // then waited for, to keep that promise.
  void upload(void* dst, const void* src, size_t bytes) override {
    if (bytes == 0) return;
    use();
    check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, st_), "upload");
    cudaPointerAttributes at{};
    if (cudaPointerGetAttributes(&at, src) == cudaSuccess && at.type == cudaMemoryTypeHost)
      check(cudaStreamSynchronize(st_), "upload (pinned source)");
    else
      cudaGetLastError();
  }
  void download(void* dst, const void* src, size_t bytes) override {
    use();
    if (bytes) check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, st_), "download");
    check(cudaStreamSynchronize(st_), "download (a kernel before it failed)");
  }
  void copy(void* dst, const void* src, size_t bytes) override {
    if (bytes == 0) return;
    use();
    check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, st_), "copy");
  }
  void zero(void* dst, size_t bytes) override {
    if (bytes == 0) return;
    use();
    check(cudaMemsetAsync(dst, 0, bytes, st_), "zero");
  }
  void sync() override {
    use();
    check(cudaStreamSynchronize(st_), "sync (a kernel before it failed)");
  }

  // ---- weights ----
  // The file's type wherever a kernel reads it (never less precision); others become
  // Q8_0 (F32 when the row is no whole number of 32-blocks).
  uint32_t weight_type(uint32_t type, int64_t cols, QuantMode) const override {
    if (cuda::matmul_type_ok(type)) return type;
    return cols % 32 == 0 ? (uint32_t)GGMLType::Q8_0 : (uint32_t)GGMLType::F32;
  }
  void load_weight(Weight& w, WeightUse) override {  // matmul and get_rows read the same bytes
    if (!w.host) throw Error("cuda load_weight: the weight has no host bytes");
    if (!cuda::matmul_type_ok(w.type))
      throw UnsupportedModelError("cuda: no kernel for weight type " + type_label(w.type));
    const size_t n = (size_t)w.rows * w.row_bytes;
    BufferPtr b = alloc(n, "weight");
    use();
    check(cudaMemcpyAsync(b->data(), w.host, n, cudaMemcpyHostToDevice, st_), "load_weight");
    // The host bytes may be a mapping the loader drops next: wait for the copy.
    check(cudaStreamSynchronize(st_), "load_weight");
    w.data = static_cast<const uint8_t*>(b->data());
    w.resident = std::move(b);
  }
  bool supports(Op op, uint32_t type) const override {
    switch (op) {
      case Op::matmul:
      case Op::get_rows: return cuda::matmul_type_ok(type);
      case Op::attention:
      case Op::kv_store:
        return type == (uint32_t)KVType::f32 || type == (uint32_t)KVType::f16 || type == (uint32_t)KVType::q8_0;
    }
    return false;
  }

  // ---- ops ----
  void matmul(const Weight& w, const float* x, int64_t n, float* y) override {
    use();
    cuda::matmul(mat(w), x, n, y, st_);
  }
  void matmul_multi(const Weight* const* ws, float* const* ys, int count, const float* x, int64_t n) override {
    use();
    for (int i = 0; i < count; ++i) cuda::matmul(mat(*ws[i]), x, n, ys[i], st_);
  }
  void get_rows(const Weight& w, const int32_t* ids, int64_t n, float* out) override {
    use();
    cuda::get_rows(mat(w), ids, n, out, st_);
  }
  void rms_norm(const float* x, const float* w, float* y, int64_t n_rows, int64_t dim, float eps) override {
    use();
    cuda::rms_norm(x, w, y, n_rows, dim, eps, st_);
  }
  void rope(float* x, int64_t n_tok, int64_t stride, int n_heads, int head_dim, const int32_t* pos,
            const RopeParams& p) override {
    use();
    cuda::rope(x, n_tok, stride, n_heads, head_dim, pos, p, st_);
  }
  void kv_store(const KVView& kv, int64_t first, const float* k, const float* v, int64_t n, int64_t src_stride,
                int64_t dim) override {
    use();
    cuda::kv_store(kv, first, k, v, n, src_stride, dim, st_);
  }
  void attention(const AttnArgs& a) override {
    use();
    const int splits = cuda::attn_splits(a, prop_.multiProcessorCount);
    float* scratch = scratch_for(cuda::attn_scratch_floats(a, splits));
    cuda::attention(a, splits, scratch, st_);
  }
  void glu(const float* gate, int64_t gs, const float* up, int64_t us, float* out, int64_t n_rows, int64_t dim,
           Act act) override {
    use();
    cuda::glu(gate, gs, up, us, out, n_rows, dim, act, st_);
  }
  void add(float* y, const float* x, int64_t n) override { use(), cuda::add(y, x, n, st_); }
  void add_bias(float* y, const float* b, int64_t n_rows, int64_t dim) override {
    use(), cuda::add_bias(y, b, n_rows, dim, st_);
  }
  void scale(float* y, float s, int64_t n) override { use(), cuda::scale(y, s, n, st_); }
  void softcap(float* y, float cap, int64_t n) override { use(), cuda::softcap(y, cap, n, st_); }
  void layer_norm(const float* x, const float* w, const float* b, float* y, int64_t n_rows, int64_t dim,
                  float eps) override {
    use(), cuda::layer_norm(x, w, b, y, n_rows, dim, eps, st_);
  }
  void gelu_erf(float* y, int64_t n) override { use(), cuda::gelu_erf(y, n, st_); }
  void copy_rows(float* dst, int64_t ds, const float* src, int64_t ss, int64_t rows, int64_t width) override {
    use(), cuda::copy_rows(dst, ds, src, ss, rows, width, st_);
  }
  void im2col_1d(const float* x, int64_t x_stride, int64_t C, int64_t T, int k, int stride, int pad, float* out,
                 int64_t T_out) override {
    use(), cuda::im2col_1d(x, x_stride, C, T, k, stride, pad, out, T_out, st_);
  }
  void im2col_rows(const float* x, int64_t C, int64_t T, int k, int stride, int pad, float* out,
                   int64_t T_out) override {
    use(), cuda::im2col_rows(x, C, T, k, stride, pad, out, T_out, st_);
  }
  void avg_pool_rows(const float* x, int64_t n_rows, int64_t dim, int k, float* out) override {
    use(), cuda::avg_pool_rows(x, n_rows, dim, k, out, st_);
  }

 private:
  void use() const { check(cudaSetDevice(dev_), "cudaSetDevice"); }
  std::string where() const { return "cuda:" + std::to_string(dev_) + " (" + prop_.name + ")"; }
  static std::string type_label(uint32_t t) {
    const TypeTraits* tt = type_traits(t);
    return tt ? tt->name : "id " + std::to_string(t);
  }
  static cuda::Mat mat(const Weight& w) {
    if (!w.data) throw Error("cuda: a weight used before load_weight");
    cuda::Mat m;
    m.type = w.type, m.w = w.data, m.row_bytes = w.row_bytes, m.rows = w.rows, m.cols = w.cols;
    return m;
  }
  // Attention's split partials; grown (never shrunk) on demand. Growing frees the old
  // buffer after the stream has drained, since kernels in flight may still read it.
  float* scratch_for(size_t floats) {
    if (floats == 0) return nullptr;
    if (!scratch_ || scratch_->size() < floats * 4) {
      if (scratch_) check(cudaStreamSynchronize(st_), "attention scratch");
      scratch_.reset();
      scratch_ = alloc(floats * 4 + (floats * 4) / 2, "attention scratch");
    }
    return static_cast<float*>(scratch_->data());
  }

  int dev_;
  cudaDeviceProp prop_{};
  cudaStream_t st_ = nullptr;
  BufferPtr scratch_;
};

}  // namespace

std::shared_ptr<Backend> make_cuda_backend(int device_index) {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    cudaGetLastError();
    throw DeviceError("cuda: " + no_device_reason(e));
  }
  if (n == 0) throw DeviceError("cuda: no CUDA device found");
  if (device_index < 0 || device_index >= n)
    throw DeviceError("cuda:" + std::to_string(device_index) + ": no such device (" + std::to_string(n) +
                      " found: cuda:0" + (n > 1 ? "..cuda:" + std::to_string(n - 1) : std::string()) + ")");
  return std::make_shared<CudaBackend>(device_index);
}

BackendProbe probe_cuda() {
  BackendProbe p;
  p.backend = "cuda";
  p.built = true;
  try {
    int n = 0;
    const cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
      cudaGetLastError();
      p.error = no_device_reason(e);
      return p;
    }
    if (n == 0) {
      p.error = "no CUDA device found";
      return p;
    }
    int drv = 0, rt = 0;
    cudaDriverGetVersion(&drv);
    cudaRuntimeGetVersion(&rt);
    int cur = -1;
    cudaGetDevice(&cur);
    for (int i = 0; i < n; ++i) {
      cudaDeviceProp prop{};
      if (cudaGetDeviceProperties(&prop, i) != cudaSuccess) {
        cudaGetLastError();
        continue;
      }
      DeviceInfo d;
      d.backend = "cuda";
      d.index = i;
      d.name = prop.name;
      d.cc_major = prop.major;
      d.cc_minor = prop.minor;
      d.total_bytes = prop.totalGlobalMem;
      d.driver = "driver " + version_str(drv) + ", runtime " + version_str(rt);
      // Free memory needs a context on the device (made here once; the runtime keeps it).
      size_t fr = 0, tot = 0;
      if (cudaSetDevice(i) == cudaSuccess && cudaMemGetInfo(&fr, &tot) == cudaSuccess)
        d.free_bytes = fr, d.total_bytes = tot;
      else
        cudaGetLastError();
      p.devices.push_back(d);
    }
    if (cur >= 0) cudaSetDevice(cur);
    if (p.devices.empty()) p.error = "CUDA devices found but none could be queried";
  } catch (const std::exception& ex) {
    p.error = ex.what();
  } catch (...) {
    p.error = "unknown error while probing CUDA";
  }
  return p;
}

}  // namespace dl
