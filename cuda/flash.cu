// Prefill attention, tiled (flash-attention's form in f32): a block takes BR query rows of one
// head and walks the keys BC at a time. Each key tile is read from the paged cache once for all
// BR rows (dequantized into shared memory), where the row-per-block decode kernel (attn.cuh)
// reads every key again for every row: at 512 rows and more that re-reading was the whole cost.
// Scores and outputs stay f32 FMAs (the harness's f32 bar); only the order of the sums differs
// from the decode kernel's.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "attn.cuh"
#include "common.cuh"
#include "kernels.h"

namespace dl::cuda {
namespace {

// The factor a row's output sums take: 1 / (its softmax sum), with gpt-oss's sink joining the
// denominator at the joint max (0 for a row that saw no key and has no sink).
__device__ __forceinline__ float row_scale(const AttnArgs& a, int h, float m, float L) {
  float f = 1.f;
  if (a.sinks) {
    const float sink = a.sinks[h], M2 = fmaxf(m, sink);
    f = m == -INFINITY ? 0.f : expf(m - M2);
    L = L * f + expf(sink - M2);
  }
  return L > 0.f ? f / L : 0.f;
}

// HD: head_dim rounded up to 64 / 96 / 128 / 256 (zero padded). 128 threads as 8 row groups (ty)
// x 16 key / column lanes (tx): a thread scores RT rows x CT keys of a tile and accumulates RT
// rows x HD / 16 output columns (tx + 16 c, so a half-warp reads 16 consecutive V floats).
// Tiles sized for 2-3 blocks an SM (60-107 KB of shared memory).
// BR_ 32 halves a block's rows where 64-row blocks would not fill the GPU twice over (a 512-token
// prefill of 32 heads: 256 blocks), so the causal last tiles, which walk every key, are half as
// long and twice as many blocks share the SMs.
template <int HD, int BR_ = (HD <= 128 ? 64 : 32)> struct FlashShape {
  static constexpr int BR = BR_, BC = HD <= 64 ? 64 : 32, RT = BR / 8, CT = BC / 16, OC = HD / 16;
  static constexpr int KS = BC + 4;  // Kt / Ps row stride: float4-aligned
  static constexpr int smem_floats = HD * BR + HD * KS + BC * HD + BR * KS;
};

template <int KT, int HD, int BR_>
__global__ void __launch_bounds__(128) flash_k(AttnArgs a) {
  using S = FlashShape<HD, BR_>;
  constexpr int BR = S::BR, BC = S::BC, RT = S::RT, CT = S::CT, OC = S::OC, KS = S::KS;
  extern __shared__ __align__(16) float fsm[];
  float* Qt = fsm;              // [HD][BR]: Q transposed
  float* Kt = Qt + HD * BR;     // [HD][KS]: the tile's keys transposed
  float* Vs = Kt + HD * KS;     // [BC][HD]
  float* Ps = Vs + BC * HD;     // [BR][KS]: the tile's probabilities
  const int tid = threadIdx.x, tx = tid & 15, ty = tid >> 4;
  const int h = blockIdx.y, hd = a.head_dim;
  const int64_t t0 = (int64_t)blockIdx.x * BR;
  const int kvh = h / (a.n_heads / a.n_kv_heads);
  const size_t head_off = KT == 0 ? (size_t)kvh * hd * 4 : KT == 1 ? (size_t)kvh * hd * 2 : (size_t)kvh * (hd / 32) * 34;
  const size_t koff = a.kv.k_off + head_off, voff = a.kv.v_off + head_off;

  // The block's key range: the union of its rows' (window, causal) ranges.
  int64_t lo = INT64_MAX, hi = 0;
  int64_t pos[RT];
  for (int64_t r = 0; r < BR; ++r) {
    if (t0 + r >= a.n_tok) break;
    const int64_t p = a.q_pos[t0 + r];
    hi = max(hi, min(a.n_kv, p + 1));
    lo = min(lo, a.window > 0 ? max(int64_t(0), p - a.window + 1) : int64_t(0));
  }
#pragma unroll
  for (int i = 0; i < RT; ++i) {
    const int64_t t = t0 + ty * RT + i;
    pos[i] = t < a.n_tok ? a.q_pos[t] : -1;  // -1: a padding row, every key masked
  }
  for (int idx = tid; idx < HD * BR; idx += 128) {
    const int r = idx / HD, d = idx % HD;
    const int64_t t = t0 + r;
    Qt[d * BR + r] = t < a.n_tok && d < hd ? a.q[t * a.q_stride + (int64_t)h * hd + d] : 0.f;
  }
  float o[RT][OC], m[RT], l[RT];
#pragma unroll
  for (int i = 0; i < RT; ++i) {
    m[i] = -INFINITY, l[i] = 0.f;
#pragma unroll
    for (int c = 0; c < OC; ++c) o[i][c] = 0.f;
  }
  const int64_t first = lo >= hi ? hi : lo - lo % BC;
  for (int64_t j0 = first; j0 < hi; j0 += BC) {
    __syncthreads();  // the previous tile's Kt / Vs / Ps are read
    for (int idx = tid; idx < BC * HD; idx += 128) {
      const int j = idx / HD, d = idx % HD;
      float kv = 0.f, vv = 0.f;
      if (j0 + j < hi && d < hd) {
        kv = kv_elem<KT>(kv_row(a.kv, koff, j0 + j), d);
        vv = kv_elem<KT>(kv_row(a.kv, voff, j0 + j), d);
      }
      Kt[d * KS + j] = kv;
      Vs[j * HD + d] = vv;
    }
    __syncthreads();
    float s[RT][CT];
#pragma unroll
    for (int i = 0; i < RT; ++i)
#pragma unroll
      for (int c = 0; c < CT; ++c) s[i][c] = 0.f;
#pragma unroll 4
    for (int d = 0; d < HD; ++d) {
      float q[RT], k[CT];
#pragma unroll
      for (int i = 0; i < RT; i += 4) *reinterpret_cast<float4*>(q + i) = *reinterpret_cast<const float4*>(Qt + d * BR + ty * RT + i);
      if constexpr (CT == 4) *reinterpret_cast<float4*>(k) = *reinterpret_cast<const float4*>(Kt + d * KS + tx * CT);
      else *reinterpret_cast<float2*>(k) = *reinterpret_cast<const float2*>(Kt + d * KS + tx * CT);
#pragma unroll
      for (int i = 0; i < RT; ++i)
#pragma unroll
        for (int c = 0; c < CT; ++c) s[i][c] = fmaf(q[i], k[c], s[i][c]);
    }
    // Online softmax per row; a row's 16 tx lanes are one half-warp.
#pragma unroll
    for (int i = 0; i < RT; ++i) {
      const int64_t p = pos[i];
      const int64_t rlo = a.window > 0 ? p - a.window + 1 : INT64_MIN;
      float mx = m[i];
#pragma unroll
      for (int c = 0; c < CT; ++c) {
        const int64_t j = j0 + tx * CT + c;
        const bool ok = j < hi && j <= p && j >= rlo;
        float v = a.softcap > 0.f ? a.softcap * tanhf(s[i][c] * a.scale / a.softcap) : s[i][c] * a.scale;
        s[i][c] = ok ? v : -INFINITY;
        mx = fmaxf(mx, s[i][c]);
      }
#pragma unroll
      for (int off = 8; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
      const float corr = mx == -INFINITY ? 1.f : expf(m[i] - mx);  // m = -inf before any key: 0
      m[i] = mx;
      l[i] *= corr;
#pragma unroll
      for (int c = 0; c < OC; ++c) o[i][c] *= corr;
      float pv[CT];
#pragma unroll
      for (int c = 0; c < CT; ++c) {
        pv[c] = s[i][c] == -INFINITY ? 0.f : expf(s[i][c] - mx);
        l[i] += pv[c];
      }
      if constexpr (CT == 4) *reinterpret_cast<float4*>(Ps + (ty * RT + i) * KS + tx * CT) = *reinterpret_cast<float4*>(pv);
      else *reinterpret_cast<float2*>(Ps + (ty * RT + i) * KS + tx * CT) = *reinterpret_cast<float2*>(pv);
    }
    __syncthreads();
    const int jn = (int)min((int64_t)BC, hi - j0);
    for (int j = 0; j < jn; ++j) {
      float v[OC];
#pragma unroll
      for (int c = 0; c < OC; ++c) v[c] = Vs[j * HD + tx + 16 * c];
#pragma unroll
      for (int i = 0; i < RT; ++i) {
        const float p = Ps[(ty * RT + i) * KS + j];
#pragma unroll
        for (int c = 0; c < OC; ++c) o[i][c] = fmaf(p, v[c], o[i][c]);
      }
    }
  }
#pragma unroll
  for (int i = 0; i < RT; ++i) {
    const int64_t t = t0 + ty * RT + i;
    float L = l[i];
#pragma unroll
    for (int off = 8; off > 0; off >>= 1) L += __shfl_xor_sync(0xffffffffu, L, off);
    if (t >= a.n_tok) continue;
    const float inv = row_scale(a, h, m[i], L);
    float* out = a.out + t * a.out_stride + (int64_t)h * hd;
#pragma unroll
    for (int c = 0; c < OC; ++c) {
      const int d = tx + 16 * c;
      if (d < hd) out[d] = o[i][c] * inv;
    }
  }
}

template <int KT, int HD, int BR>
void launch_flash_br(const AttnArgs& a, cudaStream_t st) {
  using S = FlashShape<HD, BR>;
  const size_t smem = S::smem_floats * sizeof(float);
  static bool set = [&] {
    return cudaFuncSetAttribute(flash_k<KT, HD, BR>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem) ==
           cudaSuccess;
  }();
  if (!set) throw DeviceError("cuda flash attention: the device refuses " + std::to_string(smem) + " bytes of shared memory");
  const dim3 grid((unsigned)ceil_div(a.n_tok, S::BR), (unsigned)a.n_heads);
  flash_k<KT, HD, BR><<<grid, 128, smem, st>>>(a);
  check_launch("flash attention");
}

// DASLLAMA_CUDA_FLASH_BR=64 / 32 forces the rows a block takes (head sizes up to 128).
template <int KT, int HD>
void launch_flash(const AttnArgs& a, cudaStream_t st) {
  if constexpr (HD <= 128) {
    const char* e = std::getenv("DASLLAMA_CUDA_FLASH_BR");
    const int forced = e ? std::atoi(e) : 0;
    int sms = 132, dev = 0;
    if (cudaGetDevice(&dev) == cudaSuccess) cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    const bool small = forced ? forced == 32 : ceil_div(a.n_tok, 64) * a.n_heads < 2 * (int64_t)sms;
    if (small) return launch_flash_br<KT, HD, 32>(a, st);
  }
  launch_flash_br<KT, HD, FlashShape<HD>::BR>(a, st);
}

template <int KT>
void launch_flash_kt(const AttnArgs& a, cudaStream_t st) {
  if (a.head_dim <= 64) launch_flash<KT, 64>(a, st);
  else if (a.head_dim <= 96) launch_flash<KT, 96>(a, st);
  else if (a.head_dim <= 128) launch_flash<KT, 128>(a, st);
  else launch_flash<KT, 256>(a, st);
}


// ---- The f16 cache on TF32 tensor cores ----
// f16 keys and values are exact in TF32; queries and probabilities are split x = hi + lo (both
// TF32, lo = x - hi) and take two mmas, so scores and outputs keep f32's precision to about
// 2^-22 (the harness's f32 bar), as mma_f16_k does for f16 weights. A block: 4 warps x 16 query
// rows of one head, key tiles of BC keys converted to f32 in shared memory, the next tile's
// loads in flight while this one is scored. The k slots c and c + 4 of an m16n8k8 fragment
// take elements 2c and 2c + 1 of each group of 8, alike for A and B: a thread reads float2s,
// and a score tile's accumulator is, as it stands, the probabilities' A fragment for P V.
// Only the order of the sums differs from flash_k's.
// Shared by the tensor-core kernels below (4 warps x 16 query rows; a thread's rows are
// warp * 16 + g and + 8, g = lane / 4).
// The keys a block of BR rows from t0 reads: the union of its rows' (window, causal) ranges.
__device__ __forceinline__ void block_keys(const AttnArgs& a, int64_t t0, int br, int64_t& lo, int64_t& hi) {
  lo = INT64_MAX, hi = 0;
  for (int64_t r = 0; r < br && t0 + r < a.n_tok; ++r) {
    const int64_t p = a.q_pos[t0 + r];
    hi = max(hi, min(a.n_kv, p + 1));
    lo = min(lo, a.window > 0 ? max(int64_t(0), p - a.window + 1) : int64_t(0));
  }
}
// This thread's two rows' positions (-1: padding, every key masked).
__device__ __forceinline__ void quad_rows(const AttnArgs& a, int64_t t0, int warp, int g, int64_t (&pos)[2]) {
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int64_t t = t0 + warp * 16 + g + 8 * hr;
    pos[hr] = t < a.n_tok ? a.q_pos[t] : -1;
  }
}
// The 16-byte units of a key tile's K and V rows from j0 this thread loads (zeros past hi and
// past the head).
template <int U, int UR>
__device__ __forceinline__ void load_kv_units(const AttnArgs& a, int hd, size_t koff, size_t voff, int64_t j0,
                                              int64_t hi, int tid, uint4 (&kr)[U], uint4 (&vr)[U]) {
#pragma unroll
  for (int i = 0; i < U; ++i) {
    const int id = tid + 128 * i, j = id / UR, u = id % UR;
    const bool ok = j0 + j < hi && u * 8 < hd;
    kr[i] = ok ? __ldg(reinterpret_cast<const uint4*>(kv_row(a.kv, koff, j0 + j)) + u) : make_uint4(0, 0, 0, 0);
    vr[i] = ok ? __ldg(reinterpret_cast<const uint4*>(kv_row(a.kv, voff, j0 + j)) + u) : make_uint4(0, 0, 0, 0);
  }
}
// The rows' outputs: O's accumulators (rows g, g + 8; dims n * 8 + 2c, + 1) over the quad's L.
template <int HD>
__device__ __forceinline__ void store_quad_rows(const AttnArgs& a, int hd, int h, int64_t t0, int warp, int g, int c,
                                                const float (&m)[2], const float (&l)[2], const float (&o)[HD / 8][4]) {
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int64_t t = t0 + warp * 16 + g + 8 * hr;
    float L = l[hr];
    L += __shfl_xor_sync(0xffffffffu, L, 1);
    L += __shfl_xor_sync(0xffffffffu, L, 2);
    if (t >= a.n_tok) continue;
    const float inv = row_scale(a, h, m[hr], L);
    float* out = a.out + t * a.out_stride + (int64_t)h * hd;
#pragma unroll
    for (int n = 0; n < HD / 8; ++n) {
      const int d = n * 8 + 2 * c;
      if (d < hd) out[d] = o[n][2 * hr] * inv, out[d + 1] = o[n][2 * hr + 1] * inv;
    }
  }
}

template <int HD, int BC> struct TcShape {
  static constexpr int BR = 64;
  // Row strides (words) that keep the fragment reads free of bank conflicts: float2 reads of
  // 8 rows need stride = 8 (mod 32), V's scalar reads of rows 2c need 4 (mod 32).
  static constexpr int QS = HD + 8, KS = HD + 8, VS = HD + 4;
  static constexpr int U = BC * HD / 8 / 128;  // 16-byte units of K (and of V) a thread loads a tile
  static constexpr size_t smem = (size_t)(2 * BR * QS + BC * KS + BC * VS) * 4;
};

template <int HD, int BC>
__global__ void __launch_bounds__(128) flash_tc_k(AttnArgs a) {
  using S = TcShape<HD, BC>;
  constexpr int BR = S::BR, QS = S::QS, KS = S::KS, VS = S::VS, U = S::U, UR = HD / 8;
  extern __shared__ __align__(16) float fsm[];
  uint32_t* Qh = reinterpret_cast<uint32_t*>(fsm);
  uint32_t* Ql = Qh + BR * QS;
  float* Ks = fsm + 2 * BR * QS;
  float* Vs = Ks + BC * KS;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, c = lane & 3;
  const int h = blockIdx.y, hd = a.head_dim;
  const int64_t t0 = (int64_t)blockIdx.x * BR;
  const int kvh = h / (a.n_heads / a.n_kv_heads);
  const size_t koff = a.kv.k_off + (size_t)kvh * hd * 2, voff = a.kv.v_off + (size_t)kvh * hd * 2;

  int64_t lo, hi, pos[2];
  block_keys(a, t0, BR, lo, hi);
  quad_rows(a, t0, warp, g, pos);
  for (int idx = tid; idx < BR * HD; idx += 128) {
    const int r = idx / HD, d = idx % HD;
    const int64_t t = t0 + r;
    const float x = t < a.n_tok && d < hd ? a.q[t * a.q_stride + (int64_t)h * hd + d] : 0.f;
    const uint32_t xh = to_tf32(x);
    Qh[r * QS + d] = xh;
    Ql[r * QS + d] = to_tf32(x - __uint_as_float(xh));
  }
  uint4 kr[U], vr[U];
  auto load = [&](int64_t j0) { load_kv_units<U, UR>(a, hd, koff, voff, j0, hi, tid, kr, vr); };
  auto store = [&]() {
#pragma unroll
    for (int i = 0; i < U; ++i) {
      const int id = tid + 128 * i, j = id / UR, u = id % UR;
      const uint32_t kw[4] = {kr[i].x, kr[i].y, kr[i].z, kr[i].w}, vw[4] = {vr[i].x, vr[i].y, vr[i].z, vr[i].w};
      float kf[8], vf[8];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float2 k2 = __half22float2(*reinterpret_cast<const __half2*>(&kw[e]));
        const float2 v2 = __half22float2(*reinterpret_cast<const __half2*>(&vw[e]));
        kf[2 * e] = k2.x, kf[2 * e + 1] = k2.y, vf[2 * e] = v2.x, vf[2 * e + 1] = v2.y;
      }
      float4* kd = reinterpret_cast<float4*>(Ks + j * KS + u * 8);
      float4* vd = reinterpret_cast<float4*>(Vs + j * VS + u * 8);
      kd[0] = make_float4(kf[0], kf[1], kf[2], kf[3]), kd[1] = make_float4(kf[4], kf[5], kf[6], kf[7]);
      vd[0] = make_float4(vf[0], vf[1], vf[2], vf[3]), vd[1] = make_float4(vf[4], vf[5], vf[6], vf[7]);
    }
  };

  float o[HD / 8][4], m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
#pragma unroll
  for (int n = 0; n < HD / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  const int64_t first = lo >= hi ? hi : lo - lo % BC;
  if (first < hi) load(first);
  const uint32_t* qh0 = Qh + (warp * 16 + g) * QS + 2 * c;
  const uint32_t* ql0 = Ql + (warp * 16 + g) * QS + 2 * c;
  for (int64_t j0 = first; j0 < hi; j0 += BC) {
    __syncthreads();  // the previous tile is consumed (the first time: Q is stored)
    store();
    __syncthreads();
    if (j0 + BC < hi) load(j0 + BC);
    float s[BC / 8][4];
#pragma unroll
    for (int n = 0; n < BC / 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll 4
    for (int k0 = 0; k0 < HD; k0 += 8) {
      const uint2 ha = *reinterpret_cast<const uint2*>(qh0 + k0), hb = *reinterpret_cast<const uint2*>(qh0 + 8 * QS + k0);
      const uint2 la = *reinterpret_cast<const uint2*>(ql0 + k0), lb = *reinterpret_cast<const uint2*>(ql0 + 8 * QS + k0);
      const uint32_t ah[4] = {ha.x, hb.x, ha.y, hb.y}, al[4] = {la.x, lb.x, la.y, lb.y};
#pragma unroll
      for (int n = 0; n < BC / 8; ++n) {
        const float2 kk = *reinterpret_cast<const float2*>(Ks + (n * 8 + g) * KS + k0 + 2 * c);
        mma_tf32(s[n], al, __float_as_uint(kk.x), __float_as_uint(kk.y));
        mma_tf32(s[n], ah, __float_as_uint(kk.x), __float_as_uint(kk.y));
      }
    }
    // Online softmax: a row's BC scores sit in the 4 lanes of a quad (2 per n-tile each).
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int64_t p = pos[hr];
      const int64_t rlo = a.window > 0 ? p - a.window + 1 : INT64_MIN;
      float mx = m[hr];
#pragma unroll
      for (int n = 0; n < BC / 8; ++n)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int64_t j = j0 + n * 8 + 2 * c + e;
          const bool ok = j < hi && j <= p && j >= rlo;
          float& x = s[n][2 * hr + e];
          const float v = a.softcap > 0.f ? a.softcap * tanhf(x * a.scale / a.softcap) : x * a.scale;
          x = ok ? v : -INFINITY;
          mx = fmaxf(mx, x);
        }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float corr = mx == -INFINITY ? 1.f : expf(m[hr] - mx);  // m = -inf before any key: 0
      m[hr] = mx;
      l[hr] *= corr;
#pragma unroll
      for (int n = 0; n < HD / 8; ++n) o[n][2 * hr] *= corr, o[n][2 * hr + 1] *= corr;
#pragma unroll
      for (int n = 0; n < BC / 8; ++n)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float& x = s[n][2 * hr + e];
          x = x == -INFINITY ? 0.f : expf(x - mx);
          l[hr] += x;
        }
    }
    // O += P V: the scores' n-tile kk is the A fragment of keys kk * 8 .. + 7.
#pragma unroll
    for (int kk = 0; kk < BC / 8; ++kk) {
      const float pv[4] = {s[kk][0], s[kk][2], s[kk][1], s[kk][3]};
      uint32_t ph[4], pl[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) ph[i] = to_tf32(pv[i]), pl[i] = to_tf32(pv[i] - __uint_as_float(ph[i]));
      const float* v0 = Vs + (kk * 8 + 2 * c) * VS + g;
#pragma unroll
      for (int n = 0; n < HD / 8; ++n) {
        const uint32_t b0 = __float_as_uint(v0[n * 8]), b1 = __float_as_uint(v0[VS + n * 8]);
        mma_tf32(o[n], pl, b0, b1);
        mma_tf32(o[n], ph, b0, b1);
      }
    }
  }
  store_quad_rows<HD>(a, hd, h, t0, warp, g, c, m, l, o);
}

// ---- q8 mode: the f16 cache on f16 tensor cores ----
// As flash_tc_k, but Q * scale and the probabilities rounded to f16 once (as llama.cpp's flash
// attention rounds them; q8 mode's kind of error, a.exact false) and one m16n8k16 mma a product
// where the TF32 split takes four per 16 of k: K and V stay f16 in shared memory, V transposed
// ([dim][key]) so a B fragment's two keys are one 32-bit read. A score tile's accumulator is,
// as it stands, the probabilities' A fragment for P V (its rows g, g + 8, keys 2c, 2c + 1 of
// each 8). The probabilities' sum is of their f16 values. Vulkan's flash_cm.comp is the same
// walk on cooperative matrices.
template <int HD, int BC> struct H16Shape {
  static constexpr int BR = 64;
  // Row strides (halves) that keep the 32-bit fragment reads of 8 rows x 4 lanes on distinct banks.
  static constexpr int QS = HD + 8, KS = HD + 8, VS = BC + 8;
  static constexpr int U = BC * HD / 8 / 128;  // 16-byte units of K (and of V) a thread loads a tile
  static constexpr size_t smem = (size_t)(BR * QS + BC * KS + HD * VS) * 2;
};

__device__ __forceinline__ uint32_t h2_bits(float x, float y) {
  const __half2 p = __floats2half2_rn(x, y);  // .x (the lower address) first
  return *reinterpret_cast<const uint32_t*>(&p);
}

template <int HD, int BC>
__global__ void __launch_bounds__(128) flash_h16_k(AttnArgs a) {
  using S = H16Shape<HD, BC>;
  constexpr int BR = S::BR, QS = S::QS, KS = S::KS, VS = S::VS, U = S::U, UR = HD / 8;
  extern __shared__ __align__(16) __half hsm[];
  __half* Qs = hsm;
  __half* Ks = Qs + BR * QS;
  __half* Vt = Ks + BC * KS;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, c = lane & 3;
  const int h = blockIdx.y, hd = a.head_dim;
  const int64_t t0 = (int64_t)blockIdx.x * BR;
  const int kvh = h / (a.n_heads / a.n_kv_heads);
  const size_t koff = a.kv.k_off + (size_t)kvh * hd * 2, voff = a.kv.v_off + (size_t)kvh * hd * 2;

  int64_t lo, hi, pos[2];
  block_keys(a, t0, BR, lo, hi);
  quad_rows(a, t0, warp, g, pos);
  for (int idx = tid; idx < BR * HD; idx += 128) {
    const int r = idx / HD, d = idx % HD;
    const int64_t t = t0 + r;
    const float x = t < a.n_tok && d < hd ? a.q[t * a.q_stride + (int64_t)h * hd + d] : 0.f;
    Qs[r * QS + d] = __float2half_rn(x * a.scale);
  }
  uint4 kr[U], vr[U];
  auto load = [&](int64_t j0) { load_kv_units<U, UR>(a, hd, koff, voff, j0, hi, tid, kr, vr); };
  auto store = [&]() {
#pragma unroll
    for (int i = 0; i < U; ++i) {
      const int id = tid + 128 * i, j = id / UR, u = id % UR;
      *reinterpret_cast<uint4*>(Ks + j * KS + u * 8) = kr[i];
      const __half* v = reinterpret_cast<const __half*>(&vr[i]);
#pragma unroll
      for (int e = 0; e < 8; ++e) Vt[(u * 8 + e) * VS + j] = v[e];
    }
  };
  auto ld32 = [](const __half* p) { return *reinterpret_cast<const uint32_t*>(p); };

  float o[HD / 8][4], m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
#pragma unroll
  for (int n = 0; n < HD / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  const int64_t first = lo >= hi ? hi : lo - lo % BC;
  if (first < hi) load(first);
  const __half* q0 = Qs + (warp * 16 + g) * QS + 2 * c;
  for (int64_t j0 = first; j0 < hi; j0 += BC) {
    __syncthreads();  // the previous tile is consumed (the first time: Q is stored)
    store();
    __syncthreads();
    if (j0 + BC < hi) load(j0 + BC);
    float s[BC / 8][4];
#pragma unroll
    for (int n = 0; n < BC / 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
    for (int k0 = 0; k0 < HD; k0 += 16) {
      const uint32_t qa[4] = {ld32(q0 + k0), ld32(q0 + 8 * QS + k0), ld32(q0 + k0 + 8), ld32(q0 + 8 * QS + k0 + 8)};
#pragma unroll
      for (int n = 0; n < BC / 8; ++n) {
        const __half* kp = Ks + (n * 8 + g) * KS + k0 + 2 * c;
        mma_f16(s[n], qa, ld32(kp), ld32(kp + 8));
      }
    }
    // Online softmax: a row's BC scores sit in the 4 lanes of a quad (2 per n-tile each).
    uint32_t ph[BC / 8][2];  // the probabilities in f16 pairs: rows g, g + 8
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int64_t p = pos[hr];
      const int64_t rlo = a.window > 0 ? p - a.window + 1 : INT64_MIN;
      float mx = m[hr];
#pragma unroll
      for (int n = 0; n < BC / 8; ++n)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int64_t j = j0 + n * 8 + 2 * c + e;
          const bool ok = j < hi && j <= p && j >= rlo;
          float& x = s[n][2 * hr + e];
          const float v = a.softcap > 0.f ? a.softcap * tanhf(x / a.softcap) : x;  // (x already scaled)
          x = ok ? v : -INFINITY;
          mx = fmaxf(mx, x);
        }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float corr = mx == -INFINITY ? 1.f : expf(m[hr] - mx);  // m = -inf before any key: 0
      m[hr] = mx;
      l[hr] *= corr;
#pragma unroll
      for (int n = 0; n < HD / 8; ++n) o[n][2 * hr] *= corr, o[n][2 * hr + 1] *= corr;
#pragma unroll
      for (int n = 0; n < BC / 8; ++n) {
        const float p0 = s[n][2 * hr] == -INFINITY ? 0.f : expf(s[n][2 * hr] - mx);
        const float p1 = s[n][2 * hr + 1] == -INFINITY ? 0.f : expf(s[n][2 * hr + 1] - mx);
        ph[n][hr] = h2_bits(p0, p1);
        const float2 r = __half22float2(*reinterpret_cast<const __half2*>(&ph[n][hr]));
        l[hr] += r.x + r.y;
      }
    }
    // O += P V over 16 keys a product: n-tiles 2kk and 2kk + 1 are the A fragment's two halves of k.
#pragma unroll
    for (int kk = 0; kk < BC / 16; ++kk) {
      const uint32_t pa[4] = {ph[2 * kk][0], ph[2 * kk][1], ph[2 * kk + 1][0], ph[2 * kk + 1][1]};
#pragma unroll
      for (int n = 0; n < HD / 8; ++n) {
        const __half* vp = Vt + (n * 8 + g) * VS + kk * 16 + 2 * c;
        mma_f16(o[n], pa, ld32(vp), ld32(vp + 8));
      }
    }
  }
  store_quad_rows<HD>(a, hd, h, t0, warp, g, c, m, l, o);
}

// Whether the tensor-core kernels can take this attention: an f16 cache, head sizes up to 128 (max_hd) in
// whole 16-byte units, every row's slice 16-byte aligned, sm_80+. tc_takes: the TF32 one, unless
// DASLLAMA_CUDA_FLASH_TC=0.
bool tc_fits(const AttnArgs& a, int max_hd = 128) {
  if (!tensor_cores()) return false;
  const size_t al = a.kv.k_off | a.kv.v_off | a.kv.row_bytes | a.kv.page_bytes | (size_t)a.head_dim * 2 |
                    (size_t)(uintptr_t)a.kv.base;
  return a.kv.type == KVType::f16 && a.head_dim > 0 && a.head_dim <= max_hd && a.head_dim % 8 == 0 && al % 16 == 0;
}

bool tc_takes(const AttnArgs& a) {
  const char* e = std::getenv("DASLLAMA_CUDA_FLASH_TC");
  return !(e && std::strcmp(e, "0") == 0) && tc_fits(a);
}

// q8 mode's attention (a.exact false) that the TF32 kernel fits runs on flash_h16_k (H200 pp512:
// Q8_0 55,022 -> 55,770, F16 45,208 -> 46,126); DASLLAMA_CUDA_FLASH_F16=0 keeps the TF32 kernel.
// Read at each call.
bool h16_takes(const AttnArgs& a) {
  const char* e = std::getenv("DASLLAMA_CUDA_FLASH_F16");
  return !(e && e[0] == '0') && !a.exact && tc_fits(a);  // FLASH_TC=0 leaves it on (A/B runs)
}

// Head size 256 (Gemma 2 / 3) on flash_h16_k, 16 keys a tile so the K / V prefetch and the 128
// output floats a lane stay in registers (DASLLAMA_CUDA_FLASH_H256=0, read at each call, keeps
// flash_k's f32 FMAs, where a Gemma-3-270M Q8_0 pp512 spent 7.3 of its 9.4 ms of kernels on the
// H100; with it that pp512 went 51,251 -> 94,132 t/s).
bool h256_takes(const AttnArgs& a) {
  const char* e = std::getenv("DASLLAMA_CUDA_FLASH_H256");
  const char* f = std::getenv("DASLLAMA_CUDA_FLASH_F16");
  return !(e && e[0] == '0') && !(f && f[0] == '0') && !a.exact && a.head_dim > 128 && tc_fits(a, 256);
}

template <int HD, int BC>
bool launch_h16(const AttnArgs& a, cudaStream_t st) {
  using S = H16Shape<HD, BC>;
  static const bool set = cudaFuncSetAttribute(flash_h16_k<HD, BC>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               (int)S::smem) == cudaSuccess;
  if (!set) return false;
  const dim3 grid((unsigned)ceil_div(a.n_tok, S::BR), (unsigned)a.n_heads);
  flash_h16_k<HD, BC><<<grid, 128, S::smem, st>>>(a);
  check_launch("flash attention (f16 mma)");
  return true;
}

template <int HD, int BC>
bool launch_tc(const AttnArgs& a, cudaStream_t st) {
  using S = TcShape<HD, BC>;
  static const bool set = cudaFuncSetAttribute(flash_tc_k<HD, BC>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               (int)S::smem) == cudaSuccess;
  if (!set) return false;
  const dim3 grid((unsigned)ceil_div(a.n_tok, S::BR), (unsigned)a.n_heads);
  flash_tc_k<HD, BC><<<grid, 128, S::smem, st>>>(a);
  check_launch("flash attention (tf32 mma)");
  return true;
}
}  // namespace

bool flash_fits(const AttnArgs& a, int max_smem_optin) {
  const int hd = a.head_dim;
  const size_t smem = (hd <= 64    ? FlashShape<64>::smem_floats
                       : hd <= 96  ? FlashShape<96>::smem_floats
                       : hd <= 128 ? FlashShape<128>::smem_floats
                                   : FlashShape<256>::smem_floats) * sizeof(float);
  return hd > 0 && hd <= 256 && smem <= (size_t)max_smem_optin && a.n_tok <= 65535LL * 32;
}

void flash_attention(const AttnArgs& a, cudaStream_t st) {
  attn_check(a);
  if (a.n_tok <= 0 || a.n_heads <= 0) return;
  // attn_check takes 512 (attn_k's rows); these tiles stop at 256 (flash_fits is the callers' check).
  if (a.head_dim > 256) throw UnsupportedModelError("cuda flash attention: head_dim past 256");
  switch (a.kv.type) {
    case KVType::f32: launch_flash_kt<0>(a, st); break;
    case KVType::f16:
      if (h16_takes(a) && (a.head_dim <= 64 ? launch_h16<64, 64>(a, st) : launch_h16<128, 32>(a, st))) break;
      if (h256_takes(a) && launch_h16<256, 16>(a, st)) break;
      if (tc_takes(a) && (a.head_dim <= 64 ? launch_tc<64, 64>(a, st) : launch_tc<128, 32>(a, st))) break;
      launch_flash_kt<1>(a, st);
      break;
    case KVType::q8_0: launch_flash_kt<8>(a, st); break;
    default: throw UnsupportedModelError("cuda attention: unknown KV type");
  }
}

}  // namespace dl::cuda
