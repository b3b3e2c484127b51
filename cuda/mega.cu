// A decode step's chain of dense layers (one token, q8 mode) as one persistent kernel.
//
// Op by op, a Llama-1B step is ~135 kernels whose each is a launch, one trip to memory and a
// reduction (0.96 ms of kernels for 0.31 ms of weight bytes on the H200), and the ninth
// session's one-kernel layer met at grid-wide barriers that cost more than the launches.
// Here nothing waits for the whole grid, and the weights never wait for the activations:
//  - The host cuts every op of every layer into small tasks (16 rows of Q/K/V or O, 8 + 8 of
//    gate and up, a few of down; a head's key split of attention) and deals them to the
//    blocks (one an SM) in op order.
//  - In each block one loader thread copies its tasks' weight rows into a ring of shared
//    memory slots (cp.async.bulk with an mbarrier a slot), as far ahead as the ring allows,
//    whatever the activations' state: the memory streams while the math waits.
//  - Eight compute warps take the tasks in order, a task a warp. A task waits only for the
//    op its input comes from (a counter of groups ready), does its rows' dot products on
//    the slot's rows, and writes its outputs. Whoever completes a group (a head's rows, 32
//    output rows, a head's splits) does that group's next small step in the same warp: rope
//    and KV store, attention's merge, the residual rows' q8 rounding with the next norm's
//    weights, the GLU's rounding. So no op waits for more than its own input, and there are
//    no launches between the layers.
// The norms: the rows' rounder writes q8 blocks of x * w and the block's sum of squares; a
// consumer scales its dot products by 1 / rms from those sums. The sums therefore run in
// another order than the op-by-op path's (not its bits; tests/test_cuda.py compares the two
// within the bar).
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "act.cuh"
#include "attn.cuh"
#include "common.cuh"
#include "dequant.cuh"
#include "kernels.h"
#include "mega.h"
#include "rope.cuh"

namespace dl::cuda {
namespace {

constexpr int NW = 8;               // compute warps
constexpr int NT = (NW + 1) * 32;   // plus the loader's warp
constexpr int kMaxSlots = 24;
constexpr int R_IN = 16;            // rows of a Q/K/V or O task
constexpr int R_GU = 8;             // rows of gate and of up in a GLU task
enum Kind : uint32_t { K_PRE = 0, K_QKV, K_ATT, K_O, K_GU, K_DN };
enum Ready : int { R_XA = 0, R_QKV, R_ATT, R_XB, R_H, R_N };

__host__ __device__ inline uint32_t task_word(uint32_t kind, uint32_t layer, uint32_t idx) {
  return kind << 29 | layer << 20 | idx;
}

// A q8 row of `cols`: quants, block scales, block quant sums, and (norm inputs) the blocks'
// sums of squares of the unweighted values.
struct Q8Row {
  int8_t* q;
  float* d;
  int32_t* s;
  float* ss;
};
__host__ __device__ inline size_t q8_row_bytes(int64_t cols) { return (size_t)cols + (size_t)cols / 32 * 12; }
__device__ __forceinline__ Q8Row q8_row(uint8_t* b, int cols) {
  return {reinterpret_cast<int8_t*>(b), reinterpret_cast<float*>(b + cols),
          reinterpret_cast<int32_t*>(b + cols + cols / 32 * 4), reinterpret_cast<float*>(b + cols + cols / 32 * 8)};
}

// ---- counters (global) ----
// The ready counters count groups an op has finished this step (reset by the grid's last
// block); the group counters count a group's arrivals (reset by the group's last arrival).
struct Counters {
  unsigned* ready;  // [n_layers * R_N + 1]: the last one counts the blocks that are done
  unsigned* group;  // [n_layers * per_layer]
  int per_layer, o_head, o_att, o_o, o_h, o_dn;
};
__device__ __forceinline__ Counters counters(const MegaArgs& A) {
  Counters c;
  c.ready = A.cnt;
  const int nr = (A.n_layers * R_N + 1 + 31) & ~31;
  c.group = A.cnt + nr;
  c.o_head = 0;
  c.o_att = A.s.n_heads + 2 * A.s.n_kv_heads;
  c.o_o = c.o_att + A.s.n_heads;
  c.o_h = c.o_o + A.s.dim / 32;
  c.o_dn = c.o_h + A.s.ffn / 32;
  c.per_layer = c.o_dn + A.s.dim / 32;
  return c;
}

__device__ __forceinline__ void fence_gpu() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }
// How a warp publishes and sees groups: a fence then a relaxed atomic, or (rel) the atomics'
// own release / acquire semantics (DASLLAMA_CUDA_MEGA_REL=1); fc counts lane 0's cycles in them
// for DASLLAMA_CUDA_MEGA_TRACE's profile.
struct Sync {
  long long fc = 0;
  bool rel = false;
};
// After the warp's writes: one more group of this op is ready.
__device__ __forceinline__ void signal(unsigned* c, int lane, Sync& y) {
  __syncwarp();
  if (lane == 0) {
    const long long t = clock64();
    if (y.rel) {
      asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(c) : "memory");
    } else {
      fence_gpu();
      atomicAdd(c, 1u);
    }
    y.fc += clock64() - t;
  }
}
// This warp's arrival at a group of n; true (on every lane) for the last, which then sees what
// the others wrote (and leaves the counter at 0 for the next step).
__device__ __forceinline__ bool arrive_last(unsigned* c, unsigned n, int lane, Sync& y) {
  __syncwarp();
  unsigned last = 0;
  if (lane == 0) {
    const long long t = clock64();
    unsigned old;
    if (y.rel) {
      asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(old) : "l"(c) : "memory");
    } else {
      fence_gpu();
      old = atomicAdd(c, 1u);
    }
    last = old == n - 1;
    if (last) {
      *c = 0;
      if (!y.rel) fence_gpu();
    }
    y.fc += clock64() - t;
  }
  last = __shfl_sync(0xffffffffu, last, 0);
  __syncwarp();
  return last != 0;
}
__device__ __forceinline__ void wait_ready(const unsigned* c, unsigned target, int lane, bool rel) {
  if (lane == 0) {
    unsigned v;
    for (;;) {
      if (rel) asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(c) : "memory");
      else asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(c) : "memory");
      if (v >= target) break;
      __nanosleep(32);
    }
    if (!rel) fence_gpu();
  }
  __syncwarp();
}

// ---- shared-memory pipeline (sm_90) ----
__device__ __forceinline__ uint32_t sa(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void mbar_init(uint64_t* b, unsigned n) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(sa(b)), "r"(n) : "memory");
}
__device__ __forceinline__ void mbar_expect(uint64_t* b, unsigned tx) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(sa(b)), "r"(tx) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* b) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(sa(b)) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* b, unsigned parity) {
  uint32_t done;
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(sa(b)), "r"(parity)
        : "memory");
  } while (!done);
}
__device__ __forceinline__ void bulk_load(void* dst, const void* src, unsigned bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(sa(dst)),
               "l"(src), "r"(bytes), "r"(sa(bar))
               : "memory");
}

// ---- the pieces of a task ----
// A 16-byte unit's int8 dot product (the arithmetic of gemv_q8.cuh's gemv_q8_block, which keeps
// its own copy as the H200 last ran it) with the token's quants: 16 q8_0 weights against 16 of x,
// or a whole q4_0 block (the low nibbles against x's first 16, the high against the next 16;
// the caller subtracts 8 times x's quant sum).
__device__ __forceinline__ int dot_q8_unit(const uint4& w, const int4& xa) {
  int s = __dp4a((int)w.x, xa.x, 0);
  s = __dp4a((int)w.y, xa.y, s);
  s = __dp4a((int)w.z, xa.z, s);
  return __dp4a((int)w.w, xa.w, s);
}
__device__ __forceinline__ int dot_q4_unit(const uint4& w, const int4& xa, const int4& xb) {
  int s = __dp4a((int)(w.x & 0x0F0F0F0Fu), xa.x, 0);
  s = __dp4a((int)(w.y & 0x0F0F0F0Fu), xa.y, s);
  s = __dp4a((int)(w.z & 0x0F0F0F0Fu), xa.z, s);
  s = __dp4a((int)(w.w & 0x0F0F0F0Fu), xa.w, s);
  s = __dp4a((int)((w.x >> 4) & 0x0F0F0F0Fu), xb.x, s);
  s = __dp4a((int)((w.y >> 4) & 0x0F0F0F0Fu), xb.y, s);
  s = __dp4a((int)((w.z >> 4) & 0x0F0F0F0Fu), xb.z, s);
  return __dp4a((int)((w.w >> 4) & 0x0F0F0F0Fu), xb.w, s);
}

// acc[r] = the dot product of tile row r (shared memory, rb apart, the split layout) with the
// q8 row x (global, written in this kernel: read past L1), on every lane.
template <uint32_t T, int NR>
__device__ __forceinline__ void warp_dot(const uint8_t* tile, uint32_t rb, int cols, const uint8_t* x, int lane,
                                         float (&acc)[NR]) {
  const int8_t* xq = reinterpret_cast<const int8_t*>(x);
  const float* xd = reinterpret_cast<const float*>(x + cols);
#pragma unroll
  for (int r = 0; r < NR; ++r) acc[r] = 0.f;
  if constexpr (T == T_Q8_0S) {
    const int nu = cols / 16;
#pragma unroll 2
    for (int u = lane; u < nu; u += 32) {
      const int4 xa = __ldcg(reinterpret_cast<const int4*>(xq + u * 16));
      const float dx = __ldcg(xd + (u >> 1));
#pragma unroll
      for (int r = 0; r < NR; ++r) {
        const uint8_t* row = tile + r * rb;
        const uint4 w = *reinterpret_cast<const uint4*>(row + u * 16);
        const float dw = h2f(*reinterpret_cast<const uint16_t*>(row + cols + (u >> 1) * 2));
        acc[r] += (float)dot_q8_unit(w, xa) * __fmul_rn(dw, dx);
      }
    }
  } else {  // T_Q4_0S: a 16-byte unit is a block of 32
    const int32_t* xs = reinterpret_cast<const int32_t*>(x + cols + cols / 32 * 4);
    const int nb = cols / 32;
#pragma unroll 2
    for (int u = lane; u < nb; u += 32) {
      const int4 xa = __ldcg(reinterpret_cast<const int4*>(xq + u * 32)),
                 xb = __ldcg(reinterpret_cast<const int4*>(xq + u * 32) + 1);
      const float dx = __ldcg(xd + u);
      const int off = 8 * __ldcg(xs + u);
#pragma unroll
      for (int r = 0; r < NR; ++r) {
        const uint8_t* row = tile + r * rb;
        const uint4 w = *reinterpret_cast<const uint4*>(row + u * 16);
        const float dw = h2f(*reinterpret_cast<const uint16_t*>(row + cols / 2 + u * 2));
        acc[r] += (float)(dot_q4_unit(w, xa, xb) - off) * __fmul_rn(dw, dx);
      }
    }
  }
#pragma unroll
  for (int r = 0; r < NR; ++r) acc[r] = warp_sum(acc[r]);
}
// acc[lane] for lane < NR (a register array is not indexed by a variable).
template <int NR>
__device__ __forceinline__ float pick(const float (&acc)[NR], int lane) {
  float v = 0.f;
#pragma unroll
  for (int r = 0; r < NR; ++r)
    if (lane == r) v = acc[r];
  return v;
}
// 1 / rms of the row whose blocks' sums of squares the q8 row x carries.
__device__ __forceinline__ float inv_rms(const uint8_t* x, int cols, float eps, int lane) {
  const float* ss = reinterpret_cast<const float*>(x + cols + cols / 32 * 8);
  float t = 0.f;
  for (int g = lane; g < cols / 32; g += 32) t += __ldcg(ss + g);
  t = warp_sum(t);
  return 1.f / sqrtf(t / cols + eps);
}
// Block g of src (global, read past L1) into the q8 row xb, times nw where given; its sum of
// squares (of src's values) beside it.
__device__ __forceinline__ void round_group(const float* src, const float* nw, int g, uint8_t* xb, int cols,
                                            int lane) {
  const int i = g * 32 + lane;
  const float val = __ldcg(src + i);
  const float v = nw ? __fmul_rn(val, nw[i]) : val;
  const Q8Row q = q8_row(xb, cols);
  quant_store(v, lane, i, g, q.q, q.d, q.s);
  const float ss = warp_sum(val * val);
  if (lane == 0) q.ss[g] = ss;
}
// Rope of one head (global, in place) by a warp.
__device__ __forceinline__ void rope_head(float* v, const RopeParams& p, int64_t pos, int lane) {
  const int half = p.n_rot / 2;
  for (int i = lane; i < half; i += 32) {
    float c, s;
    rope_cs(p, pos, i, &c, &s);
    const int i0 = p.neox ? i : 2 * i, i1 = p.neox ? i + half : 2 * i + 1;
    float o0, o1;
    rope_rot(__ldcg(v + i0), __ldcg(v + i1), c, s, &o0, &o1);
    v[i0] = o0, v[i1] = o1;
  }
  __syncwarp();
}

template <int KT>
__device__ __forceinline__ float kv_ld(const uint8_t* r, int d) {
  if constexpr (KT == 0) return __ldcg(reinterpret_cast<const float*>(r) + d);
  else if constexpr (KT == 1) return h2f(__ldcg(reinterpret_cast<const unsigned short*>(r) + d));
  else {
    const uint8_t* b = r + (d >> 5) * 34;
    return __fmul_rn((float)(signed char)__ldcg(reinterpret_cast<const signed char*>(b + 2 + (d & 31))),
                     h2f(__ldcg(reinterpret_cast<const unsigned short*>(b))));
  }
}

// Split s of head h's attention (one query row), by a warp: partial (m, l, acc) into part;
// the head's last split merges them into the O projection's q8 input. KB keys' loads a round.
template <int KT, int NI, int KB = cuda::KB>
__device__ void att_task(const MegaArgs& A, const AttnArgs& a, int h, int s, unsigned* hcnt, unsigned* ready,
                         int lane, Sync& fc) {
  const int hd = A.s.head_dim, S = A.splits;
  const int kvh = h / (A.s.n_heads / A.s.n_kv_heads);
  const int64_t pos = a.q_pos[0];
  const int64_t hi = min(a.n_kv, pos + 1);
  const int64_t lo = a.window > 0 ? max(int64_t(0), pos - a.window + 1) : 0;
  const int64_t len = max(hi - lo, int64_t(0));
  const int64_t chunk = (len + S - 1) / S;
  const int64_t j0 = lo + s * chunk, j1 = min(hi, j0 + chunk);
  const size_t head_off = KT == 0 ? (size_t)kvh * hd * 4 : KT == 1 ? (size_t)kvh * hd * 2 : (size_t)kvh * (hd / 32) * 34;
  const size_t koff = a.kv.k_off + head_off, voff = a.kv.v_off + head_off;
  float q[NI], acc[NI];
#pragma unroll
  for (int i = 0; i < NI; ++i) q[i] = __ldcg(A.q + (int64_t)h * hd + lane + 32 * i), acc[i] = 0.f;
  float m = -INFINITY, l = 0.f;
  for (int64_t j = j0; j < j1; j += KB) {
    float sc[KB], vv[KB][NI];
#pragma unroll
    for (int b = 0; b < KB; ++b) {
      float p = 0.f;
      if (j + b < j1) {
        const uint8_t* kr = kv_row(a.kv, koff, j + b);
        const uint8_t* vr = kv_row(a.kv, voff, j + b);
#pragma unroll
        for (int i = 0; i < NI; ++i) {
          p += q[i] * kv_ld<KT>(kr, lane + 32 * i);
          vv[b][i] = kv_ld<KT>(vr, lane + 32 * i);
        }
      } else {
#pragma unroll
        for (int i = 0; i < NI; ++i) vv[b][i] = 0.f;
      }
      sc[b] = p;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
#pragma unroll
      for (int b = 0; b < KB; ++b) sc[b] += __shfl_xor_sync(0xffffffffu, sc[b], o);
    float mx = m;
#pragma unroll
    for (int b = 0; b < KB; ++b)
      if (j + b < j1) {
        sc[b] = a.softcap > 0.f ? a.softcap * tanhf(sc[b] * a.scale / a.softcap) : sc[b] * a.scale;
        mx = fmaxf(mx, sc[b]);
      }
    const float corr = expf(m - mx);
    l *= corr;
#pragma unroll
    for (int i = 0; i < NI; ++i) acc[i] *= corr;
#pragma unroll
    for (int b = 0; b < KB; ++b)
      if (j + b < j1) {
        const float p = expf(sc[b] - mx);
        l += p;
#pragma unroll
        for (int i = 0; i < NI; ++i) acc[i] += p * vv[b][i];
      }
    m = mx;
  }
  float* p = A.part + ((int64_t)h * S + s) * (hd + 2);
  if (lane == 0) p[0] = m, p[1] = l;
#pragma unroll
  for (int i = 0; i < NI; ++i) p[2 + lane + 32 * i] = acc[i];
  if (!arrive_last(hcnt + h, (unsigned)S, lane, fc)) return;
  const float* p0 = A.part + (int64_t)h * S * (hd + 2);
  float M = -INFINITY;
  for (int t = 0; t < S; ++t) M = fmaxf(M, __ldcg(p0 + t * (hd + 2)));
  float L = 0.f, o[NI];
#pragma unroll
  for (int i = 0; i < NI; ++i) o[i] = 0.f;
  for (int t = 0; t < S; ++t) {
    const float mt = __ldcg(p0 + t * (hd + 2));
    if (mt == -INFINITY) continue;
    const float f = expf(mt - M);
    L += __ldcg(p0 + t * (hd + 2) + 1) * f;
#pragma unroll
    for (int i = 0; i < NI; ++i) o[i] += __ldcg(p0 + t * (hd + 2) + 2 + lane + 32 * i) * f;
  }
  const float inv = L > 0.f ? 1.f / L : 0.f;
  const Q8Row aq = q8_row(A.aq, A.s.q_dim);
#pragma unroll
  for (int i = 0; i < NI; ++i) {
    const int e = h * hd + lane + 32 * i;
    quant_store(o[i] * inv, lane, e, e >> 5, aq.q, aq.d, aq.s);
  }
  signal(ready, lane, fc);
}

template <uint32_t T, int NR>
__device__ __forceinline__ void down_rows(const MegaArgs& A, const uint8_t* tile, int r0, int lane) {
  float acc[NR];
  warp_dot<T, NR>(tile, A.rb_d, A.s.ffn, A.hq, lane, acc);
  const float y = pick<NR>(acc, lane);
  if (lane < NR) A.x[r0 + lane] = __ldcg(A.x + r0 + lane) + y;
}

// The weight rows task w reads (up to two spans of global memory, to lie back to back in its
// slot); false for a task without weights.
__device__ __forceinline__ bool task_rows(const MegaArgs& A, const uint8_t* const* wl, uint32_t w,
                                          const uint8_t* (&src)[2], unsigned (&bytes)[2]) {
  const uint32_t kind = w >> 29, l = (w >> 20) & 511, idx = w & 0xFFFFF;
  const uint8_t* const* lw = wl + l * 7;
  const MegaShape& S = A.s;
  bytes[1] = 0, src[1] = nullptr;
  if (kind == K_QKV) {
    int r0 = (int)idx * R_IN, m = 0;
    if (r0 >= S.q_dim + S.kv_dim) m = 2, r0 -= S.q_dim + S.kv_dim;
    else if (r0 >= S.q_dim) m = 1, r0 -= S.q_dim;
    src[0] = lw[m] + (size_t)r0 * A.rb_in, bytes[0] = R_IN * A.rb_in;
  } else if (kind == K_O) {
    src[0] = lw[3] + (size_t)idx * R_IN * A.rb_o, bytes[0] = R_IN * A.rb_o;
  } else if (kind == K_GU) {
    const size_t off = (size_t)idx * R_GU * A.rb_in;
    src[0] = lw[4] + off, src[1] = lw[5] + off, bytes[0] = bytes[1] = R_GU * A.rb_in;
  } else if (kind == K_DN) {
    src[0] = lw[6] + (size_t)idx * A.r_dn * A.rb_d, bytes[0] = A.r_dn * A.rb_d;
  } else {
    return false;
  }
  return true;
}

__device__ __forceinline__ unsigned long long now_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// ---- what follows a task's rows ----
// A Q/K/V task's matrix (0 q, 1 k, 2 v) and first row in it.
__device__ __forceinline__ int qkv_rows(const MegaShape& S, uint32_t idx, int& r0) {
  r0 = (int)idx * R_IN;
  if (r0 >= S.q_dim + S.kv_dim) return r0 -= S.q_dim + S.kv_dim, 2;
  if (r0 >= S.q_dim) return r0 -= S.q_dim, 1;
  return 0;
}
// The group a weight task's rows belong to: its arrival counter and how many tasks it has (a
// head's Q/K/V rows; 32 rows of O, of the GLU, of down).
__device__ __forceinline__ unsigned* task_group(const MegaArgs& A, const Counters& C, uint32_t kind, uint32_t l,
                                                uint32_t idx, unsigned& n) {
  const MegaShape& S = A.s;
  unsigned* grp = C.group + (size_t)l * C.per_layer;
  if (kind == K_QKV) {
    int r0;
    const int m = qkv_rows(S, idx, r0);
    n = (unsigned)(S.head_dim / R_IN);
    return grp + C.o_head + (m == 0 ? 0 : m == 1 ? S.n_heads : S.n_heads + S.n_kv_heads) + r0 / S.head_dim;
  }
  if (kind == K_O) return n = 32 / R_IN, grp + C.o_o + (int)idx * R_IN / 32;
  if (kind == K_GU) return n = 32 / R_GU, grp + C.o_h + (int)idx * R_GU / 32;
  return n = (unsigned)(32 / A.r_dn), grp + C.o_dn + (int)idx * A.r_dn / 32;
}
// A group complete, by its last arrival (a warp, which has acquired): a head's rope (K and V: into
// the cache), a 32-row group's q8 rounding with the next norm's weights (O: the FFN norm; down:
// the next layer's; the GLU: none). Returns the ready counter to signal (null: none).
__device__ __forceinline__ unsigned* group_finish(const MegaArgs& A, const Counters& C, uint32_t kind, uint32_t l,
                                                  uint32_t idx, int lane) {
  const MegaShape& S = A.s;
  const MegaLayer& L = A.layers[l];
  unsigned* rdy = C.ready + (size_t)l * R_N;
  if (kind == K_QKV) {
    int r0;
    const int m = qkv_rows(S, idx, r0), hh = r0 / S.head_dim;
    const AttnArgs& a = *reinterpret_cast<const AttnArgs*>(A.blob + L.attn_off);
    const int64_t p = A.pos[0], hd = S.head_dim;
    if (m == 0) {
      rope_head(A.q + hh * hd, L.rope, p, lane);
    } else {
      if (m == 1) rope_head(A.k + hh * hd, L.rope, p, lane);
      kv_store_slice(a.kv, a.n_kv - 1, m == 1 ? A.k : A.v, m == 2, hh * hd, (hh + 1) * hd, lane, 32);
    }
    return rdy + R_QKV;
  }
  if (kind == K_O) {
    round_group(A.x, L.ffn_norm, (int)idx * R_IN / 32, A.xb, S.dim, lane);
    return rdy + R_XB;
  }
  if (kind == K_GU) {
    round_group(A.h, nullptr, (int)idx * R_GU / 32, A.hq, S.ffn, lane);
    return rdy + R_H;
  }
  if (!L.next_norm) return nullptr;
  round_group(A.x, L.next_norm, (int)idx * A.r_dn / 32, A.xa, S.dim, lane);
  return C.ready + (size_t)(l + 1) * R_N + R_XA;
}
// A task's rows written (a task a warp): its group arrival, and the group's finish by the last.
__device__ __forceinline__ void task_done(const MegaArgs& A, const Counters& C, uint32_t kind, uint32_t l,
                                          uint32_t idx, int lane, Sync& fc) {
  unsigned n;
  unsigned* g = task_group(A, C, kind, l, idx, n);
  if (!arrive_last(g, n, lane, fc)) return;
  unsigned* r = group_finish(A, C, kind, l, idx, lane);
  if (r) signal(r, lane, fc);
}

template <uint32_t T, int KT, int NI>
__global__ void __launch_bounds__(NT, 1) mega_k(const __grid_constant__ MegaArgs A) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(128) uint8_t sm[];
  __shared__ uint64_t full[kMaxSlots], empty[kMaxSlots];
  __shared__ int next, issued, bsat;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const uint32_t t0 = A.task_off[blockIdx.x], nt = A.task_off[blockIdx.x + 1] - t0;
  const int NS = A.n_slots;
  const uint32_t SB = A.slot_bytes;
  uint32_t* tl = reinterpret_cast<uint32_t*>(sm + (size_t)NS * SB);
  const uint8_t** wl = reinterpret_cast<const uint8_t**>(tl + ((nt + 3) & ~3u));
  int16_t* sq = reinterpret_cast<int16_t*>(wl + A.n_layers * 7);
  for (uint32_t i = tid; i < nt; i += NT) tl[i] = A.tasks[t0 + i];
  for (int i = tid; i < A.n_layers * 7; i += NT) wl[i] = A.layers[i / 7].w[i % 7];
  __syncthreads();
  if (tid == 0) {
    int j = 0;
    for (uint32_t k = 0; k < nt; ++k) {
      const uint32_t kind = tl[k] >> 29;
      sq[k] = (int16_t)(kind == K_PRE || kind == K_ATT ? -1 : j++);
    }
    for (int s = 0; s < NS; ++s) mbar_init(&full[s], 1), mbar_init(&empty[s], 1);
    next = 0, issued = 0, bsat = -1;
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  const MegaShape& S = A.s;
  const Counters C = counters(A);

  if (warp == NW) {
    // The loader: every weight task's rows into its slot, in order, as slots free up; and
    // while it waits for a slot, the rows of the next A.prefetch weight tasks asked into L2,
    // so the memory keeps streaming while the ring is full of tasks that wait for their input.
    if (lane == 0) {
      uint32_t j = 0, pf = 0;  // weight tasks issued; the next one to prefetch (an index into tl)
      for (uint32_t k = 0; k < nt; ++k) {
        const uint8_t* src[2];
        unsigned bytes[2];
        if (!task_rows(A, wl, tl[k], src, bytes)) continue;
        const int s = (int)(j % NS);
        if (pf <= k) pf = k + 1;
        for (; pf < nt; ++pf) {
          const int q = sq[pf];
          if (q < 0) continue;
          if (q >= (int)j + A.prefetch) break;
          const uint8_t* ps[2];
          unsigned pb[2];
          task_rows(A, wl, tl[pf], ps, pb);
          for (int i = 0; i < 2; ++i)
            if (pb[i]) asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(ps[i]), "r"(pb[i]) : "memory");
        }
        if (j >= (uint32_t)NS) mbar_wait(&empty[s], ((j / NS) - 1) & 1);
        uint8_t* dst = sm + (size_t)s * SB;
        mbar_expect(&full[s], bytes[0] + bytes[1]);
        bulk_load(dst, src[0], bytes[0], &full[s]);
        if (bytes[1]) bulk_load(dst + bytes[0], src[1], bytes[1], &full[s]);
        *reinterpret_cast<volatile int*>(&issued) = (int)++j;
      }
    }
  } else {
    pdl_wait();  // x, the step's positions and the previous step's cache rows
    const bool tr = A.trace >= 0 && blockIdx.x == 0;
    if (tr && warp == 0 && lane == 0) A.stamps[A.n_layers * R_N] = now_ns();
    Sync fc;
    fc.rel = A.rel;
    // The profile (DASLLAMA_CUDA_MEGA_TRACE; lane 0): waits, and bodies and counts by kind.
    const bool prof = A.trace >= 0;
    long long pw[2] = {0, 0}, pb[6] = {0, 0, 0, 0, 0, 0};
    int pn[6] = {0, 0, 0, 0, 0, 0};
    int sat = -1;  // the highest ready counter this warp knows complete (they complete in order)
    int rms_key = -1;
    float rms = 1.f;
    const unsigned n_qkv = S.n_heads + 2 * S.n_kv_heads;
    // Groups an op's input has when complete (by the dependency's index: a switch, not an array
    // a variable indexes, which would live in local memory).
    auto target = [&](int dep) -> unsigned {
      switch (dep) {
        case R_XA: case R_XB: return (unsigned)S.dim / 32;
        case R_QKV: return n_qkv;
        case R_ATT: return (unsigned)S.n_heads;
        default: return (unsigned)S.ffn / 32;
      }
    };
    for (;;) {
      int k = 0;
      if (lane == 0) k = atomicAdd(&next, 1);
      k = __shfl_sync(0xffffffffu, k, 0);
      if (k >= (int)nt) break;
      const uint32_t w = tl[k], kind = w >> 29, l = (w >> 20) & 511, idx = w & 0xFFFFF;
      // The input this task reads: ready counter l * R_N + dep, complete at target(dep).
      const int dep = kind == K_QKV ? R_XA : kind == K_ATT ? R_QKV : kind == K_O ? R_ATT : kind == K_GU ? R_XB : R_H;
      long long tk = prof ? clock64() : 0;
      if (kind != K_PRE) {
        const int ri = (int)l * R_N + dep;
        if (ri > sat) sat = max(sat, *reinterpret_cast<volatile int*>(&bsat));
        if (ri > sat) {
          wait_ready(C.ready + ri, target(dep), lane, A.rel);
          if (tr && lane == 0 && A.stamps[ri] == 0) A.stamps[ri] = now_ns();
          sat = ri;
          if (lane == 0) atomicMax(&bsat, ri);
        }
      }
      if (prof) pw[0] += clock64() - tk, tk = clock64();
      const int j = sq[k];  // this task's place among the block's weight tasks (-1: none)
      const int s = j >= 0 ? j % NS : 0;
      if (j >= 0) {
        while (*reinterpret_cast<volatile int*>(&issued) <= j) {
        }
        mbar_wait(&full[s], (j / NS) & 1);
      }
      if (prof) pw[1] += clock64() - tk, tk = clock64();
      const uint8_t* tile = sm + (size_t)s * SB;
      if (kind == K_PRE) {
        round_group(A.x, A.layers[l].attn_norm, (int)idx, A.xa, S.dim, lane);
        signal(C.ready + (size_t)l * R_N + R_XA, lane, fc);
      } else if (kind == K_QKV) {
        if (rms_key != (int)l * 2) rms = inv_rms(A.xa, S.dim, S.eps, lane), rms_key = (int)l * 2;
        int r0;
        const int m = qkv_rows(S, idx, r0);
        float* dst = m == 0 ? A.q : m == 1 ? A.k : A.v;
        float acc[R_IN];
        warp_dot<T, R_IN>(tile, A.rb_in, S.dim, A.xa, lane, acc);
        const float y = pick<R_IN>(acc, lane);
        if (lane < R_IN) dst[r0 + lane] = y * rms;
        task_done(A, C, kind, l, idx, lane, fc);
      } else if (kind == K_ATT) {
        const AttnArgs& a = *reinterpret_cast<const AttnArgs*>(A.blob + A.layers[l].attn_off);
        att_task<KT, NI>(A, a, (int)idx / A.splits, (int)idx % A.splits, C.group + (size_t)l * C.per_layer + C.o_att,
                         C.ready + (size_t)l * R_N + R_ATT, lane, fc);
      } else if (kind == K_O) {
        const int r0 = (int)idx * R_IN;
        float acc[R_IN];
        warp_dot<T, R_IN>(tile, A.rb_o, S.q_dim, A.aq, lane, acc);
        const float y = pick<R_IN>(acc, lane);
        if (lane < R_IN) A.x[r0 + lane] = __ldcg(A.x + r0 + lane) + y;
        task_done(A, C, kind, l, idx, lane, fc);
      } else if (kind == K_GU) {
        if (rms_key != (int)l * 2 + 1) rms = inv_rms(A.xb, S.dim, S.eps, lane), rms_key = (int)l * 2 + 1;
        const int r0 = (int)idx * R_GU;
        float acc[2 * R_GU];
        warp_dot<T, 2 * R_GU>(tile, A.rb_in, S.dim, A.xb, lane, acc);
        float g = 0.f, u = 0.f;
#pragma unroll
        for (int r = 0; r < R_GU; ++r)
          if (lane == r) g = acc[r], u = acc[R_GU + r];
        if (lane < R_GU) A.h[r0 + lane] = glu_value(S.act, g * rms, u * rms);
        task_done(A, C, kind, l, idx, lane, fc);
      } else {  // K_DN
        const int r0 = (int)idx * A.r_dn;
        switch (A.r_dn) {
          case 1: down_rows<T, 1>(A, tile, r0, lane); break;
          case 2: down_rows<T, 2>(A, tile, r0, lane); break;
          case 4: down_rows<T, 4>(A, tile, r0, lane); break;
          case 8: down_rows<T, 8>(A, tile, r0, lane); break;
          default: down_rows<T, 16>(A, tile, r0, lane); break;
        }
        task_done(A, C, kind, l, idx, lane, fc);
      }
      __syncwarp();
      if (j >= 0 && lane == 0) mbar_arrive(&empty[s]);
      if (prof) pb[kind] += clock64() - tk, ++pn[kind];
    }
    if (prof && lane == 0) {
      unsigned long long* pr = A.stamps + A.n_layers * R_N + 1;
      atomicAdd(pr, (unsigned long long)fc.fc);
      atomicAdd(pr + 1, (unsigned long long)pw[0]);
      atomicAdd(pr + 2, (unsigned long long)pw[1]);
      for (int i = 0; i < 6; ++i) atomicAdd(pr + 3 + i, (unsigned long long)pb[i]), atomicAdd(pr + 9 + i, (unsigned long long)pn[i]);
    }
  }
  // The grid's last block leaves the ready counters at 0 for the next step.
  __syncthreads();
  if (tid == 0) {
    fence_gpu();
    unsigned* done = C.ready + A.n_layers * R_N;
    if (atomicAdd(done, 1u) == gridDim.x - 1) {
      for (int i = 0; i < A.n_layers * R_N; ++i) C.ready[i] = 0;
      *done = 0;
      fence_gpu();
      if (A.trace >= 0) {
        // When block 0 saw each op's input ready (us from its start; its first task may come
        // after the op's input was ready, and it may take no task of an op: -1).
        unsigned long long* st = A.stamps;
        const unsigned long long t0 = st[A.n_layers * R_N];
        if (A.pos[0] == A.trace) {
          printf("mega step at %d: %.1f us; ready (xa qkv att xb h) per layer:\n", A.trace, (now_ns() - t0) * 1e-3);
          for (int l = 0; l < A.n_layers; ++l) {
            float v[R_N];
            for (int r = 0; r < R_N; ++r) v[r] = st[l * R_N + r] ? (st[l * R_N + r] - t0) * 1e-3f : -1.f;
            printf("  %2d: %7.1f %7.1f %7.1f %7.1f %7.1f\n", l, v[0], v[1], v[2], v[3], v[4]);
          }
        }
        if (A.pos[0] == A.trace) {
          // Lane 0 cycles summed over every warp of the grid, and per task kind: its body (from its
          // slot's arrival to its release, fences included) and count.
          const unsigned long long* pr = st + A.n_layers * R_N + 1;
          printf("  cycles: fences %llu, dependency waits %llu, slot waits %llu\n", pr[0], pr[1], pr[2]);
          const char* kn[6] = {"pre", "qkv", "att", "o", "gu", "dn"};
          for (int i = 0; i < 6; ++i)
            printf("  %s: %llu tasks, %.0f cycles a task\n", kn[i], pr[9 + i], pr[9 + i] ? (double)pr[3 + i] / pr[9 + i] : 0.0);
        }
        for (int i = 0; i <= A.n_layers * R_N + 15; ++i) st[i] = 0;
      }
    }
  }
#endif
}

template <uint32_t T, int KT>
void* pick_kernel(int head_dim) {
  switch (head_dim) {
    case 32: return reinterpret_cast<void*>(mega_k<T, KT, 1>);
    case 64: return reinterpret_cast<void*>(mega_k<T, KT, 2>);
    default: return reinterpret_cast<void*>(mega_k<T, KT, 4>);
  }
}
void* kernel_for(const MegaShape& s) {
  const int kt = s.kv == KVType::f32 ? 0 : s.kv == KVType::f16 ? 1 : 2;
  if (s.type == T_Q8_0S)
    return kt == 0 ? pick_kernel<T_Q8_0S, 0>(s.head_dim) : kt == 1 ? pick_kernel<T_Q8_0S, 1>(s.head_dim)
                                                                   : pick_kernel<T_Q8_0S, 2>(s.head_dim);
  return kt == 0 ? pick_kernel<T_Q4_0S, 0>(s.head_dim) : kt == 1 ? pick_kernel<T_Q4_0S, 1>(s.head_dim)
                                                                 : pick_kernel<T_Q4_0S, 2>(s.head_dim);
}

int env_int(const char* name, int dflt) {
  const char* e = std::getenv(name);
  return e && *e ? std::atoi(e) : dflt;
}
int mega_splits() { return std::max(1, std::min(64, env_int("DASLLAMA_CUDA_MEGA_SPLITS", 16))); }

}  // namespace

namespace {
// Row bytes, the slot's size and down's rows a task, from the shape.
void layout(const MegaShape& s, MegaArgs& a) {
  const uint32_t t = s.type == T_Q8_0S ? 8 : 2;  // GGML's Q8_0 / Q4_0
  a.rb_in = (uint32_t)split_row_bytes(t, s.dim);
  a.rb_o = (uint32_t)split_row_bytes(t, s.q_dim);
  a.rb_d = (uint32_t)split_row_bytes(t, s.ffn);
  a.slot_bytes = (uint32_t)((R_IN * std::max(a.rb_in, a.rb_o) + 127) / 128 * 128);
  a.r_dn = 16;
  while (a.r_dn > 1 && (size_t)a.r_dn * a.rb_d > a.slot_bytes) a.r_dn /= 2;
  if ((size_t)a.r_dn * a.rb_d > a.slot_bytes) a.slot_bytes = (uint32_t)((a.rb_d + 127) / 128 * 128);
}
// Shared memory besides the slots: the block's task list, their slot numbers, the layers' weight
// pointers, and a margin.
size_t fixed_smem(size_t max_nt, int L) { return ((max_nt + 3) & ~size_t(3)) * 4 + (size_t)L * 7 * 8 + max_nt * 2 + 1024; }
}  // namespace

int mega_max_layers(const MegaShape& s, int sms, int smem_optin) {
  MegaArgs a{};
  layout(s, a);
  if (a.rb_in % 16 || a.rb_o % 16 || a.rb_d % 16 || sms < 1) return 0;
  const size_t per = (size_t)(s.q_dim + 2 * s.kv_dim) / R_IN + (size_t)s.n_heads * mega_splits() + s.dim / R_IN +
                     s.ffn / R_GU + s.dim / a.r_dn;
  int L = 0;
  while (L < 511) {  // the task word's layer field
    const size_t total = s.dim / 32 + per * (L + 1), max_nt = (total + sms - 1) / sms;
    if (fixed_smem(max_nt, L + 1) + 2 * (size_t)a.slot_bytes > (size_t)smem_optin) break;
    ++L;
  }
  return L;
}

const char* mega_unfit(const MegaShape& s, int sm_major) {
  if (sm_major < 9) return "needs sm_90 (bulk copies, mbarriers)";
  if (s.type != T_Q8_0S && s.type != T_Q4_0S) return "weights not split q8_0 / q4_0";
  if (s.head_dim != 32 && s.head_dim != 64 && s.head_dim != 128) return "head size";
  if (s.n_kv_heads <= 0 || s.n_heads % s.n_kv_heads != 0) return "heads";
  if (s.dim % 32 || s.q_dim % 32 || s.ffn % 32 || s.dim > (1 << 16) || s.ffn > (1 << 18)) return "widths";
  if (s.kv != KVType::f32 && s.kv != KVType::f16 && s.kv != KVType::q8_0) return "cache type";
  return "";
}

MegaPlan::~MegaPlan() { release(); }

void MegaPlan::release() {
  if (dev_) cudaFree(dev_);
  if (cnt_) cudaFree(cnt_);
  dev_ = cnt_ = nullptr;
}

static int mega_prefetch() { return std::max(0, env_int("DASLLAMA_CUDA_MEGA_PF", 0)); }
static bool mega_rel() { return env_int("DASLLAMA_CUDA_MEGA_REL", 0) == 1; }
bool MegaPlan::matches(const MegaShape& s, const std::vector<MegaLayer>& layers, const int32_t* pos, float* x,
                       float* q, float* k, float* v) const {
  return dev_ && layers.size() == layers_.size() && std::memcmp(&s, &shape_, sizeof s) == 0 &&
         std::memcmp(layers.data(), layers_.data(), layers.size() * sizeof(MegaLayer)) == 0 && a_.pos == pos &&
         a_.x == x && a_.q == q && a_.k == k && a_.v == v && a_.splits == mega_splits() &&
         a_.prefetch == mega_prefetch() && a_.rel == mega_rel() && a_.trace == env_int("DASLLAMA_CUDA_MEGA_TRACE", -1) &&
         a_.n_slots == std::min(slots_all_, std::max(2, env_int("DASLLAMA_CUDA_MEGA_SLOTS", kMaxSlots)));
}

const MegaArgs& MegaPlan::prepare(const MegaShape& s, const std::vector<MegaLayer>& layers, const int32_t* pos,
                                  float* x, float* q, float* k, float* v, cudaStream_t st) {
  const int splits = mega_splits();
  if (matches(s, layers, pos, x, q, k, v)) return a_;
  check(cudaStreamSynchronize(st), "mega plan");  // a step in flight may use the old plan
  release();
  shape_ = s, layers_ = layers;
  int dev = 0;
  check(cudaGetDevice(&dev), "mega plan");
  int sms = 0, smem_optin = 0;
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev), "mega plan");
  check(cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev), "mega plan");
  const int L = (int)layers.size();
  MegaArgs a{};
  a.s = s, a.n_layers = L, a.splits = splits, a.pos = pos, a.x = x, a.q = q, a.k = k, a.v = v;
  layout(s, a);

  // Tasks in op order, dealt round the blocks.
  grid_ = sms;
  std::vector<std::vector<uint32_t>> per(grid_);
  int cur = 0;
  auto deal = [&](uint32_t kind, int l, int n) {
    for (int i = 0; i < n; ++i) per[cur++ % grid_].push_back(task_word(kind, (uint32_t)l, (uint32_t)i));
  };
  deal(K_PRE, 0, s.dim / 32);
  for (int l = 0; l < L; ++l) {
    deal(K_QKV, l, (s.q_dim + 2 * s.kv_dim) / R_IN);
    deal(K_ATT, l, s.n_heads * splits);
    deal(K_O, l, s.dim / R_IN);
    deal(K_GU, l, s.ffn / R_GU);
    deal(K_DN, l, s.dim / a.r_dn);
  }
  std::vector<uint32_t> off(grid_ + 1, 0), tasks;
  size_t max_nt = 0;
  for (int b = 0; b < grid_; ++b) {
    off[b + 1] = off[b] + (uint32_t)per[b].size();
    tasks.insert(tasks.end(), per[b].begin(), per[b].end());
    max_nt = std::max(max_nt, per[b].size());
  }
  const size_t fixed = fixed_smem(max_nt, L);
  if ((size_t)smem_optin < fixed + 2 * (size_t)a.slot_bytes) throw Error("cuda mega: shared memory too small");
  slots_all_ = (int)std::min<size_t>(kMaxSlots, ((size_t)smem_optin - fixed) / a.slot_bytes);
  a.n_slots = std::min(slots_all_, std::max(2, env_int("DASLLAMA_CUDA_MEGA_SLOTS", kMaxSlots)));

  // Device memory: layers, task offsets, tasks, then the activations.
  auto al = [](size_t n) { return (n + 255) / 256 * 256; };
  const size_t b_layers = al(L * sizeof(MegaLayer)), b_off = al(off.size() * 4), b_tasks = al(tasks.size() * 4);
  const size_t b_xa = al(q8_row_bytes(s.dim)), b_aq = al(q8_row_bytes(s.q_dim)), b_hq = al(q8_row_bytes(s.ffn));
  const size_t b_h = al((size_t)s.ffn * 4), b_part = al((size_t)s.n_heads * splits * (s.head_dim + 2) * 4);
  const size_t b_stamps = al(((size_t)L * R_N + 16) * 8);
  const size_t total = b_layers + b_off + b_tasks + 2 * b_xa + b_aq + b_hq + b_h + b_part + b_stamps;
  check(cudaMalloc(&dev_, total), "mega plan");
  uint8_t* p = static_cast<uint8_t*>(dev_);
  a.layers = reinterpret_cast<const MegaLayer*>(p);
  check(cudaMemcpyAsync(p, layers.data(), L * sizeof(MegaLayer), cudaMemcpyHostToDevice, st), "mega plan");
  p += b_layers;
  a.task_off = reinterpret_cast<const uint32_t*>(p);
  check(cudaMemcpyAsync(p, off.data(), off.size() * 4, cudaMemcpyHostToDevice, st), "mega plan");
  p += b_off;
  a.tasks = reinterpret_cast<const uint32_t*>(p);
  check(cudaMemcpyAsync(p, tasks.data(), tasks.size() * 4, cudaMemcpyHostToDevice, st), "mega plan");
  p += b_tasks;
  a.xa = p, p += b_xa;
  a.xb = p, p += b_xa;
  a.aq = p, p += b_aq;
  a.hq = p, p += b_hq;
  a.h = reinterpret_cast<float*>(p), p += b_h;
  a.part = reinterpret_cast<float*>(p), p += b_part;
  a.stamps = reinterpret_cast<unsigned long long*>(p);
  check(cudaMemsetAsync(p, 0, b_stamps, st), "mega plan");
  p += b_stamps;
  a.prefetch = mega_prefetch();
  a.rel = mega_rel();
  a.trace = env_int("DASLLAMA_CUDA_MEGA_TRACE", -1);
  const int nr = (L * R_N + 1 + 31) & ~31;
  const int per_layer = 2 * s.n_heads + 2 * s.n_kv_heads + 2 * (s.dim / 32) + s.ffn / 32;
  cnt_bytes_ = ((size_t)nr + (size_t)L * per_layer) * 4;
  check(cudaMalloc(&cnt_, cnt_bytes_), "mega plan");
  check(cudaMemsetAsync(cnt_, 0, cnt_bytes_, st), "mega plan");
  a.cnt = static_cast<unsigned*>(cnt_);
  check(cudaStreamSynchronize(st), "mega plan");  // the host vectors go out of scope

  void* kern = kernel_for(s);
  smem_ = (size_t)a.n_slots * a.slot_bytes + fixed - 1024;
  check(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem_), "mega plan");
  int occ = 0;
  check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, kern, NT, smem_), "mega plan");
  if (occ < 1) throw Error("cuda mega: a block does not fit an SM");
  a_ = a;
  if (env_int("DASLLAMA_CUDA_MEGA_VERBOSE", 0))
    std::fprintf(stderr, "dasllama cuda mega: %d layers, %zu tasks over %d blocks (max %zu), %d slots of %u bytes, "
                 "down %d rows, %d splits\n", L, tasks.size(), grid_, max_nt, a.n_slots, a.slot_bytes, a.r_dn, splits);
  return a_;
}

void MegaPlan::launch(const uint8_t* blob, cudaStream_t st) const {
  MegaArgs a = a_;
  a.blob = blob;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3((unsigned)grid_), cfg.blockDim = dim3(NT), cfg.dynamicSmemBytes = smem_, cfg.stream = st;
  cudaLaunchAttribute at[1];
  cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
  unsigned na = 0;
  if (pdl_on() && cudaStreamIsCapturing(st, &cs) == cudaSuccess && cs == cudaStreamCaptureStatusActive) {
    at[na].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    at[na++].val.programmaticStreamSerializationAllowed = 1;
  }
  cfg.attrs = at, cfg.numAttrs = na;
  void* args[] = {&a};
  check(cudaLaunchKernelExC(&cfg, kernel_for(a.s), args), "mega launch");
}

}  // namespace dl::cuda
