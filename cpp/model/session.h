// One generation stream over a model: its KV cache (flat, per layer), position
// and the logits of the last evaluation. Used by one thread at a time.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "core/backend.h"
#include "sample/sampler.h"

namespace dl {

class Model;

struct GenStats {
  int64_t n_prompt = 0, n_gen = 0;
  double ttft_s = 0, prefill_tps = 0, gen_tps = 0;
};

class Session {
 public:
  Session(std::shared_ptr<Model> model, KVType kv_type, int n_ctx);

  Model& model() { return *model_; }
  std::shared_ptr<Model> model_ptr() const { return model_; }
  int64_t n_past() const { return n_past_; }
  int64_t n_ctx() const { return n_ctx_; }
  KVType kv_type() const { return kv_type_; }
  // Rewinds to n (<= n_past), dropping later positions.
  void truncate(int64_t n);

  std::vector<float> logits;      // [n_vocab] of the last row (or [n][n_vocab] with all_logits)
  std::vector<int32_t> history;   // tokens evaluated so far (media rows as negative ids)
  GenStats stats;
  Rng rng;
  std::vector<float> sample_scratch;

  // Cache row pointers for layer l.
  uint8_t* k_layer(int l) { return k_.data() + (size_t)l * layer_bytes_k_; }
  uint8_t* v_layer(int l) { return v_.data() + (size_t)l * layer_bytes_v_; }
  size_t k_row_bytes() const { return k_row_bytes_; }
  size_t v_row_bytes() const { return v_row_bytes_; }

 private:
  friend class Model;
  std::shared_ptr<Model> model_;
  KVType kv_type_;
  int64_t n_ctx_;
  int64_t n_past_ = 0;
  size_t k_row_bytes_ = 0, v_row_bytes_ = 0, layer_bytes_k_ = 0, layer_bytes_v_ = 0;
  std::vector<uint8_t> k_, v_;
};

}  // namespace dl
