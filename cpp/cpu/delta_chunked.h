// The gated delta rule in its chunked form (DeltaRuleArgs::chunked), one value head at a time.
#pragma once

#include <vector>

#include "core/backend.h"

namespace dl::cpu {

// Per-worker scratch, grown on first use.
struct DeltaScratch {
  std::vector<float> buf;
};

// Runs value head h of `a` over all a.n tokens in chunks of kDeltaChunk, updating its state.
void delta_chunked_head(const DeltaRuleArgs& a, int64_t h, DeltaScratch& scratch);

}  // namespace dl::cpu
