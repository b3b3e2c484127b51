// cuBLAS for the f16 prefill's products, opened at run time (dlopen), as the Vulkan loader is:
// the wheel links only the static runtime, so a machine without cuBLAS keeps our own tiles.
// Why: our mma.sync tiles bound a Llama-1B F16 pp512 at ~125 TFLOPS on the H100/H200, where
// cuBLAS's Hopper kernels (wgmma, TMA) go further; llama.cpp's F16 prefill is cuBLAS.
// The product is the same as the tiles' (x rounded to f16 on its token's power-of-two scale,
// f32 sums), then each token's row of y is scaled back by that scale's inverse.
#include <dlfcn.h>

#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>

#include "common.cuh"
#include "kernels.h"

namespace dl::cuda {
namespace {

// The few cuBLAS entry points and enum values used (their ABI is the same in cuBLAS 12 and 13),
// declared here so the build needs no cuBLAS headers.
using Handle = void*;
using CreateFn = int (*)(Handle*);
using SetStreamFn = int (*)(Handle, cudaStream_t);
using GemmExFn = int (*)(Handle, int, int, int, int, int, const void*, const void*, int, int, const void*, int, int,
                         const void*, void*, int, int, int, int);
constexpr int kOpN = 0, kOpT = 1, kR32F = 0, kR16F = 2, kCompute32F = 68, kGemmDefault = -1;

struct Lib {
  void* h = nullptr;
  std::string name;  // what dlopen was given
  CreateFn create = nullptr;
  SetStreamFn set_stream = nullptr;
  GemmExFn gemm = nullptr;
  Handle handles[64] = {};  // one a device, made at its first product
  bool failed[64] = {};
};

std::mutex mu;

// DASLLAMA_CUBLAS: a path to libcublas.so (the Python package sets it to a pip or CUDA toolkit
// copy it finds), else the loader's search by soname.
Lib* lib() {
  static Lib* l = [] {
    Lib* r = new Lib;
    const char* e = std::getenv("DASLLAMA_CUBLAS");
    const char* names[] = {e && *e ? e : nullptr, "libcublas.so.13", "libcublas.so.12", "libcublas.so"};
    for (const char* n : names)
      if (n && (r->h = dlopen(n, RTLD_NOW | RTLD_LOCAL))) {
        r->name = n;
        break;
      }
    if (r->h) {
      r->create = (CreateFn)dlsym(r->h, "cublasCreate_v2");
      r->set_stream = (SetStreamFn)dlsym(r->h, "cublasSetStream_v2");
      r->gemm = (GemmExFn)dlsym(r->h, "cublasGemmEx");
    }
    if (!r->create || !r->set_stream || !r->gemm) r->gemm = nullptr;
    return r;
  }();
  return l->gemm ? l : nullptr;
}

Handle handle() {
  Lib* l = lib();
  if (!l) return nullptr;
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return nullptr;
  std::lock_guard<std::mutex> g(mu);
  if (!l->handles[dev] && !l->failed[dev] && l->create(&l->handles[dev]) != 0) {
    l->handles[dev] = nullptr;
    l->failed[dev] = true;  // no memory for its workspace, say: our tiles from now on
  }
  return l->handles[dev];
}

// y[t][r] *= inv[t] for each of the matrices' outputs: a block a token (blockIdx.x) and matrix
// (blockIdx.y), four floats a thread where the rows allow.
struct Unscale {
  float* y[3];
  int64_t rows[3];
};
__global__ void __launch_bounds__(256) unscale_k(Unscale u, const float* __restrict__ inv) {
  pdl_wait();  // after cuBLAS's product (and it may let this start early)
  const int64_t rows = u.rows[blockIdx.y], t = blockIdx.x;
  float* y = u.y[blockIdx.y] + t * rows;
  const float s = inv[t];
  if (rows % 4 == 0 && ((uintptr_t)y & 15) == 0) {
    float4* y4 = reinterpret_cast<float4*>(y);
    for (int64_t i = threadIdx.x; i < rows / 4; i += 256) {
      float4 v = y4[i];
      v.x *= s, v.y *= s, v.z *= s, v.w *= s;
      y4[i] = v;
    }
  } else {
    for (int64_t i = threadIdx.x; i < rows; i += 256) y[i] *= s;
  }
  pdl_trigger();
}

}  // namespace

std::string cublas_name() {
  Lib* l = lib();
  return l ? l->name : std::string();
}

// On wherever the library opens (DASLLAMA_CUDA_CUBLAS=0: our tiles; read at each call, for
// ab_cuda.py). H100, Llama-1B pp512 (ab_cuda.py, best of 2): F16 52,713 -> 83,622, Q4_K_M (its
// blocks decoded to f16 first) 46,122 -> 68,101.
bool cublas_on() {
  const char* e = std::getenv("DASLLAMA_CUDA_CUBLAS");
  return !(e && e[0] == '0') && lib() != nullptr;
}

bool cublas_prepare() { return cublas_on() && handle() != nullptr; }

void cublas_f16_slabs(const Mat& m, void* dq, int64_t slab_rows, const __half* xh, const float* inv, int64_t n,
                      float* y, cudaStream_t st) {
  Handle h = handle();
  if (!h || slab_rows < 1 || n > INT32_MAX || m.rows > INT32_MAX || m.cols > INT32_MAX)
    throw Error("cuda: cuBLAS cannot take this block-format matmul");
  Lib* l = lib();
  std::lock_guard<std::mutex> g(mu);  // (as in cublas_f16)
  if (l->set_stream(h, st) != 0) throw Error("cuda: cublasSetStream failed");
  const float one = 1.f, zero = 0.f;
  for (int64_t r0 = 0; r0 < m.rows; r0 += slab_rows) {
    Mat sub = m;
    sub.w = m.w + (size_t)r0 * m.row_bytes;
    sub.rows = std::min(slab_rows, m.rows - r0);
    dequant_f16(sub, dq, st);
    // The slab's rows of y: rows r0.. of each token's row, so ldc is the whole matrix's rows.
    const int e = l->gemm(h, kOpT, kOpN, (int)sub.rows, (int)n, (int)m.cols, &one, dq, kR16F, (int)m.cols, xh, kR16F,
                          (int)m.cols, &zero, y + r0, kR32F, (int)m.rows, kCompute32F, kGemmDefault);
    if (e != 0) throw Error("cuda: cublasGemmEx failed (status " + std::to_string(e) + ")");
  }
  Unscale u{};
  u.y[0] = y, u.rows[0] = m.rows;
  launch(unscale_k, dim3((unsigned)n, 1u), 256, 0, st, u, inv);
}

bool cublas_f16(const Mat* ms, float* const* ys, int count, const __half* xh, const float* inv, int64_t n,
                cudaStream_t st) {
  if (count < 1 || count > 3 || n > INT32_MAX) return false;
  for (int i = 0; i < count; ++i)
    if (ms[i].rows > INT32_MAX || ms[i].cols > INT32_MAX || ms[i].row_bytes % 2 != 0) return false;
  Handle h = handle();
  if (!h) return false;
  Lib* l = lib();
  // One handle a device serves every backend on it: its stream is set and its products enqueued
  // under the lock, so two threads' products never swap streams.
  std::lock_guard<std::mutex> g(mu);
  if (l->set_stream(h, st) != 0) return false;
  const float one = 1.f, zero = 0.f;
  for (int i = 0; i < count; ++i) {
    const Mat& m = ms[i];
    // Column-major view: W^T (cols x rows, lda = row stride) transposed gives rows x cols; x is
    // cols x n; y is rows x n with ldc = rows, i.e. y[t][r] row-major.
    const int st_ = l->gemm(h, kOpT, kOpN, (int)m.rows, (int)n, (int)m.cols, &one, m.w, kR16F, (int)(m.row_bytes / 2),
                            xh, kR16F, (int)m.cols, &zero, ys[i], kR32F, (int)m.rows, kCompute32F, kGemmDefault);
    if (st_ != 0) {
      if (i == 0) return false;  // nothing written yet: the caller's tiles take it
      throw Error("cuda: cublasGemmEx failed (status " + std::to_string(st_) + ")");
    }
  }
  Unscale u{};
  for (int i = 0; i < count; ++i) u.y[i] = ys[i], u.rows[i] = ms[i].rows;
  launch(unscale_k, dim3((unsigned)n, (unsigned)count), 256, 0, st, u, inv);
  return true;
}

}  // namespace dl::cuda
