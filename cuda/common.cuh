// Shared device helpers of the CUDA backend: error checks, half/bf16 decoding, warp sums.
#pragma once
#include <cuda_runtime.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <string>
#include <utility>

#include "core/errors.h"

namespace dl::cuda {

// A failed launch or call is a device problem, reported with the op that made it.
inline void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw DeviceError(std::string("cuda: ") + what + ": " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")");
}
inline void check_launch(const char* what) { check(cudaGetLastError(), what); }

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

__device__ __forceinline__ float h2f(uint16_t h) { return __half2float(__ushort_as_half(h)); }
__device__ __forceinline__ float bf2f(uint16_t h) { return __uint_as_float((uint32_t)h << 16); }
// 2-byte-aligned little-endian load (every block field we read in pairs is 2-aligned).
__device__ __forceinline__ uint32_t ld16(const uint8_t* p) { return *reinterpret_cast<const uint16_t*>(p); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ double warp_sum_d(double v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// One lane's value of a 32-block into the A8 form: amax over the warp, d = amax / 127,
// q = rint(v * (127 / amax)), and the block's quant sum (q4_0's offset term).
__device__ __forceinline__ void quant_store(float v, int lane, int64_t at, int64_t blk, int8_t* xq, float* xd,
                                            int32_t* xs) {
  const float amax = warp_max(fabsf(v));
  int q = 0;
  if (amax > 0.f) q = max(-127, min(127, (int)rintf(__fmul_rn(v, 127.f / amax))));
  xq[at] = (int8_t)q;
  int qs = q;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) qs += __shfl_xor_sync(0xffffffffu, qs, o);
  if (lane == 0) xd[blk] = amax / 127.f, xs[blk] = qs;
}


// ---- TF32 tensor cores (sm_80+) ----
// x rounded to TF32 (10 stored mantissa bits, f32's exponent range), as an mma operand.
__device__ __forceinline__ uint32_t to_tf32(float x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
  return r;
#else
  return __float_as_uint(x);  // (never run: tensor_cores() keeps these kernels off older GPUs)
#endif
}
__device__ __forceinline__ void mma_tf32(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

// f16 x f16 -> f32, m16n8k16: A a row-major 16 x 16 fragment, B a column-major 16 x 8 one.
__device__ __forceinline__ void mma_f16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

// ---- Programmatic dependent launch (sm_90+) ----
// A kernel launched with `launch` may be scheduled while the kernel before it in the
// stream still runs, so the gap between the two (launch latency, the last wave's tail)
// is hidden. Such a kernel must call pdl_wait() before it reads anything an earlier
// kernel wrote, or writes anything an earlier kernel reads: the wait returns once the
// previous grid has completed and its writes are visible. Work that touches only
// constant data (a GEMV's weights) may come before it. pdl_trigger() lets the next
// kernel be scheduled; each kernel calls it after its own wait, so at most one kernel
// runs ahead. Launched without the attribute (older GPUs, DASLLAMA_CUDA_PDL=0), both
// are no-ops.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
// ---- Thread-block clusters (sm_90+; compiled out below, where no cluster is launched) ----
// The cluster barrier in two halves, each thread of the block taking part (.aligned: the warp
// in step). arrive_relaxed orders nothing: a block announcing that it runs, so the others may
// write its shared memory once past their wait. (A release arrive would be a GPU-wide memory
// barrier in SASS, MEMBAR.ALL.GPU: data is handed over by st_async instead.)
__device__ __forceinline__ void cluster_arrive_relaxed() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
#endif
}
__device__ __forceinline__ void cluster_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}
__device__ __forceinline__ unsigned cluster_rank() {
  unsigned r = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
#endif
  return r;
}
__device__ __forceinline__ unsigned cluster_blocks() {
  unsigned r = 1;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(r));
#endif
  return r;
}
// The shared::cluster address of `p` (this block's shared memory) in block `rank`'s copy.
__device__ __forceinline__ uint32_t cluster_map(const void* p, unsigned rank) {
  uint32_t a = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(a) : "r"((uint32_t)__cvta_generic_to_shared(p)), "r"(rank));
#endif
  return a;
}
// A shared-memory barrier that completes once `bytes` have come in by st_async (one thread of
// the block that owns it, before the cluster barrier's phase that the senders wait on: the
// init's fence makes it visible across the cluster).
__device__ __forceinline__ void mbar_init_tx(uint64_t* bar, unsigned bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const uint32_t a = (uint32_t)__cvta_generic_to_shared(bar);
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(a) : "memory");
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(a), "r"(bytes) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
}
// v into shared::cluster address `a` of another block (or this one), counted on that block's
// barrier `bar` (a shared::cluster address too): no fence, the barrier sees the bytes land.
__device__ __forceinline__ void st_async(uint32_t a, float v, uint32_t bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];" ::"r"(a),
               "r"(__float_as_uint(v)), "r"(bar)
               : "memory");
#endif
}
// Waits for phase `parity` of this block's barrier to complete (what came in is then visible).
__device__ __forceinline__ void mbar_wait(uint64_t* bar, unsigned parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const uint32_t a = (uint32_t)__cvta_generic_to_shared(bar);
  uint32_t done = 0;
  do {
    asm volatile(
        "{ .reg .pred p; mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
        : "=r"(done)
        : "r"(a), "r"(parity)
        : "memory");
  } while (!done);
#endif
}

// Whether the current device takes dependent launches (compute capability 9.0 or newer,
// and not switched off).
bool pdl_on();
// The current device's compute capability major (asked once a device), capped by
// DASLLAMA_CUDA_CC_MAJOR: with CUDA_FORCE_PTX_JIT=1 as well, a newer GPU runs the build's
// compute_75 PTX on the paths a pre-Ampere GPU takes (tests/test_cuda.py's check of them).
int cc_major();
int cc_cap(int major);  // a major the device reports, capped the same way
// Whether the current device has the mma / cp.async instructions the tensor-core kernels use
// (compute capability 8.0 or newer): their bodies compile to nothing below that (the build's
// compute_75 PTX), so the hosts must not launch them there.
bool tensor_cores();

// k<<<grid, block, smem, st>>>(args...), as a dependent launch where pdl_on() and st is
// being captured into a graph (the decode steps, whose many small kernels gain from it;
// prefill's large grids, launched directly, measured 25 % slower with it on the H200).
// Only for kernels that call pdl_wait() as said above.
// With `cluster` (sm_90+), blocks form thread-block clusters of those dimensions.
template <class... P, class... A>
void launch_cluster(void (*k)(P...), dim3 grid, dim3 block, size_t smem, cudaStream_t st, dim3 cluster,
                    A&&... args) {
  cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
  const bool dep = pdl_on() && cudaStreamIsCapturing(st, &cs) == cudaSuccess && cs == cudaStreamCaptureStatusActive;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid, cfg.blockDim = block, cfg.dynamicSmemBytes = smem, cfg.stream = st;
  cudaLaunchAttribute at[2];
  unsigned na = 0;
  if (dep) {
    at[na].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    at[na++].val.programmaticStreamSerializationAllowed = 1;
  }
  if (cluster.x * cluster.y * cluster.z > 8)  // past a portable cluster (sm_90 takes 16)
    check(cudaFuncSetAttribute(k, cudaFuncAttributeNonPortableClusterSizeAllowed, 1), "a non-portable cluster size");
  if (cluster.x * cluster.y * cluster.z > 1) {
    at[na].id = cudaLaunchAttributeClusterDimension;
    at[na].val.clusterDim.x = cluster.x, at[na].val.clusterDim.y = cluster.y, at[na++].val.clusterDim.z = cluster.z;
  }
  cfg.attrs = at, cfg.numAttrs = na;
  check(cudaLaunchKernelEx(&cfg, k, std::forward<A>(args)...), "kernel launch");
}
template <class... P, class... A>
void launch(void (*k)(P...), dim3 grid, dim3 block, size_t smem, cudaStream_t st, A&&... args) {
  launch_cluster(k, grid, block, smem, st, dim3(1, 1, 1), std::forward<A>(args)...);
}

}  // namespace dl::cuda
