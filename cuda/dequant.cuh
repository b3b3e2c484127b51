// Device decoders of the ggml weight formats: 8 consecutive elements of a row at a time,
// the same values as cpp/quant/dequant_impl.h (products rounded on their own, no FMA).
#pragma once
#include <cstdint>

#include "common.cuh"
#include "quant/quant.h"

namespace dl::cuda {

// GGML type ids served by matmul / get_rows (cpp/quant/types.h).
enum : uint32_t { T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8,
                  T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14, T_BF16 = 30, T_MXFP4 = 39 };
// This backend's own layouts of q8_0 / q4_0 ("split"): each row holds its quants first
// (cols bytes / cols / 2 bytes, in block order), then its blocks' f16 scales, padded to
// 16 bytes; so a lane reads 16 or 32 weights with one aligned 16-byte load.
enum : uint32_t { T_Q8_0S = 200, T_Q4_0S = 201 };

// Elements per block and bytes per block of each served type.
template <uint32_t T> struct Blk;
template <> struct Blk<T_F32> { static constexpr int qk = 1, bytes = 4; };
template <> struct Blk<T_F16> { static constexpr int qk = 1, bytes = 2; };
template <> struct Blk<T_BF16> { static constexpr int qk = 1, bytes = 2; };
template <> struct Blk<T_Q4_0> { static constexpr int qk = 32, bytes = 18; };
template <> struct Blk<T_Q4_1> { static constexpr int qk = 32, bytes = 20; };
template <> struct Blk<T_Q5_0> { static constexpr int qk = 32, bytes = 22; };
template <> struct Blk<T_Q5_1> { static constexpr int qk = 32, bytes = 24; };
template <> struct Blk<T_Q8_0> { static constexpr int qk = 32, bytes = 34; };
template <> struct Blk<T_Q4_K> { static constexpr int qk = 256, bytes = 144; };
template <> struct Blk<T_Q5_K> { static constexpr int qk = 256, bytes = 176; };
template <> struct Blk<T_Q6_K> { static constexpr int qk = 256, bytes = 210; };
template <> struct Blk<T_Q8_0S> { static constexpr int qk = 32, bytes = 34; };
template <> struct Blk<T_Q4_0S> { static constexpr int qk = 32, bytes = 18; };

// Sub-block j's 6-bit scale and min of a q4_K / q5_K block (their 12 packed scale bytes at s).
__device__ __forceinline__ void k_scale_min(const uint8_t* s, int j, int& sc, int& mn) {
  if (j < 4) {
    sc = s[j] & 0x3F;
    mn = s[j + 4] & 0x3F;
  } else {
    sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 2) & 0x30);
    mn = (s[j + 4] >> 4) | ((s[j] >> 2) & 0x30);
  }
}

// Byte i (0-11) of a q4_K / q5_K block's scales (header words y, z, w), and k_scale_min over them
// (the int8 K-quant kernels read the header as one 16-byte load).
__device__ __forceinline__ int k_sbyte(const uint4& h, int i) {
  const uint32_t w = i < 4 ? h.y : i < 8 ? h.z : h.w;
  return (int)((w >> (8 * (i & 3))) & 0xFFu);
}
__device__ __forceinline__ void k_scale_min_r(const uint4& h, int j, int& sc, int& mn) {
  if (j < 4) {
    sc = k_sbyte(h, j) & 0x3F;
    mn = k_sbyte(h, j + 4) & 0x3F;
  } else {
    sc = (k_sbyte(h, j + 4) & 0xF) | ((k_sbyte(h, j - 4) >> 2) & 0x30);
    mn = (k_sbyte(h, j + 4) >> 4) | ((k_sbyte(h, j) >> 2) & 0x30);
  }
}

// An int of magnitude < 2^22 as a float, exactly, without the quarter-rate I2F
// conversion: the int lands in the mantissa of 1.5 * 2^23, which is then subtracted.
__device__ __forceinline__ float sf(int v) { return __int_as_float(0x4B400000 + v) - 12582912.f; }
template <> struct Blk<T_MXFP4> { static constexpr int qk = 32, bytes = 17; };

// mxfp4's e2m1 codebook, doubled ({0, 1, 2, 3, 4, 6, 8, 12}, bit 3 the sign), and its e8m0 scale
// halved to match (cpp/quant/dequant_impl.h's e8m0_half, bit for bit).
__device__ __forceinline__ float e2m1x2(uint32_t n) {
  const uint32_t m = n & 7;
  const int a = m <= 4 ? (int)m : m == 5 ? 6 : m == 6 ? 8 : 12;
  return (float)((n & 8) ? -a : a);
}
__device__ __forceinline__ float e8m0_half(uint32_t e) {
  return __uint_as_float(e < 2 ? 0x00200000u << e : (e - 1) << 23);
}

// Elements 8g..8g+7 of `row` into v. Float types may have cols % 8 != 0: elements past
// cols read as 0; `vec` (cols % 8 == 0 and the row 16-byte aligned) allows 16-byte loads.
// Quantized rows are whole blocks (cols a multiple of 32 or 256), so no check there.
template <uint32_t T>
__device__ __forceinline__ void dq8(const uint8_t* __restrict__ row, int64_t g, int64_t cols, bool vec, float v[8]) {
  const int64_t e0 = g * 8;
  if constexpr (T == T_F32) {
    const float* p = reinterpret_cast<const float*>(row) + e0;
    if (vec) {
      const float4 a = __ldg(reinterpret_cast<const float4*>(p)), b = __ldg(reinterpret_cast<const float4*>(p) + 1);
      v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) v[i] = e0 + i < cols ? p[i] : 0.f;
    }
  } else if constexpr (T == T_F16 || T == T_BF16) {
    const uint16_t* p = reinterpret_cast<const uint16_t*>(row) + e0;
    if (vec) {
      const uint4 u = __ldg(reinterpret_cast<const uint4*>(p));
      const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        if constexpr (T == T_F16) {
          v[2 * i] = h2f((uint16_t)(w[i] & 0xffff));
          v[2 * i + 1] = h2f((uint16_t)(w[i] >> 16));
        } else {
          v[2 * i] = __uint_as_float(w[i] << 16);
          v[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
        }
      }
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const uint16_t h = e0 + i < cols ? p[i] : 0;
        v[i] = T == T_F16 ? h2f(h) : bf2f(h);
      }
    }
  } else if constexpr (T == T_Q8_0S) {
    const uint2 q = *reinterpret_cast<const uint2*>(row + e0);
    const float d = h2f(ld16(row + cols + (g >> 2) * 2));
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = __fmul_rn(sf((int8_t)((i < 4 ? q.x : q.y) >> (8 * (i & 3)))), d);
  } else if constexpr (T == T_Q4_0S) {
    const int64_t b = g >> 2;
    const int o = (int)(g & 3) * 8;
    const uint2 q = *reinterpret_cast<const uint2*>(row + b * 16 + (o & 15));
    const float d = h2f(ld16(row + cols / 2 + b * 2));
    const int sh = (o >> 4) * 4;
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = __fmul_rn(d, sf((int)(((i < 4 ? q.x : q.y) >> (8 * (i & 3) + sh)) & 0xF) - 8));
  } else if constexpr (T == T_Q8_0) {
    const uint8_t* b = row + (g >> 2) * 34;
    const float d = h2f(ld16(b));
    const uint8_t* q = b + 2 + (g & 3) * 8;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint32_t w = ld16(q + 2 * i);
      v[2 * i] = __fmul_rn(sf((int8_t)(w & 0xff)), d);
      v[2 * i + 1] = __fmul_rn(sf((int8_t)(w >> 8)), d);
    }
  } else if constexpr (T == T_MXFP4) {
    const uint8_t* b = row + (g >> 2) * 17;
    const float d = e8m0_half(b[0]);
    const int o = (int)(g & 3) * 8;  // first element inside the block; 16..31 are the high nibbles
    const uint8_t* q = b + 1 + (o & 15);
    const int sh = (o >> 4) * 4;
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = __fmul_rn(d, e2m1x2((q[i] >> sh) & 0xF));
  } else if constexpr (T == T_Q4_0 || T == T_Q4_1 || T == T_Q5_0 || T == T_Q5_1) {
    constexpr bool has_m = T == T_Q4_1 || T == T_Q5_1;
    constexpr bool five = T == T_Q5_0 || T == T_Q5_1;
    constexpr int qs_off = T == T_Q4_0 ? 2 : T == T_Q4_1 ? 4 : T == T_Q5_0 ? 6 : 8;
    const uint8_t* b = row + (g >> 2) * Blk<T>::bytes;
    const float d = h2f(ld16(b));
    const float m = has_m ? h2f(ld16(b + 2)) : 0.f;
    const int o = (int)(g & 3) * 8;  // first element inside the block
    const uint8_t* q = b + qs_off + (o & 15);
    const int sh = (o >> 4) * 4;      // elements 16..31 are the high nibbles
    uint32_t qh = 0;
    if constexpr (five) {
      const uint8_t* h = b + (has_m ? 4 : 2);
      qh = (ld16(h) | ld16(h + 2) << 16) >> o;
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint32_t w = ld16(q + 2 * i);
      int lo = (w >> sh) & 0xF, hi = (w >> (8 + sh)) & 0xF;
      if constexpr (five) {
        lo |= ((qh >> (2 * i)) & 1) << 4;
        hi |= ((qh >> (2 * i + 1)) & 1) << 4;
      }
      if constexpr (has_m) {
        v[2 * i] = __fmul_rn(d, sf(lo)) + m;
        v[2 * i + 1] = __fmul_rn(d, sf(hi)) + m;
      } else {
        constexpr int off = five ? 16 : 8;
        v[2 * i] = __fmul_rn(d, sf(lo - off));
        v[2 * i + 1] = __fmul_rn(d, sf(hi - off));
      }
    }
  } else if constexpr (T == T_Q4_K || T == T_Q5_K) {
    const uint8_t* b = row + (g >> 5) * Blk<T>::bytes;
    const int e = (int)(g & 31) * 8;
    const int j = e >> 5, l0 = e & 31;
    const float d = h2f(ld16(b)), dmin = h2f(ld16(b + 2));
    int sc, mn;
    k_scale_min(b + 4, j, sc, mn);
    const float dl = __fmul_rn(d, (float)sc), ml = __fmul_rn(dmin, (float)mn);
    constexpr int qs_off = T == T_Q4_K ? 16 : 48;
    const uint2 qw = *reinterpret_cast<const uint2*>(b + qs_off + (j >> 1) * 32 + l0);  // 8-aligned
    const int sh = (j & 1) * 4;
    uint2 hw = make_uint2(0, 0);
    if constexpr (T == T_Q5_K) hw = *reinterpret_cast<const uint2*>(b + 16 + l0);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const uint32_t w = i < 4 ? qw.x : qw.y;
      int q = (w >> (8 * (i & 3) + sh)) & 0xF;
      if constexpr (T == T_Q5_K) q |= (((i < 4 ? hw.x : hw.y) >> (8 * (i & 3) + j)) & 1) << 4;
      v[i] = __fmul_rn(dl, sf(q)) - ml;
    }
  } else if constexpr (T == T_Q6_K) {
    const uint8_t* b = row + (g >> 5) * 210;
    const int e = (int)(g & 31) * 8;
    const int h = e >> 7, s = (e >> 5) & 3, l0 = e & 31;
    const float d = h2f(ld16(b + 208));
    const float dl = __fmul_rn(d, (float)(int8_t)b[192 + (e >> 4)]);
    const uint8_t* ql = b + h * 64 + (s & 1) * 32 + l0;
    const uint8_t* qh = b + 128 + h * 32 + l0;
    const int shl = (s >> 1) * 4, shh = 2 * s;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint32_t wl = ld16(ql + 2 * i), wh = ld16(qh + 2 * i);
      const int q0 = (int)(((wl >> shl) & 0xF) | ((wh >> shh) & 3) << 4) - 32;
      const int q1 = (int)(((wl >> (8 + shl)) & 0xF) | ((wh >> (8 + shh)) & 3) << 4) - 32;
      v[2 * i] = __fmul_rn(dl, sf(q0));
      v[2 * i + 1] = __fmul_rn(dl, sf(q1));
    }
  }
}

// X(T) for every served type id: a switch over weight types is `switch (t) { DL_CUDA_TYPES(CASE) }`.
#define DL_CUDA_TYPES(X) \
  X(T_F32) X(T_F16) X(T_BF16) X(T_Q8_0) X(T_Q4_0) X(T_Q4_1) X(T_Q5_0) X(T_Q5_1) X(T_Q4_K) X(T_Q5_K) X(T_Q6_K) \
  X(T_MXFP4)

// Every layout a kernel reads: the served types and this backend's own.
#define DL_CUDA_LAYOUTS(X) DL_CUDA_TYPES(X) X(T_Q8_0S) X(T_Q4_0S)

// Bytes of a row of `cols` in this backend's split layout of `type` (0: none).
inline size_t split_row_bytes(uint32_t type, int64_t cols) { return dl::split_row_bytes(type, cols); }

inline bool served_type(uint32_t t) {
  switch (t) {
#define DL_CASE(T) case T:
    DL_CUDA_TYPES(DL_CASE)
#undef DL_CASE
    return true;
  }
  return false;
}

}  // namespace dl::cuda
