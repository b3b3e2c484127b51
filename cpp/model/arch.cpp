// The registry of families: filled once, explicitly (static initializers in a
// static library would be dropped by the linker).
#include "model/arch.h"

#include <mutex>

namespace dl {

namespace {
std::vector<ArchTraits>& table() {
  static std::vector<ArchTraits> t;
  return t;
}
void ensure_registered() {
  static std::once_flag once;
  std::call_once(once, [] {
    register_llama_family();
    register_qwen_family();
    register_gemma_family();
    register_phi_family();
    register_gpt_oss_family();
  });
}
}  // namespace

void register_arch(const ArchTraits& t) { table().push_back(t); }

const ArchTraits* find_arch(const std::string& name) {
  ensure_registered();
  for (const ArchTraits& t : table())
    if (t.name == name) return &t;
  return nullptr;
}

const std::vector<TurnEnd>& turn_end_tokens() {
  static const std::vector<TurnEnd> t = {
      {"<|im_end|>", "ChatML (Qwen, SmolLM)"},
      {"<end_of_turn>", "Gemma"},
      {"<turn|>", "Gemma 4"},
      {"<|eot_id|>", "Llama 3"},
      {"<|eom_id|>", "Llama 3 (tool call)"},
      {"<|end|>", "Phi-3, harmony (gpt-oss)"},
      {"<|endoftext|>", "GPT-2 style end of text (Qwen, Phi)"},
      {"<|return|>", "harmony (final answer)"},
      {"<|call|>", "harmony (tool call)"},
      {"</s>", "SentencePiece end of sequence (Llama 2, Mistral)"},
  };
  return t;
}

std::vector<std::string> registered_archs() {
  ensure_registered();
  std::vector<std::string> v;
  for (const ArchTraits& t : table()) v.push_back(t.name);
  return v;
}

}  // namespace dl
