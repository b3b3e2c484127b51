// The qwen family: Qwen2/2.5 (q/k/v biases, found from the tensors) and Qwen3 (QK-norm).
#include "model/arch.h"

namespace dl {
void register_qwen_family() {
  for (const char* name : {"qwen2", "qwen3"}) {
    ArchTraits t;
    t.name = name;
    t.rope = RopeType::neox;
    t.act = FfnAct::silu;
    register_arch(t);
  }
}
}  // namespace dl
