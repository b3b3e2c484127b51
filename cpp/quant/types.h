// The ggml tensor type ids, their block geometry and names. Knows no kernels.
#pragma once
#include <cstdint>

namespace dl {

// Ids as stored in GGUF tensor infos (ggml's enum); gaps are retired ids.
enum class GGMLType : uint32_t {
  F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q8_1 = 9,
  Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14, Q8_K = 15,
  IQ2_XXS = 16, IQ2_XS = 17, IQ3_XXS = 18, IQ1_S = 19, IQ4_NL = 20, IQ3_S = 21, IQ2_S = 22, IQ4_XS = 23,
  I8 = 24, I16 = 25, I32 = 26, I64 = 27, F64 = 28, IQ1_M = 29, BF16 = 30,
  TQ1_0 = 34, TQ2_0 = 35, MXFP4 = 39, NVFP4 = 40, Q1_0 = 41,
};

struct TypeTraits {
  const char* name;      // lower-case, as gguf-py / llama.cpp print it ("q4_K")
  int64_t block_size;    // elements per block
  int64_t type_size;     // bytes per block
  bool dequantizable;    // dl::dequantize_row supports it
};

// nullptr for an id that is not a known ggml type.
const TypeTraits* type_traits(uint32_t type_id);

// Bytes taken by n elements of a type, or -1 if n is not a whole number of
// blocks or the type id is unknown. n must be non-negative.
int64_t type_nbytes(uint32_t type_id, int64_t n);

}  // namespace dl
