// Paged attention (flash-decoding: online softmax per key split, then a combine) and
// the KV-cache store (f32 / f16 / q8_0 rows through the block table).
#include <algorithm>
#include <cmath>
#include <string>

#include "common.cuh"
#include "kernels.h"

namespace dl::cuda {
namespace {

constexpr int KB = 4;      // keys a warp scores together (independent shuffle chains)
constexpr int WARPS = 4;   // warps per block, splitting the block's keys

__device__ __forceinline__ const uint8_t* kv_row(const KVView& kv, size_t off, int64_t j) {
  const int64_t mask = (int64_t(1) << kv.page_shift) - 1;
  return kv.base + (size_t)kv.pages[j >> kv.page_shift] * kv.page_bytes + off + (size_t)(j & mask) * kv.row_bytes;
}

// Element d of a head's slice of a cache row.
template <int KT>
__device__ __forceinline__ float kv_elem(const uint8_t* r, int d) {
  if constexpr (KT == 0) return reinterpret_cast<const float*>(r)[d];
  else if constexpr (KT == 1) return h2f(reinterpret_cast<const uint16_t*>(r)[d]);
  else {
    const uint8_t* b = r + (d >> 5) * 34;
    return __fmul_rn((float)(int8_t)b[2 + (d & 31)], h2f(ld16(b)));
  }
}

// Merges the splits' partial states of (row z, head h) into the output: run by the split
// that finished last, so its reads go past L1 (__ldcg) to what the other blocks wrote.
__device__ void combine_splits(const AttnArgs& a, int64_t t, int64_t z, int h, int splits,
                               const float* __restrict__ part) {
  const int hd = a.head_dim;
  const float* p = part + (z * a.n_heads + h) * splits * (int64_t)(hd + 2);
  float M = -INFINITY;
  for (int s = 0; s < splits; ++s) M = fmaxf(M, __ldcg(p + s * (hd + 2)));
  if (a.sinks) M = fmaxf(M, a.sinks[h]);
  float L = a.sinks ? expf(a.sinks[h] - M) : 0.f;
  for (int s = 0; s < splits; ++s) {
    const float ms = __ldcg(p + s * (hd + 2));
    if (ms != -INFINITY) L += __ldcg(p + s * (hd + 2) + 1) * expf(ms - M);
  }
  const float inv = L > 0.f ? 1.f / L : 0.f;
  float* o = a.out + t * a.out_stride + (int64_t)h * hd;
  for (int d = threadIdx.x; d < hd; d += blockDim.x) {
    float v = 0.f;
    for (int s = 0; s < splits; ++s) {
      const float ms = __ldcg(p + s * (hd + 2));
      if (ms != -INFINITY) v += __ldcg(p + s * (hd + 2) + 2 + d) * expf(ms - M);
    }
    o[d] = v * inv;
  }
}

// One block per (split, query head, row z). Lane holds dims lane + 32 i (i < NI) of q
// and of its running output; warps take KB keys at a time from the split's range.
// splits == 1 writes the normalized output; else (m, l, acc[hd]) partials to `part`, and
// the split that finishes last (counted in cnt[z][h], left at 0 again) merges them: no
// second launch.
// A group (dargs set: sessions' args in device memory, so a replayed graph sees each
// step's n_kv) maps row z to session z / maxtok, token z % maxtok; else z is the token of a0.
template <int KT, int NI>
__global__ void __launch_bounds__(WARPS * 32) attn_k(AttnArgs a0, const AttnArgs* __restrict__ dargs, int maxtok,
                                                     int splits, float* __restrict__ part, int* __restrict__ cnt) {
  pdl_wait();
  pdl_trigger();
  const int s = blockIdx.x, h = blockIdx.y;
  const int64_t z = blockIdx.z;
  const AttnArgs a = dargs ? dargs[z / maxtok] : a0;
  const int64_t t = dargs ? z % maxtok : z;
  if (t >= a.n_tok) return;  // the whole block: a shorter session of the group
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int hd = a.head_dim;
  const int kvh = h / (a.n_heads / a.n_kv_heads);
  const int64_t pos = a.q_pos[t];
  const int64_t hi = min(a.n_kv, pos + 1);
  const int64_t lo = a.window > 0 ? max(int64_t(0), pos - a.window + 1) : 0;
  const int64_t len = max(hi - lo, int64_t(0));
  const int64_t chunk = (len + splits - 1) / splits;
  const int64_t j0 = lo + s * chunk, j1 = min(hi, j0 + chunk);
  const size_t head_off = KT == 0 ? (size_t)kvh * hd * 4 : KT == 1 ? (size_t)kvh * hd * 2 : (size_t)kvh * (hd / 32) * 34;
  const size_t koff = a.kv.k_off + head_off, voff = a.kv.v_off + head_off;

  float q[NI], acc[NI];
  const float* qr = a.q + t * a.q_stride + (int64_t)h * hd;
#pragma unroll
  for (int i = 0; i < NI; ++i) {
    const int d = lane + 32 * i;
    q[i] = d < hd ? qr[d] : 0.f;
    acc[i] = 0.f;
  }
  float m = -INFINITY, l = 0.f;
  for (int64_t j = j0 + warp * KB; j < j1; j += WARPS * KB) {
    float sc[KB];
#pragma unroll
    for (int b = 0; b < KB; ++b) {
      float p = 0.f;
      if (j + b < j1) {
        const uint8_t* kr = kv_row(a.kv, koff, j + b);
#pragma unroll
        for (int i = 0; i < NI; ++i) {
          const int d = lane + 32 * i;
          if (d < hd) p += q[i] * kv_elem<KT>(kr, d);
        }
      }
      sc[b] = p;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
#pragma unroll
      for (int b = 0; b < KB; ++b) sc[b] += __shfl_xor_sync(0xffffffffu, sc[b], o);
    float mx = m;
#pragma unroll
    for (int b = 0; b < KB; ++b) {
      if (j + b < j1) {
        sc[b] = a.softcap > 0.f ? a.softcap * tanhf(sc[b] * a.scale / a.softcap) : sc[b] * a.scale;
        mx = fmaxf(mx, sc[b]);
      }
    }
    const float corr = expf(m - mx);  // m = -inf on the first keys: 0
    l *= corr;
#pragma unroll
    for (int i = 0; i < NI; ++i) acc[i] *= corr;
#pragma unroll
    for (int b = 0; b < KB; ++b) {
      if (j + b < j1) {
        const float p = expf(sc[b] - mx);
        l += p;
        const uint8_t* vr = kv_row(a.kv, voff, j + b);
#pragma unroll
        for (int i = 0; i < NI; ++i) {
          const int d = lane + 32 * i;
          if (d < hd) acc[i] += p * kv_elem<KT>(vr, d);
        }
      }
    }
    m = mx;
  }
  // Merge the warps' states.
  __shared__ float sm_m[WARPS], sm_l[WARPS], sm_acc[WARPS][NI * 32];
  if (lane == 0) sm_m[warp] = m, sm_l[warp] = l;
#pragma unroll
  for (int i = 0; i < NI; ++i) sm_acc[warp][lane + 32 * i] = acc[i];
  __syncthreads();
  float M = -INFINITY;
#pragma unroll
  for (int w = 0; w < WARPS; ++w) M = fmaxf(M, sm_m[w]);
  float f[WARPS], L = 0.f;
#pragma unroll
  for (int w = 0; w < WARPS; ++w) {
    f[w] = M == -INFINITY ? 0.f : expf(sm_m[w] - M);
    L += sm_l[w] * f[w];
  }
  if (splits == 1) {
    float* o = a.out + t * a.out_stride + (int64_t)h * hd;
    if (a.sinks) {  // the sink joins the denominator: rescale to the joint max
      const float sink = a.sinks[h], M2 = fmaxf(M, sink);
      const float c = M == -INFINITY ? 0.f : expf(M - M2);
#pragma unroll
      for (int w = 0; w < WARPS; ++w) f[w] *= c;
      L = L * c + expf(sink - M2);
    }
    const float inv = L > 0.f ? 1.f / L : 0.f;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
      float v = 0.f;
#pragma unroll
      for (int w = 0; w < WARPS; ++w) v += sm_acc[w][d] * f[w];
      o[d] = v * inv;
    }
  } else {
    float* p = part + ((z * a.n_heads + h) * splits + s) * (int64_t)(hd + 2);
    if (threadIdx.x == 0) p[0] = M, p[1] = L;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
      float v = 0.f;
#pragma unroll
      for (int w = 0; w < WARPS; ++w) v += sm_acc[w][d] * f[w];
      p[2 + d] = v;
    }
    __shared__ bool last;
    __threadfence();  // this block's partials are visible before it is counted
    __syncthreads();
    if (threadIdx.x == 0) {
      int* c = cnt + z * a.n_heads + h;
      last = atomicAdd(c, 1) == splits - 1;
      if (last) *c = 0;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    combine_splits(a, t, z, h, splits, part);
  }
}

// Block (row i, K or V); f32/f16: threads over elements; q8_0: a warp per 32-block,
// quantized as ggml's quantize_row_q8_0 does (d = amax/127, q = round(x/d), d as f16).
__device__ __forceinline__ void kv_store_row(const KVView& kv, int64_t first, const float* __restrict__ k,
                                             const float* __restrict__ v, int64_t src_stride, int64_t dim) {
  const int64_t i = blockIdx.x;
  const bool is_v = blockIdx.y == 1;
  const float* src = (is_v ? v : k) + i * src_stride;
  uint8_t* dst = const_cast<uint8_t*>(kv_row(kv, is_v ? kv.v_off : kv.k_off, first + i));
  if (kv.type == KVType::f32) {
    for (int64_t e = threadIdx.x; e < dim; e += blockDim.x) reinterpret_cast<float*>(dst)[e] = src[e];
  } else if (kv.type == KVType::f16) {
    for (int64_t e = threadIdx.x; e < dim; e += blockDim.x)
      reinterpret_cast<__half*>(dst)[e] = __float2half_rn(src[e]);
  } else {
    const int lane = threadIdx.x & 31;
    for (int64_t b = threadIdx.x >> 5; b < dim / 32; b += blockDim.x >> 5) {
      const float x = src[b * 32 + lane];
      const float amax = warp_max(fabsf(x));
      const float d = amax / 127.0f;
      const float id = d == 0.0f ? 0.0f : 1.0f / d;
      uint8_t* blk = dst + b * 34;
      blk[2 + lane] = (uint8_t)(int8_t)(int)roundf(__fmul_rn(x, id));
      if (lane == 0) *reinterpret_cast<__half*>(blk) = __float2half_rn(d);
    }
  }
}

__global__ void kv_store_k(KVView kv, int64_t first, const float* __restrict__ k, const float* __restrict__ v,
                           int64_t src_stride, int64_t dim) {
  pdl_wait();
  pdl_trigger();
  kv_store_row(kv, first, k, v, src_stride, dim);
}

// Several sessions' stores in one launch: descriptor blockIdx.z, row blockIdx.x.
__global__ void kv_store_group_k(const KVStoreDesc* __restrict__ d, int64_t src_stride, int64_t dim) {
  pdl_wait();
  pdl_trigger();
  const KVStoreDesc& e = d[blockIdx.z];
  if ((int64_t)blockIdx.x >= e.n) return;
  const KVView kv = e.kv;
  kv_store_row(kv, e.first, e.k, e.v, src_stride, dim);
}

template <int KT>
void launch_kt(const AttnArgs& a, const AttnArgs* dargs, int maxtok, int64_t rows, int splits, float* part, int* cnt,
               cudaStream_t st) {
  const dim3 grid((unsigned)splits, (unsigned)a.n_heads, (unsigned)rows);
  if (a.head_dim <= 64)
    launch(attn_k<KT, 2>, grid, WARPS * 32, 0, st, a, dargs, maxtok, splits, part, cnt);
  else if (a.head_dim <= 128)
    launch(attn_k<KT, 4>, grid, WARPS * 32, 0, st, a, dargs, maxtok, splits, part, cnt);
  else
    launch(attn_k<KT, 8>, grid, WARPS * 32, 0, st, a, dargs, maxtok, splits, part, cnt);
}

void launch_attn(const AttnArgs& a, const AttnArgs* dargs, int maxtok, int64_t rows, int splits, float* scratch,
                 int* cnt, cudaStream_t st) {
  if (splits > 1 && !cnt) throw Error("cuda attention: split partials need their counters");
  switch (a.kv.type) {
    case KVType::f32: launch_kt<0>(a, dargs, maxtok, rows, splits, scratch, cnt, st); break;
    case KVType::f16: launch_kt<1>(a, dargs, maxtok, rows, splits, scratch, cnt, st); break;
    case KVType::q8_0: launch_kt<8>(a, dargs, maxtok, rows, splits, scratch, cnt, st); break;
    default: throw UnsupportedModelError("cuda attention: unknown KV type");
  }
  check_launch("attention");
}

}  // namespace

int attn_splits(int64_t rows, int n_heads, int64_t n_kv, int n_sm) {
  // Enough blocks for ~8 per SM, at least 16 keys a split: a block walks its keys 16 at a
  // time, each round a chain of dependent loads, so short contexts split too.
  const int64_t base = std::max<int64_t>(1, rows * n_heads);
  const int64_t want = (8 * (int64_t)n_sm + base - 1) / base;
  // Powers of two, so a decode step's graph (the split count is in its launches) changes
  // a few times over a context, not every 32 tokens.
  int64_t cap = 1;
  while (cap * 16 < n_kv) cap *= 2;
  return (int)std::max<int64_t>(1, std::min<int64_t>({want, cap, 64}));
}
int attn_splits(const AttnArgs& a, int n_sm) { return attn_splits(a.n_tok, a.n_heads, a.n_kv, n_sm); }

size_t attn_scratch_floats(const AttnArgs& a, int splits) {
  return splits <= 1 ? 0 : (size_t)a.n_tok * a.n_heads * splits * (a.head_dim + 2);
}

void attn_check(const AttnArgs& a) {
  if (a.n_tok <= 0 || a.n_heads <= 0) return;
  if (a.n_kv_heads <= 0 || a.n_heads % a.n_kv_heads != 0)
    throw Error("cuda attention: n_heads " + std::to_string(a.n_heads) + " is not a multiple of n_kv_heads " +
                std::to_string(a.n_kv_heads));
  if (a.head_dim <= 0 || a.head_dim > 256)
    throw UnsupportedModelError("cuda attention: head_dim " + std::to_string(a.head_dim) + " (at most 256)");
  if (a.kv.type == KVType::q8_0 && a.head_dim % 32 != 0)
    throw UnsupportedModelError("cuda attention: a q8_0 cache needs head_dim a multiple of 32, not " +
                                std::to_string(a.head_dim));
  if (a.n_tok > 65535) throw Error("cuda attention: more than 65535 query rows in one call");
  if (a.kv.type != KVType::f32 && a.kv.type != KVType::f16 && a.kv.type != KVType::q8_0)
    throw UnsupportedModelError("cuda attention: unknown KV type");
}

void attention(const AttnArgs& a, int splits, float* scratch, int* counters, cudaStream_t st) {
  attn_check(a);
  if (a.n_tok <= 0 || a.n_heads <= 0) return;
  launch_attn(a, nullptr, 1, a.n_tok, splits, scratch, counters, st);
}

void attention_group(const AttnArgs& shape, const AttnArgs* dargs, int count, int maxtok, int splits, float* scratch,
                     int* counters, cudaStream_t st) {
  if (count <= 0 || maxtok <= 0 || shape.n_heads <= 0) return;
  launch_attn(shape, dargs, maxtok, (int64_t)count * maxtok, splits, scratch, counters, st);
}

void kv_store(const KVView& kv, int64_t first, const float* k, const float* v, int64_t n, int64_t src_stride,
              int64_t dim, cudaStream_t st) {
  if (n <= 0) return;
  if (kv.type == KVType::q8_0 && dim % 32 != 0)
    throw Error("cuda kv_store: q8_0 rows need dim a multiple of 32, not " + std::to_string(dim));
  launch(kv_store_k, dim3((unsigned)n, 2), 256, 0, st, kv, first, k, v, src_stride, dim);
  check_launch("kv_store");
}

void kv_store_group(const KVStoreDesc* d, int count, int64_t max_n, int64_t src_stride, int64_t dim,
                    cudaStream_t st) {
  if (count <= 0 || max_n <= 0) return;
  launch(kv_store_group_k, dim3((unsigned)max_n, 2, (unsigned)count), 256, 0, st, d, src_stride, dim);
  check_launch("kv_store group");
}

}  // namespace dl::cuda
