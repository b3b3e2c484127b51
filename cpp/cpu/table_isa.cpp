// Fills the kernel table of the ISA this translation unit is compiled for (DL_ISA).
#include "cpu/isa_impl.h"
#include "cpu/isa_kernels.h"

namespace dl::cpu::DL_ISA {

void fill_table(KernelTable& t) {
  t.dequant_row = &dequant_row;
  t.act_type = &act_type;
  t.quantize_act = &quantize_act;
  t.matmul_rows = &matmul_rows;
  t.dot_f32 = &dot_f32;
  t.attn_block = &attn_block;
  t.attn_combine = &attn_combine;
  t.glu_f32 = &glu_f32;
  t.gelu_erf_f32 = &gelu_erf_f32;
  t.layer_norm_row = &layer_norm_row;
  t.f16_to_f32 = &f16_to_f32;
  t.f32_to_f16 = &f32_to_f16;
  t.attn_block_scratch = &attn_block_scratch;
  t.pack_bytes = &pack_bytes;
  t.pack_rows = &pack_rows;
  t.delta_chunked_head = &delta_chunked_head;
#if defined(__AVX512F__)
  t.attn_kv_f32 = &attn_kv_f32;
  t.dense_attn_pack_k = &dense_attn_pack_k;
  t.dense_attn_rows = &dense_attn_rows;
  t.dense_attn_scratch = &dense_attn_scratch;
#endif
}

}  // namespace dl::cpu::DL_ISA
