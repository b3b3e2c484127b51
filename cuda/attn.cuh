// Paged attention's device pieces, shared by the attention kernels (attention.cu) and the
// fused decoder layer (fused.cu): cache rows through the block table, one (split, head, row)
// item of flash-decoding run by 128 threads, and the KV store of a row's slice.
#pragma once
#include <cmath>
#include <cstdint>

#include "common.cuh"
#include "core/backend.h"
#include "kernels.h"

namespace dl::cuda {

constexpr int KB = 4;     // keys a warp scores together (independent shuffle chains)
constexpr int WARPS = 4;  // warps of an attention item, splitting its keys

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

// The 128 threads of an item meet at named barrier `bar` (0 where the item is the whole block).
__device__ __forceinline__ void item_sync(int bar) { asm volatile("bar.sync %0, 128;" ::"r"(bar) : "memory"); }

template <int NI>
struct AttnSmem {
  float m[WARPS], l[WARPS], acc[WARPS][NI * 32];
  int last;
};

// Element d of a head's output at o, and (qo.xq set) its q8 rounding: called by all 32 lanes of
// a warp for 32 consecutive d of one block (head_dim a multiple of 32).
__device__ __forceinline__ void out_put(const AttnQuant& qo, float* o, int d, float v, int lane) {
  o[d] = v;
  if (qo.xq) {
    const int64_t e = (o + d) - qo.base;
    quant_store(v, lane, e, e >> 5, qo.xq, qo.xd, qo.xs);
  }
}

// Merges the splits' partial states of (row z, head h) into the output: run by the split
// that finished last, so its reads go past L1 (__ldcg) to what the other blocks wrote.
__device__ __forceinline__ void combine_splits(const AttnArgs& a, int64_t t, int64_t z, int h, int splits,
                                               const float* __restrict__ part, int tid, const AttnQuant& qo) {
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
  for (int d = tid; d < hd; d += WARPS * 32) {
    float v = 0.f;
    for (int s = 0; s < splits; ++s) {
      const float ms = __ldcg(p + s * (hd + 2));
      if (ms != -INFINITY) v += __ldcg(p + s * (hd + 2) + 2 + d) * expf(ms - M);
    }
    out_put(qo, o, d, v * inv, tid & 31);
  }
}

// Split s of query row t (row slot z) and head h, by 128 threads (tid in [0, 128)). Lane holds
// dims lane + 32 i (i < NI) of q and of its running output; warps take KB keys at a time from
// the split's range. splits == 1 writes the normalized output; else (m, l, acc[hd]) partials to
// `part`, and the split that finishes last (counted in cnt[z][h], left at 0 again) merges them.
// q is read from L2: in the fused layer it was written earlier in the same kernel.
template <int KT, int NI>
__device__ __forceinline__ void attn_item(const AttnArgs& a, int64_t t, int64_t z, int h, int s, int splits,
                                          float* __restrict__ part, int* __restrict__ cnt, int tid, int bar,
                                          AttnSmem<NI>& sm, const AttnQuant& qo = AttnQuant()) {
  if (t >= a.n_tok) return;  // the whole item: a shorter session of a group
  const int warp = tid >> 5, lane = tid & 31;
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
    q[i] = d < hd ? __ldcg(qr + d) : 0.f;
    acc[i] = 0.f;
  }
  float m = -INFINITY, l = 0.f;
  for (int64_t j = j0 + warp * KB; j < j1; j += WARPS * KB) {
    // The round's V values are loaded with its keys: the scores do not gate their reads, so
    // a round waits on the memory once, not twice.
    float sc[KB], vv[KB][NI];
#pragma unroll
    for (int b = 0; b < KB; ++b) {
      float p = 0.f;
      if (j + b < j1) {
        const uint8_t* kr = kv_row(a.kv, koff, j + b);
        const uint8_t* vr = kv_row(a.kv, voff, j + b);
#pragma unroll
        for (int i = 0; i < NI; ++i) {
          const int d = lane + 32 * i;
          if (d < hd) p += q[i] * kv_elem<KT>(kr, d);
          vv[b][i] = d < hd ? kv_elem<KT>(vr, d) : 0.f;
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
#pragma unroll
        for (int i = 0; i < NI; ++i) {
          const int d = lane + 32 * i;
          if (d < hd) acc[i] += p * vv[b][i];
        }
      }
    }
    m = mx;
  }
  // Merge the warps' states.
  if (lane == 0) sm.m[warp] = m, sm.l[warp] = l;
#pragma unroll
  for (int i = 0; i < NI; ++i) sm.acc[warp][lane + 32 * i] = acc[i];
  item_sync(bar);
  float M = -INFINITY;
#pragma unroll
  for (int w = 0; w < WARPS; ++w) M = fmaxf(M, sm.m[w]);
  float f[WARPS], L = 0.f;
#pragma unroll
  for (int w = 0; w < WARPS; ++w) {
    f[w] = M == -INFINITY ? 0.f : expf(sm.m[w] - M);
    L += sm.l[w] * f[w];
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
    for (int d = tid; d < hd; d += WARPS * 32) {
      float v = 0.f;
#pragma unroll
      for (int w = 0; w < WARPS; ++w) v += sm.acc[w][d] * f[w];
      out_put(qo, o, d, v * inv, lane);
    }
    item_sync(bar);  // sm is free for the item's next use
  } else {
    float* p = part + ((z * a.n_heads + h) * splits + s) * (int64_t)(hd + 2);
    if (tid == 0) p[0] = M, p[1] = L;
    for (int d = tid; d < hd; d += WARPS * 32) {
      float v = 0.f;
#pragma unroll
      for (int w = 0; w < WARPS; ++w) v += sm.acc[w][d] * f[w];
      p[2 + d] = v;
    }
    __threadfence();  // this item's partials are visible before it is counted
    item_sync(bar);
    if (tid == 0) {
      int* c = cnt + z * a.n_heads + h;
      const bool last = atomicAdd(c, 1) == splits - 1;
      if (last) *c = 0;
      sm.last = last;
    }
    item_sync(bar);
    const bool last = sm.last;
    item_sync(bar);  // sm is free for the item's next use
    if (!last) return;
    __threadfence();
    combine_splits(a, t, z, h, splits, part, tid, qo);
  }
}

// Elements [e0, e1) of a K (is_v false) or V row at cache row `row`, from src (indexed like
// the row), by nthr threads; q8_0 (e0, e1 multiples of 32): a warp per 32-block, quantized as
// ggml's quantize_row_q8_0 does (d = amax/127, q = round(x/d), d as f16).
__device__ __forceinline__ void kv_store_slice(const KVView& kv, int64_t row, const float* __restrict__ src,
                                               bool is_v, int64_t e0, int64_t e1, int tid, int nthr) {
  uint8_t* dst = const_cast<uint8_t*>(kv_row(kv, is_v ? kv.v_off : kv.k_off, row));
  if (kv.type == KVType::f32) {
    for (int64_t e = e0 + tid; e < e1; e += nthr) reinterpret_cast<float*>(dst)[e] = __ldcg(src + e);
  } else if (kv.type == KVType::f16) {
    for (int64_t e = e0 + tid; e < e1; e += nthr) reinterpret_cast<__half*>(dst)[e] = __float2half_rn(__ldcg(src + e));
  } else {
    const int lane = tid & 31;
    for (int64_t b = e0 / 32 + (tid >> 5); b < e1 / 32; b += nthr >> 5) {
      const float x = __ldcg(src + b * 32 + lane);
      const float amax = warp_max(fabsf(x));
      const float d = amax / 127.0f;
      const float id = d == 0.0f ? 0.0f : 1.0f / d;
      uint8_t* blk = dst + b * 34;
      blk[2 + lane] = (uint8_t)(int8_t)(int)roundf(__fmul_rn(x, id));
      if (lane == 0) *reinterpret_cast<__half*>(blk) = __float2half_rn(d);
    }
  }
}

}  // namespace dl::cuda
