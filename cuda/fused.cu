// A one-token decode step of a whole dense layer in q8 mode as one kernel (Backend::decode_layer).
//
// Op by op, a Llama layer's decode step is 11 launches of a few microseconds each, most of it
// ramp, tail and launch gaps rather than bytes (ninth session's profile: 183 kernels a step,
// the layer GEMVs at 16-51 % of the memory's bandwidth). Here one persistent grid, sized to
// be resident at once, runs the layer's phases and meets at a grid-wide barrier between them:
//   A  RMS norm and q8 rounding of x (every block into its own shared memory), Q/K/V GEMV
//   B1 rope of q and k, K/V into the cache (a block per KV head)
//   B2 attention, flash-decoding items of 128 threads (two per block), last split merges
//   C  q8 rounding of the attention output (each block), O GEMV added into x
//   D  norm and rounding of x (each block), gate/up GEMV
//   D2 the GLU and its q8 rounding into global memory (a warp per 32-block)
//   E  down GEMV added into x
// Each phase's first weights are loaded before its barrier (they are constant), so the
// barrier's wait overlaps the memory's latency. Every value is computed by the same device
// code in the same order as the separate kernels (gemv_q8.cuh, attn.cuh, rope.cuh), so the
// layer's output equals the op-by-op path bit for bit (tests/test_cuda.py holds it to that).
#include <algorithm>
#include <cstdio>
#include <string>

#include "act.cuh"
#include "attn.cuh"
#include "common.cuh"
#include "gemv_q8.cuh"
#include "kernels.h"
#include "rope.cuh"

namespace dl::cuda {
namespace {

constexpr int FT = SW * 32;  // threads per block (quant_smem's)
constexpr int kUnits = 2;  // 16-byte weight units per row in flight per lane (4 spills at two blocks an SM)

__device__ __forceinline__ uint64_t now_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// All blocks of the grid meet here (every block is resident: the grid is sized by occupancy,
// and the next kernel is let in only after the last barrier). bar[0] counts arrivals over the
// launch; the k-th barrier waits for k * gridDim.x. Thread 0 arrives with a release add and
// polls with relaxed loads and a short sleep (the ninth session's first form, a fence, an atomic
// and a tight ld.acquire loop, cost several microseconds a barrier at 264 blocks), then a
// fence makes what the other blocks wrote before arriving visible; the block barrier passes it on.
__device__ __forceinline__ void grid_sync(unsigned* bar, unsigned& target) {
  target += gridDim.x;
  __syncthreads();
  if (threadIdx.x == 0) {
    asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(bar) : "memory");
    unsigned v;
    for (;;) {
      asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(bar) : "memory");
      if (v >= target) break;
      __nanosleep(40);
    }
    asm volatile("fence.acq_rel.gpu;" ::: "memory");
  }
  __syncthreads();
}

// The weights of jobs js (rows of their matrices) into L2, spread over the grid's threads: issued
// while the grid waits on latency (rope, attention, the GLU), read by the next GEMV phases.
__device__ __forceinline__ void prefetch_l2(const GemvJob& j) {
  const int64_t stride = (int64_t)gridDim.x * FT * 128;
  for (int m = 0; m < j.count; ++m) {
    const uint8_t* w = j.w[m];
    const int64_t bytes = j.rows[m] * (int64_t)j.rb[m];
    for (int64_t off = ((int64_t)blockIdx.x * FT + threadIdx.x) * 128; off < bytes; off += stride)
      asm volatile("prefetch.global.L2 [%0];" ::"l"(w + off));
  }
}

// One GEMV phase: the blocks of job j (one token) spread over the grid. prep() runs once,
// after this block's first weights are in flight (or at once when it has no block of j).
template <uint32_t T, XLoad XL, class Prep>
__device__ __forceinline__ void gemv_phase(const GemvJob& j, int ks, Prep prep) {
  bool first = true;
  const int64_t blocks = j.first_block[j.count];
  for (int64_t b = blockIdx.x; b < blocks; b += gridDim.x) {
    gemv_q8_block<T, 1, 4, XL, kUnits>(j, ks, (int)b, [&] {
      if (first) prep(), first = false;
    });
    __syncthreads();  // the block's shared sums are free again
  }
  if (first) prep();
}

template <uint32_t T, int KT, int NI>
__global__ void __launch_bounds__(FT, 2) fused_layer_k(FusedLayerArgs f) {
  extern __shared__ __align__(16) uint8_t smem[];
  __shared__ AttnSmem<NI> as[2];
  __shared__ double red[FT / 32];
  const int64_t maxc = f.dim > f.q_dim ? f.dim : f.q_dim;
  int8_t* sq = reinterpret_cast<int8_t*>(smem);
  float* sd = reinterpret_cast<float*>(smem + maxc);
  int32_t* ss = reinterpret_cast<int32_t*>(smem + maxc + maxc / 32 * 4);
  unsigned target = 0;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  // DASLLAMA_CUDA_FUSED_TRACE=P: block 0 prints when each phase's barrier let it through, at
  // rope position P (where the time goes; thread 0's clock, the barriers align the blocks).
  uint64_t ts[8] = {};
  int nts = 0;
  const bool trace = f.trace >= 0 && blockIdx.x == 0 && tid == 0;
  auto stamp = [&] {
    if (trace && nts < 8) ts[nts++] = now_ns();
  };
  stamp();

  // A: norm + rounding of x, Q/K/V. The previous kernel's writes (x, the barrier's reset)
  // are waited for after this block's first weights are in flight.
  GemvJob j = f.qkv;
  j.xq = sq, j.xd = sd, j.xs = ss;
  gemv_phase<T, XLoad::shared>(j, f.ks_qkv, [&] {
    pdl_wait();
    quant_smem<XLoad::l2>(f.x, f.dim, true, f.attn_norm, f.eps, sq, sd, ss, red);
  });
  const AttnArgs a = *f.attn;
  grid_sync(f.bar, target);
  stamp();

  // B1: a block per KV head: rope of its query heads and its key, then its K and V slices into
  // the cache row n_kv - 1 (the key after its rope).
  {
    const int hd = a.head_dim, qpg = a.n_heads / a.n_kv_heads, half = f.rope.n_rot / 2;
    const int64_t p = f.pos[0], row = a.n_kv - 1;
    for (int g = blockIdx.x; g < a.n_kv_heads; g += gridDim.x) {
      for (int idx = tid; idx < (qpg + 1) * half; idx += FT) {
        const int hh = idx / half, i = idx % half;
        float* v = hh < qpg ? f.q + (int64_t)(g * qpg + hh) * hd : f.k + (int64_t)g * hd;
        float c, s;
        rope_cs(f.rope, p, i, &c, &s);
        const int i0 = f.rope.neox ? i : 2 * i, i1 = f.rope.neox ? i + half : 2 * i + 1;
        float o0, o1;
        rope_rot(__ldcg(v + i0), __ldcg(v + i1), c, s, &o0, &o1);
        v[i0] = o0, v[i1] = o1;
      }
      __syncthreads();
      kv_store_slice(a.kv, row, f.k, false, (int64_t)g * hd, (int64_t)(g + 1) * hd, tid, FT);
      kv_store_slice(a.kv, row, f.v, true, (int64_t)g * hd, (int64_t)(g + 1) * hd, tid, FT);
      __syncthreads();
    }
  }
  if (f.prefetch) prefetch_l2(f.o), prefetch_l2(f.gu);
  grid_sync(f.bar, target);
  stamp();

  // B2: attention items (split, head), two at a time per block on named barriers 1 and 2.
  {
    const int hf = tid >> 7;
    const int64_t items = (int64_t)f.splits * a.n_heads;
    for (int64_t it = (int64_t)blockIdx.x * 2 + hf; it < items; it += 2 * (int64_t)gridDim.x)
      attn_item<KT, NI>(a, 0, 0, (int)(it % a.n_heads), (int)(it / a.n_heads), f.splits, f.part, f.cnt, tid & 127,
                        1 + hf, as[hf]);
  }
  j = f.o;  // its first weights load before the barrier
  j.xq = sq, j.xd = sd, j.xs = ss;
  // C: rounding of the attention's output, O added into x.
  gemv_phase<T, XLoad::shared>(j, f.ks_o, [&] {
    grid_sync(f.bar, target);
    stamp();
    quant_smem<XLoad::l2>(f.att, f.q_dim, false, nullptr, 0.f, sq, sd, ss, red);
  });

  // D: norm + rounding of x, gate and up.
  j = f.gu;
  j.xq = sq, j.xd = sd, j.xs = ss;
  gemv_phase<T, XLoad::shared>(j, f.ks_gu, [&] {
    grid_sync(f.bar, target);
    stamp();
    quant_smem<XLoad::l2>(f.x, f.dim, true, f.ffn_norm, f.eps, sq, sd, ss, red);
  });
  grid_sync(f.bar, target);
  stamp();

  // D2: the GLU and its q8 form (global: every block of E reads all of it).
  if (f.prefetch) prefetch_l2(f.down);
  {
    int8_t* hq = static_cast<int8_t*>(f.h);
    float* hd = reinterpret_cast<float*>(hq + f.ffn);
    int32_t* hs = reinterpret_cast<int32_t*>(hq + f.ffn + f.ffn / 32 * 4);
    for (int64_t b = (int64_t)blockIdx.x * (FT / 32) + warp; b < f.ffn / 32; b += (int64_t)gridDim.x * (FT / 32)) {
      const int64_t i = b * 32 + lane;
      quant_store(glu_value(f.act, __ldcg(f.gate + i), __ldcg(f.up + i)), lane, i, b, hq, hd, hs);
    }
  }

  // E: down added into x. Every block is resident once it passes the barrier, so the next
  // kernel may be scheduled from here on.
  gemv_phase<T, XLoad::l2>(f.down, f.ks_down, [&] {
    grid_sync(f.bar, target);
    stamp();
    pdl_trigger();
  });
  if (trace && f.pos[0] == f.trace) {
    const uint64_t end = now_ns();
    printf("fused layer (%u blocks) at %d, us: A %.2f B1 %.2f B2 %.2f C %.2f D %.2f D2 %.2f E %.2f\n", gridDim.x,
           f.trace, (ts[1] - ts[0]) * 1e-3, (ts[2] - ts[1]) * 1e-3, (ts[3] - ts[2]) * 1e-3, (ts[4] - ts[3]) * 1e-3,
           (ts[5] - ts[4]) * 1e-3, (ts[6] - ts[5]) * 1e-3, (end - ts[6]) * 1e-3);
  }

  // The last block out resets the counters for the next launch (which waits for this grid).
  if (tid == 0) {
    __threadfence();
    if (atomicAdd(f.bar + 1, 1u) == gridDim.x - 1) f.bar[0] = 0, f.bar[1] = 0;
  }
}

template <uint32_t T, int KT, int NI>
void launch_fused(const FusedLayerArgs& f, cudaStream_t st) {
  const int64_t maxc = std::max(f.dim, f.q_dim);
  const size_t smem = (size_t)maxc + (size_t)maxc / 32 * 8;
  // Blocks resident at once (per device: the backend runs one device per thread).
  static int per_sm = -1, n_sm = 0;
  if (per_sm < 0) {
    int dev = 0;
    check(cudaGetDevice(&dev), "fused layer");
    check(cudaDeviceGetAttribute(&n_sm, cudaDevAttrMultiProcessorCount, dev), "fused layer");
    check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, fused_layer_k<T, KT, NI>, FT, smem), "fused layer");
  }
  if (per_sm < 1) throw Error("cuda fused layer: the kernel does not fit an SM");
  const int bps = f.blocks_per_sm > 0 ? std::min(f.blocks_per_sm, per_sm) : per_sm;
  launch(fused_layer_k<T, KT, NI>, (unsigned)(bps * n_sm), FT, smem, st, f);
  check_launch("fused layer");
}

template <uint32_t T>
void launch_kv(const FusedLayerArgs& f, int head_dim, KVType kv, cudaStream_t st) {
  const bool wide = head_dim > 64;
  switch (kv) {
    case KVType::f32: wide ? launch_fused<T, 0, 4>(f, st) : launch_fused<T, 0, 2>(f, st); break;
    case KVType::f16: wide ? launch_fused<T, 1, 4>(f, st) : launch_fused<T, 1, 2>(f, st); break;
    default: wide ? launch_fused<T, 8, 4>(f, st) : launch_fused<T, 8, 2>(f, st); break;
  }
}

}  // namespace

bool fused_layer_fits(uint32_t type, int head_dim, KVType kv, int64_t dim, int64_t q_dim) {
  return dim <= kQuantMax && q_dim <= kQuantMax && (type == T_Q8_0S || type == T_Q4_0S) && head_dim > 0 &&
         head_dim <= 128 && head_dim % 2 == 0 &&
         (kv == KVType::f32 || kv == KVType::f16 || kv == KVType::q8_0);
}

void fused_layer(const FusedLayerArgs& f, uint32_t type, int head_dim, KVType kv, cudaStream_t st) {
  if (!fused_layer_fits(type, head_dim, kv, f.dim, f.q_dim)) throw Error("cuda fused layer: a layer it does not take");
  if (type == T_Q8_0S) launch_kv<T_Q8_0S>(f, head_dim, kv, st);
  else launch_kv<T_Q4_0S>(f, head_dim, kv, st);
}

}  // namespace dl::cuda
