// Paged attention (flash-decoding: online softmax per key split, then a combine) and
// the KV-cache store (f32 / f16 / q8_0 rows through the block table).
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>

#include "common.cuh"
#include "attn.cuh"
#include "rope.cuh"
#include "kernels.h"

namespace dl::cuda {
namespace {

// One block per (split, query head, row z): attn_item with the block's 128 threads.
template <int KT, int NI>
__global__ void __launch_bounds__(WARPS * 32) attn_k(AttnArgs a0, const AttnArgs* __restrict__ dargs, int maxtok,
                                                     int splits, float* __restrict__ part, int* __restrict__ cnt,
                                                     AttnQuant qo) {
  pdl_wait();
  pdl_trigger();
  __shared__ AttnSmem<NI> sm;
  const int64_t z = blockIdx.z;
  // Two calls, not one on a selected struct: with `a = dargs ? dargs[i] : a0`, every session
  // after the first of a group got wrong outputs on the H200 (its args read back right).
  if (dargs) {
    const AttnArgs a = dargs[z / maxtok];
    attn_item<KT, NI>(a, z % maxtok, z, blockIdx.y, blockIdx.x, splits, part, cnt, threadIdx.x, 0, sm, qo);
  } else {
    attn_item<KT, NI>(a0, z, z, blockIdx.y, blockIdx.x, splits, part, cnt, threadIdx.x, 0, sm, qo);
  }
}

// ---- the grouped-query decode kernel (DASLLAMA_CUDA_ATTN_GQA=1) ----
// A block (4 warps) is one item: (row z, GH query heads of one KV head, key split s). Each K / V
// row is read once for the item's GH heads, in 16-byte pieces: the 32 lanes of a warp are 4 key
// slots of 8 lanes, and lane l of a slot holds dims 64 c + 8 l .. + 7 (c < NC, the head's 64-dim
// chunks) of its key's rows and of each query head, so one load instruction brings 4 keys of a
// head of 64 f16 (128 bytes each). A warp takes R such rounds (4 R keys) a batch, their page ids,
// then all their K and V loads, in flight together; the batch's scores then update the warp's
// online softmax once per head. The warps' states merge through shared memory as attn_item's
// do; splits > 1 write attn_item's partial layout (m, l, acc[hd] per row, head and split) and
// the block that finishes last merges them. Arithmetic: f32, attn_item's formulas (each cache
// element decoded as kv_elem does, score * scale or the softcap, expf, the sinks); only the
// order of the float sums differs.
namespace gqa {

constexpr int W = 4;  // warps a block
// The wide block: a one-row step's item unsplit over 16 warps (attn_gqa_wide), so that its keys
// take few batches (each a wait on memory) and no partials, counter or merge by a last block.
constexpr int WW = 16;

// Sub-rounds of 4 keys a warp loads a batch (KT: the KVType's value, NC: the head's 64-dim
// chunks, GH: heads an item): about 32 registers of raw K and V a lane (f16: 8 NC a sub-round,
// f32 16 NC, q8_0 10 NC), half that where the output takes 32 (GH NC = 4; q8_0 from 2), so
// that a block stays within 128 registers a thread, 4 blocks an SM (ptxas -v: no spills but
// f32 at head size 256).
__host__ __device__ constexpr int rounds(int kt, int nc, int gh) {
  const int r = kt == 0 ? (nc == 1 ? 2 : 1) : (nc >= 4 ? 1 : 4 / nc);
  return gh * nc * (kt == 8 ? 2 : 1) >= 4 && r > 1 ? r / 2 : r;
}

// 16 bytes of shared memory, loaded where they are used: a volatile load is not hoisted out of
// the key loop into registers (q lives in shared memory to keep 4 blocks an SM).
__device__ __forceinline__ float4 lds4(const float* p) {
  float4 v;
  const unsigned a = (unsigned)__cvta_generic_to_shared(p);
  asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(a));
  return v;
}

// One lane's share of a cache row (8 NC elements), as loaded.
template <int KT, int NC>
struct Raw;
template <int NC>
struct Raw<0, NC> {
  float4 v[2 * NC];
};
template <int NC>
struct Raw<1, NC> {
  uint4 v[NC];
};
template <int NC>
struct Raw<8, NC> {
  uint32_t d[NC], q[NC][4];  // a 32-block's f16 scale; 8 quants as 4 2-byte words
};

// r: the head's slice of a cache row; sl: the lane in its key slot (0..7).
template <int KT, int NC>
__device__ __forceinline__ void load(const uint8_t* r, int sl, Raw<KT, NC>& o) {
#pragma unroll
  for (int c = 0; c < NC; ++c) {
    const int d0 = 64 * c + 8 * sl;
    if constexpr (KT == 0) {
      const float4* p = reinterpret_cast<const float4*>(r) + d0 / 4;
      o.v[2 * c] = p[0];
      o.v[2 * c + 1] = p[1];
    } else if constexpr (KT == 1) {
      o.v[c] = reinterpret_cast<const uint4*>(r)[d0 / 8];
    } else {  // dims d0..d0+7 lie in 32-block d0 / 32, at quant bytes d0 % 32..
      const uint8_t* b = r + (d0 >> 5) * 34;
      o.d[c] = ld16(b);
#pragma unroll
      for (int i = 0; i < 4; ++i) o.q[c][i] = ld16(b + 2 + (d0 & 31) + 2 * i);
    }
  }
}

// The elements as kv_elem decodes them (f16 exactly; q8_0 as __fmul_rn(q, d)).
template <int KT, int NC>
__device__ __forceinline__ void decode(const Raw<KT, NC>& o, float (&x)[8 * NC]) {
#pragma unroll
  for (int c = 0; c < NC; ++c) {
    if constexpr (KT == 0) {
      const float4 a = o.v[2 * c], b = o.v[2 * c + 1];
      x[8 * c + 0] = a.x, x[8 * c + 1] = a.y, x[8 * c + 2] = a.z, x[8 * c + 3] = a.w;
      x[8 * c + 4] = b.x, x[8 * c + 5] = b.y, x[8 * c + 6] = b.z, x[8 * c + 7] = b.w;
    } else if constexpr (KT == 1) {
      const uint32_t w[4] = {o.v[c].x, o.v[c].y, o.v[c].z, o.v[c].w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        x[8 * c + 2 * i] = h2f((uint16_t)(w[i] & 0xffffu));
        x[8 * c + 2 * i + 1] = h2f((uint16_t)(w[i] >> 16));
      }
    } else {
      const float d = h2f((uint16_t)o.d[c]);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        x[8 * c + 2 * i] = __fmul_rn((float)(int8_t)(o.q[c][i] & 0xffu), d);
        x[8 * c + 2 * i + 1] = __fmul_rn((float)(int8_t)(o.q[c][i] >> 8), d);
      }
    }
  }
}

template <int NC, int GH, int W>
struct Smem {
  static_assert(GH <= W, "a warp a head in the combine");
  float m[W][GH], l[W][GH];
  __align__(16) float acc[W][GH * 64 * NC];
  __align__(16) float q[GH * 64 * NC];  // the item's query heads
  float cm[GH * 64], cl[GH * 64], cw[GH * 64];  // the combine: each split's m, l and weight (<= 64 splits)
  float cM[GH];
  int last;
};

// Item (row t of its session, row slot z, heads hb * GH.., split s) by the block's W warps.
template <int KT, int NC, int GH, int W>
__device__ __forceinline__ void item(const AttnArgs& a, int64_t t, int64_t z, int hb, int s, int splits,
                                     float* __restrict__ part, int* __restrict__ cnt, const AttnQuant& qo,
                                     bool early_kv, Smem<NC, GH, W>& sm) {
  constexpr int HD = 64 * NC, E = 8 * NC, R = rounds(KT, NC, GH), KPB = W * 4 * R;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 3, sl = lane & 7;
  const int h0 = hb * GH, kvh = h0 / (a.n_heads / a.n_kv_heads);
  // The key range and the first batch's page ids: the step's metadata (positions, block tables,
  // the group's args), which the host uploaded before the step; no kernel writes them, so they
  // are read before pdl_wait, while the kernel before finishes.
  const int64_t pos = a.q_pos[t];
  const int64_t hi = min(a.n_kv, pos + 1);
  const int64_t lo = a.window > 0 ? max(int64_t(0), pos - a.window + 1) : 0;
  const int64_t len = max(hi - lo, int64_t(0));
  const int64_t chunk = (len + splits - 1) / splits;
  const int64_t j0 = lo + s * chunk, j1 = min(hi, j0 + chunk);
  const int32_t* __restrict__ pages = a.kv.pages;
  const int shift = a.kv.page_shift;
  const int64_t mask = (int64_t(1) << shift) - 1;
  const size_t head_off = KT == 0 ? (size_t)kvh * HD * 4 : KT == 1 ? (size_t)kvh * HD * 2 : (size_t)kvh * (HD / 32) * 34;
  const uint8_t* kb = a.kv.base + a.kv.k_off + head_off;
  const uint8_t* vb = a.kv.base + a.kv.v_off + head_off;
  // Sub-round r of the batch from jb: keys jb + (r W + warp) 4 + slot; a warp takes part in a
  // batch while its first key is in range (so each batch gives it a finite maximum). Keys past
  // j1 in a sub-round load row j1 - 1 (in range) and score -inf.
  auto key = [&](int64_t jb, int r) { return jb + (int64_t)(r * W + warp) * 4 + g; };
  auto live = [&](int64_t jb, int r) { return jb + (int64_t)(r * W + warp) * 4 < j1; };  // warp-uniform
  int pg[R];
#pragma unroll
  for (int r = 0; r < R; ++r) pg[r] = live(j0, r) ? pages[min(key(j0, r), j1 - 1) >> shift] : 0;
  Raw<KT, NC> kr[R], vr[R];
  auto load_batch = [&](int64_t jb) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
      if (live(jb, r)) {
        const size_t row = (size_t)pg[r] * a.kv.page_bytes + (size_t)(min(key(jb, r), j1 - 1) & mask) * a.kv.row_bytes;
        load<KT, NC>(kb + row, sl, kr[r]);
        load<KT, NC>(vb + row, sl, vr[r]);
      }
    }
  };
  // The kernel before this one stores only the step's new rows, the session's last n_tok; earlier
  // rows were written by kernels that have finished (that kernel waited for them before letting
  // this one start). So a first batch of only such rows loads before pdl_wait, while the kernel
  // before finishes (early_kv: DASLLAMA_CUDA_ATTN_EARLY).
  const bool pre = early_kv && live(j0, 0) && min(j0 + KPB, j1) <= a.n_kv - a.n_tok;
  if (pre) load_batch(j0);
  pdl_wait();
  pdl_trigger();

  for (int i = tid; i < GH * HD; i += W * 32) sm.q[i] = __ldcg(a.q + t * a.q_stride + (int64_t)h0 * HD + i);
  float acc[GH][E], m[GH], l[GH];
#pragma unroll
  for (int h = 0; h < GH; ++h) {
#pragma unroll
    for (int e = 0; e < E; ++e) acc[h][e] = 0.f;
    m[h] = -INFINITY, l[h] = 0.f;
  }
  __syncthreads();  // sm.q
  for (int64_t jb = j0; live(jb, 0); jb += KPB) {
    if (jb != j0 || !pre) load_batch(jb);
    // The next batch's page ids, in flight while this one is scored.
#pragma unroll
    for (int r = 0; r < R; ++r) pg[r] = live(jb + KPB, r) ? pages[min(key(jb + KPB, r), j1 - 1) >> shift] : 0;
    float sc[R][GH];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      if (live(jb, r)) {
        float x[E];
        decode<KT, NC>(kr[r], x);
        const bool in = key(jb, r) < j1;
#pragma unroll
        for (int h = 0; h < GH; ++h) {
          float p = 0.f;
#pragma unroll
          for (int c = 0; c < NC; ++c) {
            const float4 qa = lds4(&sm.q[h * HD + 64 * c + 8 * sl]), qb = lds4(&sm.q[h * HD + 64 * c + 8 * sl + 4]);
            const float* xc = x + 8 * c;
            p += qa.x * xc[0], p += qa.y * xc[1], p += qa.z * xc[2], p += qa.w * xc[3];
            p += qb.x * xc[4], p += qb.y * xc[5], p += qb.z * xc[6], p += qb.w * xc[7];
          }
#pragma unroll
          for (int o = 1; o < 8; o <<= 1) p += __shfl_xor_sync(0xffffffffu, p, o);
          p = a.softcap > 0.f ? a.softcap * tanhf(p * a.scale / a.softcap) : p * a.scale;
          sc[r][h] = in ? p : -INFINITY;
        }
      } else {
#pragma unroll
        for (int h = 0; h < GH; ++h) sc[r][h] = -INFINITY;
      }
    }
#pragma unroll
    for (int h = 0; h < GH; ++h) {
      float mx = sc[0][h];
#pragma unroll
      for (int r = 1; r < R; ++r) mx = fmaxf(mx, sc[r][h]);
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 8));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 16));
      mx = fmaxf(m[h], mx);  // finite: the warp's first key of the batch is in range
      const float corr = expf(m[h] - mx);  // m = -inf before the first batch: 0
      l[h] *= corr;
#pragma unroll
      for (int e = 0; e < E; ++e) acc[h][e] *= corr;
      m[h] = mx;
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
      if (live(jb, r)) {
        float x[E];
        decode<KT, NC>(vr[r], x);
#pragma unroll
        for (int h = 0; h < GH; ++h) {
          const float p = expf(sc[r][h] - m[h]);  // a key past j1: exp(-inf) = 0
          l[h] += p;
#pragma unroll
          for (int e = 0; e < E; ++e) acc[h][e] += p * x[e];
        }
      }
    }
  }
  // The warp's 4 key slots into one state (they share m), then into shared memory.
#pragma unroll
  for (int h = 0; h < GH; ++h) {
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 8);
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 16);
#pragma unroll
    for (int e = 0; e < E; ++e) {
      acc[h][e] += __shfl_xor_sync(0xffffffffu, acc[h][e], 8);
      acc[h][e] += __shfl_xor_sync(0xffffffffu, acc[h][e], 16);
    }
  }
  if (g == 0) {
#pragma unroll
    for (int h = 0; h < GH; ++h)
#pragma unroll
      for (int c = 0; c < NC; ++c) {
        float4* o = reinterpret_cast<float4*>(&sm.acc[warp][h * HD + 64 * c + 8 * sl]);
        o[0] = make_float4(acc[h][8 * c], acc[h][8 * c + 1], acc[h][8 * c + 2], acc[h][8 * c + 3]);
        o[1] = make_float4(acc[h][8 * c + 4], acc[h][8 * c + 5], acc[h][8 * c + 6], acc[h][8 * c + 7]);
      }
  }
  if (lane == 0) {
#pragma unroll
    for (int h = 0; h < GH; ++h) sm.m[warp][h] = m[h], sm.l[warp][h] = l[h];
  }
  __syncthreads();
  // Output element i = (head h, dim d) a thread: a warp takes 32 consecutive dims of one head
  // (HD a multiple of 32), as out_put's rounding needs.
  for (int i = tid; i < GH * HD; i += W * 32) {
    const int h = i / HD, d = i % HD;
    float M = -INFINITY;
#pragma unroll
    for (int w = 0; w < W; ++w) M = fmaxf(M, sm.m[w][h]);
    float f[W], L = 0.f;
#pragma unroll
    for (int w = 0; w < W; ++w) {
      f[w] = M == -INFINITY ? 0.f : expf(sm.m[w][h] - M);
      L += sm.l[w][h] * f[w];
    }
    if (splits == 1) {
      if (a.sinks) {  // the sink joins the denominator: rescale to the joint max
        const float sink = a.sinks[h0 + h], M2 = fmaxf(M, sink);
        const float c = M == -INFINITY ? 0.f : expf(M - M2);
#pragma unroll
        for (int w = 0; w < W; ++w) f[w] *= c;
        L = L * c + expf(sink - M2);
      }
      const float inv = L > 0.f ? 1.f / L : 0.f;
      float v = 0.f;
#pragma unroll
      for (int w = 0; w < W; ++w) v += sm.acc[w][i] * f[w];
      out_put(qo, a.out + t * a.out_stride + (int64_t)(h0 + h) * HD, d, v * inv, lane);
    } else {
      float* p = part + ((z * a.n_heads + h0 + h) * splits + s) * (int64_t)(HD + 2);
      if (d == 0) p[0] = M, p[1] = L;
      float v = 0.f;
#pragma unroll
      for (int w = 0; w < W; ++w) v += sm.acc[w][i] * f[w];
      p[2 + d] = v;
    }
  }
  if (splits == 1) return;
  __threadfence();  // this item's partials are visible before it is counted
  __syncthreads();
  if (tid == 0) {
    int* c = cnt + z * a.n_heads + h0;  // one counter an item: its first head's
    const bool last = atomicAdd(c, 1) == splits - 1;
    if (last) *c = 0;
    sm.last = last;
  }
  __syncthreads();
  if (!sm.last) return;
  __threadfence();
  // The last split merges: each split's (m, l) per head, then the joint max and the splits'
  // weights, then each output element over the splits (combine_splits' arithmetic).
  auto at = [&](int h, int sp) { return part + ((z * a.n_heads + h0 + h) * splits + sp) * (int64_t)(HD + 2); };
  for (int i = tid; i < GH * splits; i += W * 32) {
    const float* p = at(i / splits, i % splits);
    sm.cm[i] = __ldcg(p), sm.cl[i] = __ldcg(p + 1);
  }
  __syncthreads();
  if (warp < GH) {  // warp h: head h's joint max (GH <= W)
    float M = -INFINITY;
    for (int sp = lane; sp < splits; sp += 32) M = fmaxf(M, sm.cm[warp * splits + sp]);
    M = warp_max(M);
    if (a.sinks) M = fmaxf(M, a.sinks[h0 + warp]);
    if (lane == 0) sm.cM[warp] = M;
  }
  __syncthreads();
  for (int i = tid; i < GH * splits; i += W * 32) {
    const float ms = sm.cm[i];
    sm.cw[i] = ms != -INFINITY ? expf(ms - sm.cM[i / splits]) : 0.f;
  }
  __syncthreads();
  for (int i = tid; i < GH * HD; i += W * 32) {
    const int h = i / HD, d = i % HD;
    const float* cw = sm.cw + h * splits;
    const float* cl = sm.cl + h * splits;
    float L = a.sinks ? expf(a.sinks[h0 + h] - sm.cM[h]) : 0.f;
    for (int sp = 0; sp < splits; ++sp) L += cl[sp] * cw[sp];  // a split with m = -inf has l = 0, weight 0
    const float inv = L > 0.f ? 1.f / L : 0.f;
    float v = 0.f;
#pragma unroll 4
    for (int sp = 0; sp < splits; ++sp)
      if (cw[sp] != 0.f) v += __ldcg(at(h, sp) + 2 + d) * cw[sp];
    out_put(qo, a.out + t * a.out_stride + (int64_t)(h0 + h) * HD, d, v * inv, lane);
  }
}

template <int KT, int NC, int GH, int WW>
__global__ void __launch_bounds__(WW * 32, WW == W ? 4 : 1)
    attn_gqa_k(AttnArgs a0, const AttnArgs* __restrict__ dargs, int maxtok, int splits, float* __restrict__ part,
               int* __restrict__ cnt, AttnQuant qo, bool early_kv) {
  __shared__ Smem<NC, GH, WW> sm;
  const int64_t z = blockIdx.z;
  // Two calls, not one on a selected struct (attn_k's lesson). A row slot past its session's
  // rows exits before pdl_wait: it reads nothing an earlier kernel wrote.
  if (dargs) {
    const AttnArgs a = dargs[z / maxtok];
    const int64_t t = z % maxtok;
    if (t >= a.n_tok) return;
    item<KT, NC, GH, WW>(a, t, z, blockIdx.y, blockIdx.x, splits, part, cnt, qo, early_kv, sm);
  } else {
    if (z >= a0.n_tok) return;
    item<KT, NC, GH, WW>(a0, z, z, blockIdx.y, blockIdx.x, splits, part, cnt, qo, early_kv, sm);
  }
}

}  // namespace gqa

__global__ void kv_store_k(KVView kv, int64_t first, const float* __restrict__ k, const float* __restrict__ v,
                           int64_t src_stride, int64_t dim) {
  pdl_wait();
  pdl_trigger();
  const bool is_v = blockIdx.y == 1;
  kv_store_slice(kv, first + blockIdx.x, (is_v ? v : k) + blockIdx.x * src_stride, is_v, 0, dim, threadIdx.x,
                 blockDim.x);
}

// Several sessions' stores in one launch: descriptor blockIdx.z, row blockIdx.x.
__global__ void kv_store_group_k(const KVStoreDesc* __restrict__ d, int64_t src_stride, int64_t dim) {
  pdl_wait();
  pdl_trigger();
  const KVStoreDesc& e = d[blockIdx.z];
  if ((int64_t)blockIdx.x >= e.n) return;
  const KVView kv = e.kv;
  const bool is_v = blockIdx.y == 1;
  kv_store_slice(kv, e.first + blockIdx.x, (is_v ? e.v : e.k) + blockIdx.x * src_stride, is_v, 0, dim, threadIdx.x,
                 blockDim.x);
}

// rope2 then kv_store_group in one launch: the K block of (session, row) first turns its
// token's Q and K heads (rope_token; every token is one session's row), then stores the K row
// it just wrote (the block's own writes, visible after the barrier); V blocks store V. The
// same arithmetic as the two launches, so the same bits.
__global__ void rope_store_group_k(RopeStore r, const KVStoreDesc* __restrict__ d, int64_t src_stride, int64_t dim) {
  pdl_wait();
  pdl_trigger();
  const KVStoreDesc& e = d[blockIdx.z];
  if ((int64_t)blockIdx.x >= e.n) return;
  const bool is_v = blockIdx.y == 1;
  if (!is_v) {
    __shared__ float cs[2][kRopeMaxHalf];
    const int64_t t = (e.k - r.x2) / r.stride2 + blockIdx.x;
    rope_token(r.x, r.stride, r.n_heads, r.x2, r.stride2, r.n_heads2, r.head_dim, t, r.pos, r.p, cs);
    __syncthreads();
  }
  kv_store_slice(e.kv, e.first + blockIdx.x, (is_v ? e.v : e.k) + blockIdx.x * src_stride, is_v, 0, dim, threadIdx.x,
                 blockDim.x);
}

template <int KT>
void launch_kt(const AttnArgs& a, const AttnArgs* dargs, int maxtok, int64_t rows, int splits, float* part, int* cnt,
               cudaStream_t st, const AttnQuant& qo) {
  const dim3 grid((unsigned)splits, (unsigned)a.n_heads, (unsigned)rows);
  if (a.head_dim <= 64)
    launch(attn_k<KT, 2>, grid, WARPS * 32, 0, st, a, dargs, maxtok, splits, part, cnt, qo);
  else if (a.head_dim <= 128)
    launch(attn_k<KT, 4>, grid, WARPS * 32, 0, st, a, dargs, maxtok, splits, part, cnt, qo);
  else if (a.head_dim <= 256)
    launch(attn_k<KT, 8>, grid, WARPS * 32, 0, st, a, dargs, maxtok, splits, part, cnt, qo);
  else  // Gemma-4's global layers (512): every row here, flash_fits stops at 256
    launch(attn_k<KT, 16>, grid, WARPS * 32, 0, st, a, dargs, maxtok, splits, part, cnt, qo);
}

template <int KT, int NC, int GH>
void launch_gqa3(const AttnArgs& a, const AttnArgs* dargs, int maxtok, int64_t rows, int splits, float* part, int* cnt,
                 cudaStream_t st, const AttnQuant& qo) {
  const dim3 grid((unsigned)splits, (unsigned)(a.n_heads / GH), (unsigned)rows);
  const char* e = std::getenv("DASLLAMA_CUDA_ATTN_EARLY");  // read at each launch (ab_cuda.py)
  const bool early_kv = !(e && std::strcmp(e, "0") == 0);
  if (attn_gqa_on_wide(rows, splits))
    launch(gqa::attn_gqa_k<KT, NC, GH, gqa::WW>, grid, gqa::WW * 32, 0, st, a, dargs, maxtok, splits, part, cnt, qo,
           early_kv);
  else
    launch(gqa::attn_gqa_k<KT, NC, GH, gqa::W>, grid, gqa::W * 32, 0, st, a, dargs, maxtok, splits, part, cnt, qo,
           early_kv);
}

template <int KT>
void launch_gqa(const AttnArgs& a, const AttnArgs* dargs, int maxtok, int64_t rows, int splits, float* part, int* cnt,
                cudaStream_t st, const AttnQuant& qo, int gh) {
  if (a.head_dim == 64) {
    if (gh == 4) launch_gqa3<KT, 1, 4>(a, dargs, maxtok, rows, splits, part, cnt, st, qo);
    else if (gh == 2) launch_gqa3<KT, 1, 2>(a, dargs, maxtok, rows, splits, part, cnt, st, qo);
    else launch_gqa3<KT, 1, 1>(a, dargs, maxtok, rows, splits, part, cnt, st, qo);
  } else if (a.head_dim == 128) {
    if (gh == 2) launch_gqa3<KT, 2, 2>(a, dargs, maxtok, rows, splits, part, cnt, st, qo);
    else launch_gqa3<KT, 2, 1>(a, dargs, maxtok, rows, splits, part, cnt, st, qo);
  } else {
    launch_gqa3<KT, 4, 1>(a, dargs, maxtok, rows, splits, part, cnt, st, qo);
  }
}

void launch_attn(const AttnArgs& a, const AttnArgs* dargs, int maxtok, int64_t rows, int splits, float* scratch,
                 int* cnt, cudaStream_t st, const AttnQuant& qo = AttnQuant(), bool use_gqa = false) {
  if (qo.xq && a.head_dim % 32 != 0) throw Error("cuda attention: rounding the output needs head_dim % 32 == 0");
  if (splits > 1 && !cnt) throw Error("cuda attention: split partials need their counters");
  if (use_gqa) {
    const int gh = attn_gqa_heads(a);
    if (gh == 0) throw Error("cuda attention: the grouped-query kernel does not take this shape");
    if (splits < 1 || splits > 64) throw Error("cuda attention: the grouped-query kernel takes 1 to 64 splits");
    switch (a.kv.type) {
      case KVType::f32: launch_gqa<0>(a, dargs, maxtok, rows, splits, scratch, cnt, st, qo, gh); break;
      case KVType::f16: launch_gqa<1>(a, dargs, maxtok, rows, splits, scratch, cnt, st, qo, gh); break;
      default: launch_gqa<8>(a, dargs, maxtok, rows, splits, scratch, cnt, st, qo, gh); break;
    }
    check_launch("attention (grouped-query)");
    return;
  }
  switch (a.kv.type) {
    case KVType::f32: launch_kt<0>(a, dargs, maxtok, rows, splits, scratch, cnt, st, qo); break;
    case KVType::f16: launch_kt<1>(a, dargs, maxtok, rows, splits, scratch, cnt, st, qo); break;
    case KVType::q8_0: launch_kt<8>(a, dargs, maxtok, rows, splits, scratch, cnt, st, qo); break;
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

bool attn_gqa_on() {  // on by default (H200, Llama-1B Q8_0 B = 4 / 16: +1.6% / +2.9%); 0 turns it off
  const char* e = std::getenv("DASLLAMA_CUDA_ATTN_GQA");
  return !(e && std::strcmp(e, "0") == 0);
}

int attn_gqa_heads(const AttnArgs& a) {
  if (a.head_dim != 64 && a.head_dim != 128 && a.head_dim != 256) return 0;
  if (a.n_heads <= 0 || a.n_kv_heads <= 0 || a.n_heads % a.n_kv_heads != 0) return 0;
  if (a.kv.type != KVType::f32 && a.kv.type != KVType::f16 && a.kv.type != KVType::q8_0) return 0;
  // 16-byte loads of f32 / f16 rows; q8_0's 34-byte blocks are read in 2-byte words.
  const size_t align = a.kv.type == KVType::q8_0 ? 2 : 16;
  if (((size_t)(uintptr_t)a.kv.base | a.kv.page_bytes | a.kv.k_off | a.kv.v_off | a.kv.row_bytes) % align != 0) return 0;
  const int group = a.n_heads / a.n_kv_heads, chunks = a.head_dim / 64;
  for (int gh = 4; gh > 1; gh /= 2)  // q and the output of GH heads in 64 registers a lane
    if (group % gh == 0 && gh * chunks <= 4) return gh;
  return 1;
}

// Default 2: H100, Llama-1B tg256 (contexts to ~270 keys), 0 / 2 / 4: Q8_0 1,105 / 1,138 /
// 1,136 t/s, Q4_0 1,401 / 1,452 / 1,452, F16 864 / 886 / 885. Longer contexts keep the splits
// (a block walks its batches one wait after another; not timed past these contexts).
int attn_gqa_wide() {
  const char* e = std::getenv("DASLLAMA_CUDA_ATTN_WIDE");  // read at each launch (ab_cuda.py)
  return e && *e ? std::max(0, std::atoi(e)) : 2;
}

// (attn_gqa_splits left such an item whole.)
bool attn_gqa_on_wide(int64_t rows, int splits) { return rows == 1 && splits == 1 && attn_gqa_wide() > 0; }

int attn_gqa_splits(int64_t rows, const AttnArgs& a, int64_t n_kv, int n_sm) {
  const char* e = std::getenv("DASLLAMA_CUDA_ATTN_GQA_SPLITS");  // A/B: a forced split count
  if (e && std::atoi(e) > 0) return std::min(std::atoi(e), 64);
  const int gh = std::max(1, attn_gqa_heads(a)), chunks = std::max(1, a.head_dim / 64);
  const int64_t per_batch = gqa::W * 4 * gqa::rounds((int)a.kv.type, chunks, gh);  // keys a block takes a batch
  const int64_t keys = a.window > 0 ? std::min<int64_t>(n_kv, a.window) : n_kv;
  // A one-row step whose keys fit attn_gqa_wide() batches of the wide block: one split, on it.
  if (rows == 1 && keys <= (int64_t)attn_gqa_wide() * per_batch * (gqa::WW / gqa::W)) return 1;
  // About one wave of blocks (4 an SM: 128 registers a thread), and no split shorter than a
  // batch: a block's batch of keys costs one wait on the memory, a split one more write and a
  // merge.
  const int64_t items = std::max<int64_t>(1, rows * (a.n_heads / gh));
  const int64_t want = std::max<int64_t>(1, 4 * (int64_t)n_sm / items);
  // A step of several rows (batched sessions) keeps at least MINB batches a split (default 4):
  // its blocks are many already, and a split's partial and merge cost more than the keys it
  // takes off a block. H100, Llama-1B Q8_0 B = 4 at contexts 17-82: one batch a split 3,304 t/s,
  // one split 3,454; a one-row step loses with fewer splits (tg256 1,047 -> 948 with one).
  const char* mb = std::getenv("DASLLAMA_CUDA_ATTN_GQA_MINB");  // read at each step (ab_cuda.py)
  const int64_t min_batches = rows > 1 ? (mb && std::atoi(mb) > 0 ? std::min(std::atoi(mb), 64) : 4) : 1;
  int64_t cap = 1;
  while (cap * per_batch * min_batches < keys && cap < 64) cap *= 2;
  return (int)std::min<int64_t>({want, cap, 64});
}

size_t attn_scratch_floats(const AttnArgs& a, int splits) {
  return splits <= 1 ? 0 : (size_t)a.n_tok * a.n_heads * splits * (a.head_dim + 2);
}

void attn_check(const AttnArgs& a) {
  if (a.n_tok <= 0 || a.n_heads <= 0) return;
  if (a.n_kv_heads <= 0 || a.n_heads % a.n_kv_heads != 0)
    throw Error("cuda attention: n_heads " + std::to_string(a.n_heads) + " is not a multiple of n_kv_heads " +
                std::to_string(a.n_kv_heads));
  if (a.head_dim <= 0 || a.head_dim > 512)
    throw UnsupportedModelError("cuda attention: head_dim " + std::to_string(a.head_dim) + " (at most 512)");
  if (a.kv.type == KVType::q8_0 && a.head_dim % 32 != 0)
    throw UnsupportedModelError("cuda attention: a q8_0 cache needs head_dim a multiple of 32, not " +
                                std::to_string(a.head_dim));
  if (a.n_tok > 65535) throw Error("cuda attention: more than 65535 query rows in one call");
  if (a.kv.type != KVType::f32 && a.kv.type != KVType::f16 && a.kv.type != KVType::q8_0)
    throw UnsupportedModelError("cuda attention: unknown KV type");
}

void attention(const AttnArgs& a, int splits, float* scratch, int* counters, cudaStream_t st, bool gqa) {
  attn_check(a);
  if (a.n_tok <= 0 || a.n_heads <= 0) return;
  launch_attn(a, nullptr, 1, a.n_tok, splits, scratch, counters, st, AttnQuant(), gqa);
}

void attention_group(const AttnArgs& shape, const AttnArgs* dargs, int count, int maxtok, int splits, float* scratch,
                     int* counters, cudaStream_t st, const AttnQuant& qo, bool gqa) {
  if (count <= 0 || maxtok <= 0 || shape.n_heads <= 0) return;
  launch_attn(shape, dargs, maxtok, (int64_t)count * maxtok, splits, scratch, counters, st, qo, gqa);
}

void rope_store_group(const RopeStore& r, const KVStoreDesc* d, int count, int64_t max_n, int64_t src_stride,
                      int64_t dim, cudaStream_t st) {
  if (count <= 0 || max_n <= 0) return;
  if (r.p.n_rot / 2 > kRopeMaxHalf) throw Error("cuda rope_store: rotary width past the one-block kernel's");
  launch(rope_store_group_k, dim3((unsigned)max_n, 2, (unsigned)count), 256, 0, st, r, d, src_stride, dim);
  check_launch("rope + kv_store group");
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
