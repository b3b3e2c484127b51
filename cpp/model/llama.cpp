// The llama family: Llama-2/3.x, TinyLlama, Mistral, SmolLM2. The GGUF converter
// permutes Q/K for adjacent-pair RoPE; llama3 frequency factors come as rope_freqs.
#include "model/arch.h"

namespace dl {
void register_llama_family() {
  ArchTraits t;
  t.name = "llama";
  t.rope = RopeType::norm;
  t.act = FfnAct::silu;
  register_arch(t);
}
}  // namespace dl
