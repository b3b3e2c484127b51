// Paged attention (flash-decoding: online softmax per key split, then a combine) and
// the KV-cache store (f32 / f16 / q8_0 rows through the block table).
#include <algorithm>
#include <cmath>
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

void launch_attn(const AttnArgs& a, const AttnArgs* dargs, int maxtok, int64_t rows, int splits, float* scratch,
                 int* cnt, cudaStream_t st, const AttnQuant& qo = AttnQuant()) {
  if (qo.xq && a.head_dim % 32 != 0) throw Error("cuda attention: rounding the output needs head_dim % 32 == 0");
  if (splits > 1 && !cnt) throw Error("cuda attention: split partials need their counters");
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

void attention(const AttnArgs& a, int splits, float* scratch, int* counters, cudaStream_t st) {
  attn_check(a);
  if (a.n_tok <= 0 || a.n_heads <= 0) return;
  launch_attn(a, nullptr, 1, a.n_tok, splits, scratch, counters, st);
}

void attention_group(const AttnArgs& shape, const AttnArgs* dargs, int count, int maxtok, int splits, float* scratch,
                     int* counters, cudaStream_t st, const AttnQuant& qo) {
  if (count <= 0 || maxtok <= 0 || shape.n_heads <= 0) return;
  launch_attn(shape, dargs, maxtok, (int64_t)count * maxtok, splits, scratch, counters, st, qo);
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
