// The q8-mode GEMV's pieces, shared by the standalone kernels (matmul.cu) and the fused
// decoder layer (fused.cu): 16-byte weight units of the direct layouts, the A8 rounding of an
// activation block, and the body of one block of gemv_q8_k.
#pragma once
#include <cstdint>

#include "common.cuh"
#include "dequant.cuh"
#include "kernels.h"

namespace dl::cuda {

constexpr int SW = 8;  // warps per block of the GEMV kernels

// ---- Direct GEMV: layouts whose rows are 16-byte aligned (f16, bf16, split q8_0 / q4_0) --
// A warp takes R consecutive rows; each lane loads 16-byte units straight from global
// memory (U units of each row in flight), so the x values it reads serve R rows. The
// block scale multiplies a partial sum of 8 products (quants converted exactly).
template <uint32_t T> struct Unit { static constexpr int e = 8; };  // elements per 16 bytes
template <> struct Unit<T_Q8_0S> { static constexpr int e = 16; };
template <> struct Unit<T_Q4_0S> { static constexpr int e = 32; };

template <uint32_t T>
__device__ __forceinline__ float unit_scale(const uint8_t* row, int cols, int u) {
  if constexpr (T == T_Q8_0S) return h2f(ld16(row + cols + (u >> 1) * 2));
  else if constexpr (T == T_Q4_0S) return h2f(ld16(row + cols / 2 + u * 2));
  else return 1.f;
}
// Group h (8 elements) of a loaded unit, as the integers or floats it holds, and the
// offset of its first element inside the unit.
template <uint32_t T>
__device__ __forceinline__ int unit_group(const uint4& q, int h, float v[8]) {
  if constexpr (T == T_F16 || T == T_BF16) {
    const uint32_t w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if constexpr (T == T_F16) {
        const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&w[i]));
        v[2 * i] = f.x, v[2 * i + 1] = f.y;
      } else {
        v[2 * i] = __uint_as_float(w[i] << 16), v[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
      }
    }
    return 0;
  } else if constexpr (T == T_Q8_0S) {
    const uint32_t a = h ? q.z : q.x, b = h ? q.w : q.y;
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = sf((int8_t)((i < 4 ? a : b) >> (8 * (i & 3))));
    return 8 * h;
  } else {  // T_Q4_0S: groups 0, 1 the low nibbles of bytes 0-7, 8-15; groups 2, 3 the high ones
    const uint32_t a = (h & 1) ? q.z : q.x, b = (h & 1) ? q.w : q.y;
    const int sh = (h >> 1) * 4;
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = sf((int)(((i < 4 ? a : b) >> (8 * (i & 3) + sh)) & 0xF) - 8);
    return 8 * h;
  }
}

// Where the GEMV reads its quantized activations: through the read-only path (written by an
// earlier kernel), from shared memory, or from L2 (written earlier in the same kernel by other
// blocks, so L1 may hold stale lines).
enum class XLoad { nc, shared, l2 };
template <XLoad L, class V>
__device__ __forceinline__ V xload(const V* p) {
  if constexpr (L == XLoad::nc) return __ldg(p);
  else if constexpr (L == XLoad::l2) return __ldcg(p);
  else return *p;
}

// A GEMV block's rows (gemv_q8_block, gemv_direct_k): the block's 8 warps form 8 / ks groups of R
// rows; the ks warps of a group (ks a power of two: shifts, not divisions) split the row's 16-byte
// units. The job's matrix is picked by constant indices (a dynamic index copied the job's arrays
// into local memory) and offsets inside a matrix are 32-bit (gemv_fits checks that they fit): ncu
// of the one-token Q/K/V GEMV (H100) had shown ~520 instructions a warp, stalled mostly on its own
// dependent integer work at two warps a scheduler. `store`: whether this lane writes output
// (r, t) = (lane / NT, lane % NT) of its group; `res`: that output's residual, read once the kernel
// before has finished (after wait()), while the weights are still in flight; only this block
// writes those rows (in the fused layer, other blocks wrote them before the phase's barrier: read
// from L2).
template <uint32_t T, int NT, int R>
struct GemvRows {
  static_assert(R * NT <= 32, "one lane an output");
  const uint8_t* base;
  float* y;
  float* o = nullptr;
  float res = 0.f;
  uint32_t rb;
  int mi = 0, rows, cols, r0, ub, ue, left, part, my_r, my_t;  // mi: the job's matrix
  bool store = false;
  __device__ __forceinline__ GemvRows(const GemvJob& j, int ks, int bid) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, ksl = __ffs(ks) - 1;
    const int group = warp >> ksl, groups = SW >> ksl;
    part = warp & (ks - 1);
    const uint8_t* w = j.w[0];
    rb = (uint32_t)j.rb[0], rows = (int)j.rows[0], y = j.y[0];
    int fb = 0;
    if (j.count > 1 && bid >= (int)j.first_block[1])
      w = j.w[1], rb = (uint32_t)j.rb[1], rows = (int)j.rows[1], fb = (int)j.first_block[1], y = j.y[1], mi = 1;
    if (j.count > 2 && bid >= (int)j.first_block[2])
      w = j.w[2], rb = (uint32_t)j.rb[2], rows = (int)j.rows[2], fb = (int)j.first_block[2], y = j.y[2], mi = 2;
    r0 = ((bid - fb) * groups + group) * R;
    cols = (int)j.cols;
    const int nu = cols / Unit<T>::e, per = (nu + ks - 1) >> ksl;
    ub = part * per, ue = ub + per < nu ? ub + per : nu;
    base = w + (size_t)(r0 < rows ? r0 : rows - 1) * rb;
    left = rows - r0;  // rows of this group still in the matrix (<= 0: none)
    my_r = lane / NT, my_t = lane % NT;
  }
  // U units of each of the R rows from unit u0, with their block scales; units past ue and rows
  // past the end load zeros (their outputs are never stored).
  template <int U>
  __device__ __forceinline__ void load(int u0, uint4 (&q)[U][R], float (&d)[U][R]) const {
#pragma unroll
    for (int k = 0; k < U; ++k)
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const int u = u0 + 32 * k;
        const bool ok = u < ue && r < left;
        const uint8_t* row = base + r * rb;
        q[k][r] = ok ? __ldg(reinterpret_cast<const uint4*>(row) + u) : make_uint4(0, 0, 0, 0);
        d[k][r] = ok ? unit_scale<T>(row, cols, u) : 0.f;
      }
  }
  // After wait(): the storing lane's place and residual.
  __device__ __forceinline__ void output(const GemvJob& j) {
    store = part == 0 && (int)(threadIdx.x & 31) < R * NT && my_t < j.n && my_r < left;
    o = y + my_t * rows + r0 + my_r;
    if (store && j.accumulate) res = __ldcg(o);
  }
};

// What a GEMV does with its finished outputs: called by every lane of a warp of part 0 (lanes
// past R * NT with s = 0), so an output may take a value from another lane (RopeOut).
// prepare(): at the block's start, before its first weight loads and the wait (RopeOut's angles).
struct StoreOut {
  template <class Rows>
  __device__ __forceinline__ void prepare(const GemvJob&, const Rows&) const {}
  template <class Rows>
  __device__ __forceinline__ void operator()(const GemvJob& j, const Rows& m, float s) const {
    if (m.store) *m.o = j.accumulate ? m.res + s : s;
  }
};

// Block `bid` of the q8-mode GEMV over job j (gemv_q8_k's grid) on GemvRows; the partial sums of a
// row's ks warps meet in shared memory. A unit is 16 q8_0 weights (4 dp4a against the token's
// quants) or a whole q4_0 block (8 dp4a, less 8 * its quant sum); per unit, the integer sum times
// the weight and activation scales. wait() runs once the first round of weights is in flight (the
// weights are constant; x may not be ready before it). U units of each row are in flight per lane
// (any U gives the same sums: each lane adds its units in increasing order). A caller that runs
// several blocks in one (the fused layer) syncs the block between them (red is reused).
// kXN: one token whose input may be not yet normed (GemvJob::xn; a kernel of its own, so the
// others keep their registers).
template <uint32_t T, int NT, int R, XLoad XL, int U = 2, bool kXN = false, class Wait, class Out = StoreOut>
__device__ __forceinline__ void gemv_q8_block(const GemvJob& j, int ks, int bid, Wait wait, Out out = Out()) {
  constexpr int UE = Unit<T>::e;
  __shared__ float red[SW][R][NT];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  GemvRows<T, NT, R> m(j, ks, bid);
  out.prepare(j, m);
  const int cols = m.cols, nb = cols / 32;
  float acc[R][NT];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int t = 0; t < NT; ++t) acc[r][t] = 0.f;
  uint4 q[U][R];
  float d[U][R];
  const int u_first = m.ub + lane, ue = m.ue;
  const bool live = m.left > 0;
  if (live && u_first < ue) m.load(u_first, q, d);
  wait();
  m.output(j);
  // An input not yet RMS-normed (one token, GemvJob::xn): its 32-blocks' sums of squares, read
  // beside x's first loads by the warps that store (part 0) and added up after the loop (one
  // scale for every sum of the row). In float, with rsqrtf: double's division and square root
  // are software sequences, ~3M instructions more over a Llama-1B gate / up (ncu, H100), where
  // the tail's rounding is held to the reference by NMSE, not to a launch's bits.
  static_assert(!kXN || NT == 1, "xn: one token");
  float xss = 0.f;
  if constexpr (kXN)
    if (j.xn && m.part == 0)
      for (int c = lane; c < nb; c += 32) xss += (float)xload<XL>(j.xn + c);
  for (int u0 = u_first; live && u0 < ue; u0 += 32 * U) {
    if (u0 != u_first) m.load(u0, q, d);
#pragma unroll
    for (int k = 0; k < U; ++k) {
      const int u = u0 + 32 * k;
      if (u >= ue) break;
      const int b = T == T_Q8_0S ? u >> 1 : u;
#pragma unroll
      for (int t = 0; t < NT; ++t) {
        if (t >= j.n) continue;
        const int8_t* xr = j.xq + t * cols + u * UE;
        const float dx = xload<XL>(j.xd + t * nb + b);
        if constexpr (T == T_Q8_0S) {
          const int4 xa = xload<XL>(reinterpret_cast<const int4*>(xr));
#pragma unroll
          for (int r = 0; r < R; ++r) {
            int s = __dp4a((int)q[k][r].x, xa.x, 0);
            s = __dp4a((int)q[k][r].y, xa.y, s);
            s = __dp4a((int)q[k][r].z, xa.z, s);
            s = __dp4a((int)q[k][r].w, xa.w, s);
            acc[r][t] += (float)s * __fmul_rn(d[k][r], dx);
          }
        } else {
          const int4 xa = xload<XL>(reinterpret_cast<const int4*>(xr)),
                     xb = xload<XL>(reinterpret_cast<const int4*>(xr) + 1);
          const int off = 8 * xload<XL>(j.xs + t * nb + b);
#pragma unroll
          for (int r = 0; r < R; ++r) {
            const uint4 wq = q[k][r];
            int s = __dp4a((int)(wq.x & 0x0F0F0F0Fu), xa.x, 0);
            s = __dp4a((int)(wq.y & 0x0F0F0F0Fu), xa.y, s);
            s = __dp4a((int)(wq.z & 0x0F0F0F0Fu), xa.z, s);
            s = __dp4a((int)(wq.w & 0x0F0F0F0Fu), xa.w, s);
            s = __dp4a((int)((wq.x >> 4) & 0x0F0F0F0Fu), xb.x, s);
            s = __dp4a((int)((wq.y >> 4) & 0x0F0F0F0Fu), xb.y, s);
            s = __dp4a((int)((wq.z >> 4) & 0x0F0F0F0Fu), xb.z, s);
            s = __dp4a((int)((wq.w >> 4) & 0x0F0F0F0Fu), xb.w, s);
            acc[r][t] += (float)(s - off) * __fmul_rn(d[k][r], dx);
          }
        }
      }
    }
  }
  // (called by part 0's warps only, each whole)
  const auto normed = [&](float v) {
    if constexpr (kXN)
      if (j.xn) return __fmul_rn(v, rsqrtf(__fdividef(warp_sum(xss), (float)cols) + j.eps));
    return v;
  };
  if (ks == 1) {  // the warp holds whole rows: no shared memory (every lane gets each row's sum)
    float mine = 0.f;
#pragma unroll
    for (int t = 0; t < NT; ++t)
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const float s = 0.f + warp_sum(acc[r][t]);  // (a sum from 0, as with ks > 1: -0 becomes +0)
        if (lane == r * NT + t) mine = s;
      }
    out(j, m, normed(mine));
    return;
  }
#pragma unroll
  for (int t = 0; t < NT; ++t)
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const float s = warp_sum(acc[r][t]);
      if (lane == 0) red[warp][r][t] = s;
    }
  __syncthreads();
  if (m.part == 0) {  // (warp-uniform)
    float s = 0.f;
    if (lane < R * NT)
      for (int p = 0; p < ks; ++p) s += red[warp + p][m.my_r][m.my_t];
    out(j, m, normed(s));
  }
}

// Widest row the GEMVs round into shared memory themselves (8 values a thread: 16 spilled
// where the first weights are live across the rounding).
constexpr int kQuantMax = 8 * SW * 32;

// x (cols <= kQuantMax floats, RMS-normed times nw when norm) into q8 blocks in shared memory,
// by the whole block of SW warps (x read as XL says). Thread (warp w, lane l) holds elements 32 (w + 8 k) + l: the strided
// order of quantize_act_k's sum of squares (double; warp sums, then the 8 warps in order) and
// lane l of block w + 8 k for its rounding (quant_store), from one read of x.
template <XLoad XL>
__device__ __forceinline__ void quant_smem(const float* x, int64_t cols, bool norm, const float* nw, float eps,
                                           int8_t* xq, float* xd, int32_t* xs, double* red) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  float v[kQuantMax / (SW * 32)];
#pragma unroll
  for (int k = 0; k < kQuantMax / (SW * 32); ++k) {
    const int64_t i = threadIdx.x + (int64_t)k * (SW * 32);
    v[k] = i < cols ? xload<XL>(x + i) : 0.f;
  }
  float sc = 1.f;
  if (norm) {
    double ss = 0;
#pragma unroll
    for (int k = 0; k < kQuantMax / (SW * 32); ++k)
      if (threadIdx.x + (int64_t)k * (SW * 32) < cols) ss += (double)v[k] * v[k];
    ss = warp_sum_d(ss);
    if (lane == 0) red[warp] = ss;
    __syncthreads();
    double tot = 0;
#pragma unroll
    for (int w = 0; w < (SW * 32) / 32; ++w) tot += red[w];
    sc = (float)(1.0 / sqrt(tot / cols + eps));
  }
#pragma unroll
  for (int k = 0; k < kQuantMax / (SW * 32); ++k) {
    const int64_t b = warp + (int64_t)k * ((SW * 32) / 32), i = b * 32 + lane;
    if (b >= cols / 32) break;  // uniform over the warp
    float y = v[k];
    if (norm) y = nw ? __fmul_rn(y, sc) * nw[i] : y * sc;
    quant_store(y, lane, i, b, xq, xd, xs);
  }
  __syncthreads();
}

}  // namespace dl::cuda
