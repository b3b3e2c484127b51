// What a GPU kernel takes to read a decode step's weight matrices once, and nothing else: the floor
// each of the step's GEMVs is measured against (RESULTS.md, thirty-fourth session). Llama-3.2-1B's
// Q8_0 sizes (O, Q/K/V, ffn down, gate + up, the head), each read by 64 launches captured in a graph,
// every launch its own copy of the bytes (L2 cold), as plain launches and as dependent launches
// (PDL, sm_90: a launch's loads go out before it waits on the one before), over a few grid shapes
// (one-shot, or 2-4 blocks an SM looping) with 4 or 8 16-byte loads in flight a thread. Prints
// us a launch and GB/s.
//
//   nvcc -O3 -arch=sm_90 benchmarks/bench_cuda_read.cu -o /tmp/read && /tmp/read
#include <cstdio>
#include <cstdint>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e)); return 1; } } while (0)
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void pdl_trigger() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }
// Grid-stride read: each thread has U 16-byte loads in flight a round. With `early` (a dependent
// launch) the first round goes out before the wait on the launch before, as the decode GEMVs'
// first weights do. The xor sum only keeps the loads alive.
template <int U>
__global__ void __launch_bounds__(256) rd(const uint4* __restrict__ p, size_t n16, float* out, int early) {
  if (!early) { pdl_wait(); pdl_trigger(); }
  uint32_t acc = 0;
  const size_t stride = (size_t)gridDim.x * 256 * U;
  bool waited = !early;
  for (size_t i = (size_t)blockIdx.x * 256 * U + threadIdx.x; i < n16; i += stride) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) { size_t k = i + (size_t)u * 256; v[u] = k < n16 ? __ldg(p + k) : make_uint4(0,0,0,0); }
    if (!waited) { pdl_wait(); pdl_trigger(); waited = true; }
#pragma unroll
    for (int u = 0; u < U; ++u) acc += v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  if (!waited) { pdl_wait(); pdl_trigger(); }
  if (acc == 0x12345678u) out[blockIdx.x] = acc;
}
// 64 launches of rd<U> over `bytes`, each on its own copy inside the pool (so no launch finds the
// one before's bytes in L2), captured in a graph; grid_mode 0: one round a thread, else that many
// blocks an SM looping. Prints the best of 5 replays, us a launch.
template <int U>
int run(const char* name, size_t bytes, int grid_mode, bool pdl, uint8_t* pool, size_t pool_bytes, float* out,
        int sms) {
  const size_t slot = (bytes + (2u << 20) - 1) / (2u << 20) * (2u << 20);
  const size_t copies = pool_bytes / slot, n16 = bytes / 16;
  const unsigned grid = grid_mode == 0 ? (unsigned)((n16 + 256 * U - 1) / (256 * U)) : (unsigned)(sms * grid_mode);
  cudaStream_t st;
  CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  cudaLaunchAttribute at[1];
  at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  at[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid, cfg.blockDim = 256, cfg.stream = st, cfg.attrs = at, cfg.numAttrs = pdl ? 1 : 0;
  const int L = 64;
  cudaGraph_t g;
  cudaGraphExec_t ex;
  CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeRelaxed));
  for (int i = 0; i < L; ++i)
    CK(cudaLaunchKernelEx(&cfg, rd<U>, (const uint4*)(pool + (i % copies) * slot), n16, out, (int)pdl));
  CK(cudaStreamEndCapture(st, &g));
  CK(cudaGraphInstantiate(&ex, g, 0));
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  float best = 1e9f;
  for (int r = 0; r < 5; ++r) {
    CK(cudaEventRecord(a, st));
    CK(cudaGraphLaunch(ex, st));
    CK(cudaEventRecord(b, st));
    CK(cudaEventSynchronize(b));
    float ms;
    CK(cudaEventElapsedTime(&ms, a, b));
    if (ms < best) best = ms;
  }
  const double us = best * 1000 / L;
  printf("%-6s %7.2f MB grid %6u U %d %s: %7.2f us  %6.0f GB/s\n", name, bytes / 1e6, grid, U, pdl ? "pdl " : "plain",
         us, bytes / us / 1e3);
  cudaEventDestroy(a), cudaEventDestroy(b);
  cudaGraphExecDestroy(ex), cudaGraphDestroy(g), cudaStreamDestroy(st);
  return 0;
}
int main() {
  cudaDeviceProp pr; cudaGetDeviceProperties(&pr, 0);
  printf("%s, %d SMs, L2 %d MB\n", pr.name, pr.multiProcessorCount, pr.l2CacheSize >> 20);
  const size_t sizes[] = {4521984, 6782976, 17891328, 35782656, 279040000};
  const char* names[] = {"O", "QKV", "down", "gu", "head"};
  const size_t pool_bytes = size_t(4) * (280u << 20);  // at least 4 copies of every size, far past L2
  uint8_t* pool;
  CK(cudaMalloc(&pool, pool_bytes));
  CK(cudaMemset(pool, 1, pool_bytes));
  float* out; CK(cudaMalloc(&out, 1 << 20));
  const int sms = pr.multiProcessorCount;
  for (int s = 0; s < 5; ++s) {
    for (int pdl = 0; pdl < 2; ++pdl) {
      run<8>(names[s], sizes[s], 0, pdl, pool, pool_bytes, out, sms);
      run<4>(names[s], sizes[s], 0, pdl, pool, pool_bytes, out, sms);
      run<4>(names[s], sizes[s], 4, pdl, pool, pool_bytes, out, sms);
      run<8>(names[s], sizes[s], 2, pdl, pool, pool_bytes, out, sms);
      run<8>(names[s], sizes[s], 4, pdl, pool, pool_bytes, out, sms);
    }
  }
  return 0;
}
