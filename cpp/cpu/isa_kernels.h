// Kernels defined once per ISA, in namespace dl::cpu::<DL_ISA>. Each *_isa.cpp
// defines some of them; table_isa.cpp puts them in the table.
#pragma once
#include <cstddef>
#include <cstdint>

#include "cpu/kernels.h"

#ifndef DL_ISA
#error "isa_kernels.h is included only by *_isa.cpp files, compiled with -DDL_ISA=<name>"
#endif

namespace dl::cpu {
struct MatmulArgs;
}
namespace dl::cpu::DL_ISA {
using dl::cpu::MatmulArgs;

bool dequant_row(uint32_t type, const void* src, float* dst, int64_t n);

// matmul_isa.cpp
uint32_t act_type(uint32_t wtype);
void quantize_act(uint32_t act_type, const float* x, void* dst, int64_t n);
void matmul_rows(const MatmulArgs& a, int64_t r0, int64_t r1);
float dot_f32(const float* a, const float* b, int64_t n);
void attn_block(const AttnBlock& b);
void attn_kv_f32(const AttnBlock& b, int64_t j0, int64_t j1, float* kt, float* v);
void attn_combine(const float* part, int64_t n_chunks, int hd, const float* sink, float* out);
void glu_f32(const float* gate, const float* up, float* out, int64_t n, int act);
void gelu_erf_f32(float* y, int64_t n);

// vec_isa.cpp
void layer_norm_row(const float* x, const float* w, const float* b, float* y, int64_t dim, float eps);
void f16_to_f32(const uint16_t* src, float* dst, int64_t n);

// delta_isa.cpp
void delta_chunked_head(const DeltaRuleArgs& a, int64_t h, DeltaScratch& scratch);
void f32_to_f16(const float* src, uint16_t* dst, int64_t n);
size_t attn_block_scratch(int64_t n_rows, int group, int head_dim, int64_t n_kv);

// dense_attn_isa.cpp
void dense_attn_pack_k(const float* k, int64_t k_stride, int64_t n_kv, int hd, int64_t b0, int64_t b1, float* kt);
size_t dense_attn_scratch(int64_t n_rows, int64_t n_kv, int hd);
void dense_attn_rows(const DenseAttn& a);

// packed_isa.cpp
size_t pack_bytes(uint32_t wtype, int64_t rows, int64_t k);
void pack_rows(uint32_t wtype, const void* w, size_t row_bytes, int64_t rows, int64_t k, int64_t g0, int64_t g1,
               void* out);
bool matmul_packed(const MatmulArgs& a, int64_t r0, int64_t r1);

}  // namespace dl::cpu::DL_ISA
