// The architecture registry: each family registers its quirks once, as data, and the
// turn-closing control tokens of the chat formats we know sit in one table beside it.
// The shared decoder (model/decoder.cpp), the loader and the tokenizer's builder read
// these; nothing on a shared path tests a family or vendor name.
#pragma once
#include <string>
#include <vector>

#include "core/backend.h"

namespace dl {

enum class RopeType { norm, neox };  // adjacent pairs (llama GGUF layout) / split halves
enum class FfnAct { silu, gelu_tanh, swiglu_oai };  // swiglu_oai: gpt-oss's clamped SwiGLU

struct ArchTraits {
  std::string name;               // general.architecture
  RopeType rope = RopeType::neox;
  FfnAct act = FfnAct::silu;
  bool embed_scale_sqrt_dim = false;  // gemma: embeddings times sqrt(dim)
  int swa_pattern = 0;                // n: layer il is sliding unless il % n == n - 1 (0: all dense)
  float default_attn_softcap = 0.f;   // used when the metadata key is absent
  float default_final_softcap = 0.f;
  float default_rope_base_swa = 10000.f;  // local rope base of sliding layers
  int default_sliding_window = 0;         // used when attention.sliding_window is absent
  // Sliding layers rope with the global linear scaling too (gemma2); otherwise unscaled
  // (gemma3 4B+ scale only their global layers), as llama.cpp's rope_freq_scale_train_swa.
  bool swa_rope_scaled = false;
  // Block counts of the models that scale queries by 1/sqrt(dim/n_heads) instead of
  // 1/sqrt(head_dim) (the gemma 27Bs); GGUF has no key for it, llama.cpp goes by depth too.
  std::vector<int> attn_scale_dim_over_heads_at_layers;
  // A SentencePiece vocabulary of this family is Gemma's as transformers builds it: merges
  // ranked by token order (not scores), runs of spaces spelled with "\u2581".
  bool spm_gemma = false;
  // Mixture of experts (layers that carry ffn_*_exps tensors): how the router weighs the
  // experts it picks, and whether the k weights are renormalized to sum to one (the
  // default when the file has no expert_weights_norm key).
  MoeGate moe_gate = MoeGate::softmax;
  bool moe_norm_topk = false;
  // The FFN's input norm tensor (gpt-oss names it post_attention_norm, then it is no
  // attention post-norm).
  std::string ffn_norm_tensor = "ffn_norm";
  // YaRN's correction range rounded out to whole dims (transformers' truncate, its default);
  // gpt-oss trains without.
  bool yarn_truncate = true;
  // The query projection carries a gate per head ([q | gate] for each head, 2 head_dim rows):
  // the attention's output is multiplied by sigmoid(gate) before the output projection.
  bool attn_output_gate = false;
  // Gated-DeltaNet value heads grouped by key head (head h reads key head h / (n_v / n_k)), as
  // Qwen3-Next files keep them; otherwise tiled (h % n_k), as the converter writes Qwen3.5.
  bool ssm_v_grouped = false;
  // M-RoPE sections interleaved over the pairs (t h w t h w ..., Qwen3-VL) rather than one run
  // per axis (t..t h..h w..w, Qwen2-VL / 2.5-VL).
  bool mrope_interleaved = false;
  // Attention scores are not scaled (the QK norms carry the scale: gemma4); else 1/sqrt(head_dim).
  bool attn_unscaled = false;
  // Values go through an RMS norm without weights before the cache (gemma4).
  bool v_norm = false;
  // rope_freqs (per-pair divisors) apply to the global layers only; sliding layers rope plainly
  // (gemma4's proportional rope on its full-attention layers).
  bool rope_freqs_global_only = false;
};

// A control token that closes a turn in a chat format (ChatML's <|im_end|>, ...). A
// vocabulary that holds one as a CONTROL token ends generation there whatever the family,
// as llama.cpp's vocabulary does: formats travel between families (SmolLM2 is a llama
// with ChatML turns), so this is a table of formats, not a family trait.
struct TurnEnd {
  const char* text;
  const char* format;  // who closes turns with it (for the reader)
};
const std::vector<TurnEnd>& turn_end_tokens();

void register_arch(const ArchTraits& t);
// nullptr if no family registered the name.
const ArchTraits* find_arch(const std::string& name);
std::vector<std::string> registered_archs();

// One per family file (model/llama.cpp, qwen.cpp, gemma.cpp, phi.cpp).
void register_llama_family();
void register_qwen_family();
void register_gemma_family();
void register_phi_family();
void register_gpt_oss_family();

}  // namespace dl
