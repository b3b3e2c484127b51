// Byte layouts of the ggml block formats (packed structs, sizes asserted); no code.
// Field order and sizes follow ggml's block_* types; decoders are in dequant_impl.h.
#pragma once
#include <cstdint>

namespace dl::quant {

constexpr int QK4 = 32;   // elements per block of the 32-wide formats
constexpr int QK_K = 256;  // elements per super-block of the k-quants and iq formats
constexpr int K_SCALE_SIZE = 12;

#pragma pack(push, 1)
// f16 fields are kept as raw uint16 bits: conversion is explicit at the use site.
struct block_q4_0 { uint16_t d; uint8_t qs[QK4 / 2]; };
struct block_q4_1 { uint16_t d, m; uint8_t qs[QK4 / 2]; };
struct block_q5_0 { uint16_t d; uint8_t qh[4]; uint8_t qs[QK4 / 2]; };
struct block_q5_1 { uint16_t d, m; uint8_t qh[4]; uint8_t qs[QK4 / 2]; };
struct block_q8_0 { uint16_t d; int8_t qs[QK4]; };
struct block_q2_K { uint8_t scales[QK_K / 16]; uint8_t qs[QK_K / 4]; uint16_t d, dmin; };
struct block_q3_K { uint8_t hmask[QK_K / 8]; uint8_t qs[QK_K / 4]; uint8_t scales[12]; uint16_t d; };
struct block_q4_K { uint16_t d, dmin; uint8_t scales[K_SCALE_SIZE]; uint8_t qs[QK_K / 2]; };
struct block_q5_K { uint16_t d, dmin; uint8_t scales[K_SCALE_SIZE]; uint8_t qh[QK_K / 8]; uint8_t qs[QK_K / 2]; };
struct block_q6_K { uint8_t ql[QK_K / 2]; uint8_t qh[QK_K / 4]; int8_t scales[QK_K / 16]; uint16_t d; };
struct block_q8_K { float d; int8_t qs[QK_K]; int16_t bsums[QK_K / 16]; };
struct block_mxfp4 { uint8_t e; uint8_t qs[QK4 / 2]; };  // e: e8m0 shared exponent
struct block_iq4_nl { uint16_t d; uint8_t qs[QK4 / 2]; };
struct block_iq4_xs { uint16_t d; uint16_t scales_h; uint8_t scales_l[QK_K / 64]; uint8_t qs[QK_K / 2]; };
#pragma pack(pop)

static_assert(sizeof(block_q4_0) == 18);
static_assert(sizeof(block_q4_1) == 20);
static_assert(sizeof(block_q5_0) == 22);
static_assert(sizeof(block_q5_1) == 24);
static_assert(sizeof(block_q8_0) == 34);
static_assert(sizeof(block_q2_K) == 84);
static_assert(sizeof(block_q3_K) == 110);
static_assert(sizeof(block_q4_K) == 144);
static_assert(sizeof(block_q5_K) == 176);
static_assert(sizeof(block_q6_K) == 210);
static_assert(sizeof(block_q8_K) == 292);
static_assert(sizeof(block_mxfp4) == 17);
static_assert(sizeof(block_iq4_nl) == 18);
static_assert(sizeof(block_iq4_xs) == 136);

// Non-linear 4-bit codebooks (iq4_nl / iq4_xs) and e2m1 doubled (mxfp4).
inline constexpr int8_t kvalues_iq4nl[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                             1,    13,   25,  38,  53,  69,  89,  113};
inline constexpr int8_t kvalues_mxfp4[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

}  // namespace dl::quant
