// The phi family: Phi-3/3.5 (fused qkv and gate|up projections, found from the tensors).
#include "model/arch.h"

namespace dl {
void register_phi_family() {
  ArchTraits t;
  t.name = "phi3";
  t.rope = RopeType::neox;
  t.act = FfnAct::silu;
  register_arch(t);
}
}  // namespace dl
