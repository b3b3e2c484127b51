// The qwen family: Qwen2/2.5 (q/k/v biases, found from the tensors) and Qwen3 (QK-norm);
// their mixtures of experts: Qwen2-MoE / Qwen1.5-MoE (softmax router, top-k weights as they
// are, a shared expert behind a sigmoid gate, found from the tensors) and Qwen3-MoE
// (softmax router, top-k weights renormalized, no shared expert); the Qwen3.5 and Qwen3-Next hybrids;
// the Qwen2.5-VL / Qwen3-VL text models (M-RoPE), whose qwen3vl also carries Qwen3-ASR's decoder.
#include "model/arch.h"

namespace dl {
void register_qwen_family() {
  // qwen2vl: the Qwen2-VL / Qwen2.5-VL text model (a qwen2 whose rope is M-RoPE by sections);
  // qwen3vl: Qwen3-VL's (a qwen3 with interleaved M-RoPE), which llama.cpp's converter also writes
  // for Qwen3-ASR's decoder: with 1-D positions (text and audio spans) every section turns with the
  // same position, which is plain neox rope.
  for (const char* name : {"qwen2", "qwen3", "qwen2vl", "qwen3vl"}) {
    ArchTraits t;
    t.name = name;
    t.rope = RopeType::neox;
    t.act = FfnAct::silu;
    t.mrope_interleaved = std::string(name) == "qwen3vl";
    register_arch(t);
  }
  ArchTraits m;
  m.name = "qwen2moe";
  m.rope = RopeType::neox;
  m.act = FfnAct::silu;
  m.moe_gate = MoeGate::softmax;
  m.moe_norm_topk = false;
  register_arch(m);
  m.name = "qwen3moe";
  m.moe_norm_topk = true;
  register_arch(m);
  // Qwen3.5 (dense): gated-DeltaNet layers (which ones: the file's recurrent_layers) between
  // full-attention layers whose queries carry an output gate; QK-norm, partial neox rope (its
  // M-RoPE sections coincide with plain rope for text); the FFN norm is stored as
  // post_attention_norm.
  ArchTraits h;
  h.name = "qwen35";
  h.rope = RopeType::neox;
  h.act = FfnAct::silu;
  h.attn_output_gate = true;
  h.ffn_norm_tensor = "post_attention_norm";
  h.mrope_interleaved = true;
  register_arch(h);
  // Qwen3-Next: the same hybrid with a mixture of experts (softmax router, top-k renormalized, a
  // shared expert behind its sigmoid gate); its value heads stay grouped by key head, and beta and
  // alpha come as one interleaved projection (ssm_ba).
  // Qwen3.5-MoE: Qwen3.5's hybrid (separate beta and alpha, value heads tiled by the converter) with
  // Qwen3-Next's mixture of experts (softmax router, top-k renormalized, a gated shared expert).
  ArchTraits hm = h;
  hm.name = "qwen35moe";
  hm.moe_gate = MoeGate::softmax;
  hm.moe_norm_topk = true;
  register_arch(hm);
  h.name = "qwen3next";
  h.moe_gate = MoeGate::softmax;
  h.moe_norm_topk = true;
  h.ssm_v_grouped = true;
  register_arch(h);
}
}  // namespace dl
