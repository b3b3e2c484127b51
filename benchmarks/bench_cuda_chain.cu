// What a whole decode step's weight reads take when they are chained the way the step chains its
// kernels, and nothing else: 16 layers of Q/K/V, a small attention-like read, O, gate + up and down,
// then the head (Llama-3.2-1B's sizes in Q8_0 or F16), every launch on its own bytes (L2 cold), all
// captured in one graph. It asks one question for issue 13: how much of a step's gap to the copy
// bandwidth is the launches' boundaries, and does a kernel that is already resident beside the one
// before (it triggers its dependents at its start, and its blocks stream their slice into a ring of
// shared memory with bulk copies, the first stages before they wait) close it?
//
//   nvcc -O3 -arch=sm_90 benchmarks/bench_cuda_chain.cu -o /tmp/chain && /tmp/chain
//
// Prints, per way of reading, the step's us, its bytes over that time, and the fraction of the
// measured device-to-device copy bandwidth.
#include <cstdio>
#include <cstdint>
#include <vector>
#include <algorithm>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e)); exit(1); } } while (0)
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void pdl_trigger() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }
__device__ __forceinline__ uint32_t sa(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }

// Flags: bit 0, the first round of loads goes out before the wait (the decode GEMVs do this);
// bit 1, trigger the dependents at the start instead of after the wait.
enum { EARLY = 1, TRIG_FIRST = 2 };

// One round a thread (grid sized to the bytes): the step's GEMVs' shape.
template <int U>
__global__ void __launch_bounds__(256) rd(const uint4* __restrict__ p, size_t n16, float* out, int flags) {
  if (flags & TRIG_FIRST) pdl_trigger();
  if (!(flags & EARLY)) pdl_wait();
  uint32_t acc = 0;
  const size_t stride = (size_t)gridDim.x * 256 * U;
  bool waited = !(flags & EARLY);
  for (size_t i = (size_t)blockIdx.x * 256 * U + threadIdx.x; i < n16; i += stride) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) { size_t k = i + (size_t)u * 256; v[u] = k < n16 ? __ldg(p + k) : make_uint4(0, 0, 0, 0); }
    if (!waited) { pdl_wait(); waited = true; }
#pragma unroll
    for (int u = 0; u < U; ++u) acc += v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  if (!waited) pdl_wait();
  if (!(flags & TRIG_FIRST)) pdl_trigger();
  if (acc == 0x12345678u) out[blockIdx.x] = acc;
}

__device__ __forceinline__ size_t dmin(size_t a, size_t b) { return a < b ? a : b; }

// A block streams its contiguous slice through a ring of `stages` shared-memory stages of `chunk`
// bytes, one bulk copy and one mbarrier a stage; the first stages are asked for before the wait.
__global__ void __launch_bounds__(256, 1) rd_ring(const uint8_t* __restrict__ p, size_t bytes, float* out, int flags,
                                                  int stages, int chunk) {
  extern __shared__ __align__(128) uint8_t ring[];
  __shared__ __align__(8) uint64_t full[16];
  const int tid = threadIdx.x;
  const size_t per = ((bytes + gridDim.x - 1) / gridDim.x + 15) / 16 * 16;
  const size_t beg = dmin(bytes, (size_t)blockIdx.x * per), end = dmin(bytes, beg + per);
  const int nch = (int)((end - beg + chunk - 1) / chunk);
  if (tid == 0) {
    for (int s = 0; s < stages; ++s) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(sa(&full[s])) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (flags & TRIG_FIRST) pdl_trigger();
  auto issue = [&](int c) {
    const int s = c % stages;
    const size_t off = beg + (size_t)c * chunk;
    const uint32_t n = (uint32_t)dmin((size_t)chunk, end - off);
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(sa(&full[s])), "r"(n) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                     sa(ring + (size_t)s * chunk)),
                 "l"(p + off), "r"(n), "r"(sa(&full[s]))
                 : "memory");
  };
  if (tid == 0)
    for (int c = 0; c < dmin(stages, nch); ++c) issue(c);
  pdl_wait();
  if (!(flags & TRIG_FIRST)) pdl_trigger();
  uint32_t acc = 0;
  for (int c = 0; c < nch; ++c) {
    const int s = c % stages;
    const uint32_t parity = (c / stages) & 1;
    uint32_t done = 0;
    while (!done)
      asm volatile("{\n .reg .pred q;\n mbarrier.try_wait.parity.shared::cta.b64 q, [%1], %2;\n selp.u32 %0, 1, 0, q;\n}\n"
                   : "=r"(done)
                   : "r"(sa(&full[s])), "r"(parity)
                   : "memory");
    const size_t n = dmin((size_t)chunk, end - beg - (size_t)c * chunk);
    const uint4* st = reinterpret_cast<const uint4*>(ring + (size_t)s * chunk);
    for (int i = tid; i < (int)(n / 16); i += 256) { uint4 v = st[i]; acc += v.x ^ v.y ^ v.z ^ v.w; }
    __syncthreads();
    if (tid == 0 && c + stages < nch) {
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
      issue(c + stages);
    }
  }
  if (acc == 0x12345678u) out[blockIdx.x] = acc;
}

struct Way {
  const char* name;
  int ring;  // 0: rd<8> one round a thread; else rd_ring with `ring` blocks an SM
  int flags, stages, chunk;
};

int main() {
  cudaDeviceProp pr;
  CK(cudaGetDeviceProperties(&pr, 0));
  const int sms = pr.multiProcessorCount;
  printf("%s, %d SMs, L2 %d MB\n", pr.name, sms, pr.l2CacheSize >> 20);
  CK(cudaFuncSetAttribute(rd_ring, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 << 10));
  float* out;
  CK(cudaMalloc(&out, 1 << 20));
  // the copy bandwidth, read + write, over 2 GB
  {
    const size_t n = size_t(1) << 30;
    void *a, *b;
    CK(cudaMalloc(&a, n));
    CK(cudaMalloc(&b, n));
    CK(cudaMemset(a, 1, n));
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    float best = 1e9f;
    for (int r = 0; r < 6; ++r) {
      CK(cudaEventRecord(e0));
      CK(cudaMemcpy(b, a, n, cudaMemcpyDeviceToDevice));
      CK(cudaEventRecord(e1));
      CK(cudaEventSynchronize(e1));
      float ms;
      CK(cudaEventElapsedTime(&ms, e0, e1));
      best = std::min(best, ms);
    }
    printf("copy: %.0f GB/s\n", 2.0 * n / best / 1e6);
    CK(cudaFree(a));
    CK(cudaFree(b));
  }
  const Way ways[] = {
      {"plain", 0, 0, 0, 0},
      {"pdl early loads", 0, EARLY, 0, 0},
      {"pdl early loads, trigger first", 0, EARLY | TRIG_FIRST, 0, 0},
      {"ring 1/SM 4x16K", 1, 0, 4, 16384},
      {"ring 1/SM 4x16K trigger first", 1, TRIG_FIRST, 4, 16384},
      {"ring 1/SM 6x16K trigger first", 1, TRIG_FIRST, 6, 16384},
      {"ring 1/SM 12x8K trigger first", 1, TRIG_FIRST, 12, 8192},
      {"ring 1/SM 3x32K trigger first", 1, TRIG_FIRST, 3, 32768},
      {"ring 2/SM 3x16K trigger first", 2, TRIG_FIRST, 3, 16384},
      {"ring 2/SM 6x8K trigger first", 2, TRIG_FIRST, 6, 8192},
  };
  for (int f16 = 0; f16 < 2; ++f16) {
    // Llama-3.2-1B: Q/K/V, O, gate + up, down (a layer), the head; q8_0 is 34 bytes a 32 weights
    const double bpw = f16 ? 2.0 : 34.0 / 32;
    auto mb = [&](double w) { return (size_t)(w * bpw) / 16 * 16; };
    const size_t qkv = mb(3072.0 * 2048), o = mb(2048.0 * 2048), gu = mb(16384.0 * 2048), dn = mb(2048.0 * 8192),
                 head = mb(128256.0 * 2048), attn = 131072;  // ~100 keys of 8 KV heads, K and V, f16
    std::vector<size_t> seq;
    for (int l = 0; l < 16; ++l) seq.insert(seq.end(), {qkv, attn, o, gu, dn});
    seq.push_back(head);
    size_t total = 0, weights = 0;
    std::vector<size_t> offs;
    for (size_t s : seq) offs.push_back(total), total += (s + 4095) / 4096 * 4096, weights += s;
    uint8_t* pool;
    CK(cudaMalloc(&pool, total));
    CK(cudaMemset(pool, 1, total));
    printf("\n%s step: %zu launches, %.1f MB\n", f16 ? "F16" : "Q8_0", seq.size(), weights / 1e6);
    for (const Way& w : ways) {
      cudaStream_t st;
      CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
      cudaLaunchAttribute at[1];
      at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
      at[0].val.programmaticStreamSerializationAllowed = 1;
      const bool pdl = w.ring || (w.flags & EARLY);
      cudaGraph_t g;
      cudaGraphExec_t ex;
      CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeRelaxed));
      for (size_t i = 0; i < seq.size(); ++i) {
        cudaLaunchConfig_t cfg = {};
        cfg.blockDim = 256, cfg.stream = st, cfg.attrs = at, cfg.numAttrs = pdl ? 1 : 0;
        const size_t n = seq[i];
        if (n == attn) {  // the attention stand-in: 32 small blocks, waits first like the real one
          cfg.gridDim = 32;
          CK(cudaLaunchKernelEx(&cfg, rd<1>, (const uint4*)(pool + offs[i]), n / 16, out, w.flags & TRIG_FIRST));
        } else if (!w.ring) {
          cfg.gridDim = (unsigned)((n / 16 + 256 * 8 - 1) / (256 * 8));
          CK(cudaLaunchKernelEx(&cfg, rd<8>, (const uint4*)(pool + offs[i]), n / 16, out, w.flags));
        } else {
          cfg.gridDim = (unsigned)(sms * w.ring);
          cfg.dynamicSmemBytes = (size_t)w.stages * w.chunk;
          CK(cudaLaunchKernelEx(&cfg, rd_ring, (const uint8_t*)(pool + offs[i]), n, out, w.flags, w.stages, w.chunk));
        }
      }
      CK(cudaStreamEndCapture(st, &g));
      CK(cudaGraphInstantiate(&ex, g, 0));
      cudaEvent_t a, b;
      CK(cudaEventCreate(&a));
      CK(cudaEventCreate(&b));
      std::vector<float> t;
      for (int r = 0; r < 12; ++r) {
        CK(cudaEventRecord(a, st));
        CK(cudaGraphLaunch(ex, st));
        CK(cudaEventRecord(b, st));
        CK(cudaEventSynchronize(b));
        float ms;
        CK(cudaEventElapsedTime(&ms, a, b));
        if (r >= 2) t.push_back(ms);
      }
      std::sort(t.begin(), t.end());
      printf("  %-34s best %7.1f us  median %7.1f us  %6.0f GB/s  (%.0f steps/s)\n", w.name, t[0] * 1e3,
             t[t.size() / 2] * 1e3, weights / (t[0] * 1e6), 1e3 / t[0]);
      cudaEventDestroy(a), cudaEventDestroy(b);
      cudaGraphExecDestroy(ex), cudaGraphDestroy(g), cudaStreamDestroy(st);
    }
    CK(cudaFree(pool));
  }
  return 0;
}
