// The gemma family: embeddings scaled by sqrt(dim), GELU(tanh) GLU, sandwich norms
// (found from the tensors); Gemma-2 alternates sliding/global layers and soft-caps
// attention and final logits; Gemma-3 has one global layer in six, QK-norm and a
// local rope base of 10k on sliding layers.
#include "model/arch.h"

namespace dl {
void register_gemma_family() {
  ArchTraits g2;
  g2.name = "gemma2";
  g2.rope = RopeType::neox;
  g2.act = FfnAct::gelu_tanh;
  g2.embed_scale_sqrt_dim = true;
  g2.swa_pattern = 2;
  g2.default_attn_softcap = 50.f;
  g2.default_final_softcap = 30.f;
  g2.default_rope_base_swa = 0.f;  // gemma2 uses one rope base
  g2.default_sliding_window = 4096;
  g2.swa_rope_scaled = true;
  g2.attn_scale_dim_over_heads_at_layers = {46};  // Gemma-2-27B
  g2.spm_gemma = true;
  register_arch(g2);

  ArchTraits g3 = g2;
  g3.name = "gemma3";
  g3.swa_pattern = 6;
  g3.default_attn_softcap = 0.f;
  g3.default_final_softcap = 0.f;
  g3.default_rope_base_swa = 10000.f;
  g3.default_sliding_window = 0;
  g3.swa_rope_scaled = false;
  g3.attn_scale_dim_over_heads_at_layers = {62};  // Gemma-3-27B
  register_arch(g3);

  // Gemma-4: what changes from Gemma-3 is read from the file where it can be -- per-layer head
  // dims (key_length / key_length_swa), kv heads, FFN widths and rope dims, the sliding-layer
  // pattern as an array, a global layer without attn_v (its values are its keys' projection),
  // per-layer output scales, the E-series' per-layer embeddings and KV shared across layers
  // (shared_kv_layers). As traits: unscaled attention scores, values RMS-normed without
  // weights, and rope_freqs (proportional rope) on the global layers only.
  ArchTraits g4 = g3;
  g4.name = "gemma4";
  g4.default_rope_base_swa = 10000.f;
  g4.attn_scale_dim_over_heads_at_layers = {};
  g4.attn_unscaled = true;
  g4.v_norm = true;
  g4.rope_freqs_global_only = true;
  // The 26B-A4B's experts: softmax router, top-k renormalized (then a per-expert scale, and a dense
  // MLP beside them: found from the tensors).
  g4.moe_gate = MoeGate::softmax;
  g4.moe_norm_topk = true;
  register_arch(g4);
}
}  // namespace dl
