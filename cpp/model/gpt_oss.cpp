// The gpt-oss family: a mixture of experts whose router softmaxes only the k logits it
// picks, biases everywhere (q/k/v/output, router, experts: found from the tensors), the
// clamped SwiGLU, attention sinks (found from the tensors), sliding-window layers
// alternating with full ones (layer 0 sliding), YaRN without a truncated correction range,
// experts in MXFP4 read in place. Its FFN norm is stored as post_attention_norm.
#include "model/arch.h"

namespace dl {
void register_gpt_oss_family() {
  ArchTraits t;
  t.name = "gpt-oss";
  t.rope = RopeType::neox;
  t.act = FfnAct::swiglu_oai;
  t.swa_pattern = 2;
  t.default_rope_base_swa = 0.f;  // one rope base for both kinds of layer
  t.swa_rope_scaled = true;       // YaRN on every layer
  t.moe_gate = MoeGate::softmax_topk;
  t.moe_norm_topk = false;
  t.ffn_norm_tensor = "post_attention_norm";
  t.yarn_truncate = false;
  register_arch(t);
}
}  // namespace dl
