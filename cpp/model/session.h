// One generation stream over a model: its KV cache (a block table, flat or over a
// paged pool), position and the logits of the last evaluation. Used by one thread at a time.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/backend.h"
#include "kv/pool.h"
#include "sample/sampler.h"

namespace dl {

class Model;
class PrefixCache;

struct GenStats {
  int64_t n_prompt = 0, n_gen = 0;
  double ttft_s = 0, prefill_tps = 0, gen_tps = 0;
};

class Session {
 public:
  Session(std::shared_ptr<Model> model, KVType kv_type, int n_ctx);
  // A paged session: pages come from `pool` as rows are written (n_ctx 0: seq_len).
  Session(std::shared_ptr<Model> model, std::shared_ptr<KVPool> pool, int n_ctx);

  Model& model() { return *model_; }
  std::shared_ptr<Model> model_ptr() const { return model_; }
  int64_t n_past() const { return n_past_; }
  int64_t n_ctx() const { return n_ctx_; }
  KVType kv_type() const { return kv_type_; }
  // Rewinds to n (<= n_past), dropping later positions (and the pages past them).
  void truncate(int64_t n);
  // Returns every KV page to the pool and starts over at position 0.
  void release_pages();
  // Sets the position after a prefix cache attach (pages already in the table).
  void set_attached(int64_t n, const int32_t* ids);
  // The position at or before n (<= n_past) that truncate can rewind to: n itself when the
  // model keeps only KV; for a model with recurrent layers, the latest position <= n whose
  // recurrent state the session still has (0, n_past, or a snapshot).
  int64_t rewind_point(int64_t n) const;

  // The recurrent layers' state (backend memory; null for a model without them): per layer
  // (rec_slot order) rec_state_floats floats, zero at position 0.
  float* recurrent_state() const { return rstate_ ? static_cast<float*>(rstate_->data()) : nullptr; }
  // Snapshots of that state (position, copy), taken by eval at the end of each prefill and at
  // the page boundaries it crosses; truncate rewinds to them and the prefix cache keeps the
  // page-aligned ones. At most kMaxSnapshots per session, the oldest dropped first.
  static constexpr int kMaxSnapshots = 4;
  void snapshot();
  const std::vector<std::pair<int64_t, BufferPtr>>& snapshots() const { return snaps_; }

  // [n_vocab] of the last row (or [n][n_vocab] with all_logits). After an eval_batch step the
  // row may still sit in the step's host block (lazy_): logits_ready() copies it in first, and
  // last_logits() reads the last row wherever it is. Readers of `logits` call one of them.
  std::vector<float> logits;
  std::vector<float>& logits_ready() {
    if (lazy_) logits.assign(lazy_, lazy_ + lazy_n_), drop_lazy_logits();
    return logits;
  }
  const float* last_logits(int64_t V) const {
    return lazy_ ? lazy_ : logits.size() >= (size_t)V ? logits.data() + (logits.size() - V) : nullptr;
  }
  bool has_logits() const { return lazy_ || !logits.empty(); }
  void drop_lazy_logits() { lazy_block_.reset(), lazy_ = nullptr, lazy_n_ = 0; }
  std::vector<int32_t> history;   // tokens evaluated so far (media rows as negative ids)
  // M-RoPE position marks, ascending: (p, delta) says rows at positions >= p rope at their
  // position + delta (the last mark at or before a row wins; none: delta 0). An image's rows take
  // a grid of positions and advance the rope position by max(grid_h, grid_w), not by its rows;
  // forward_mrope adds the mark, truncate drops the marks past the new end, and a caller that
  // attaches a cached prefix restores the ones inside it.
  std::vector<std::pair<int64_t, int64_t>> rope_marks;
  int64_t rope_delta(int64_t pos) const {
    for (auto it = rope_marks.rbegin(); it != rope_marks.rend(); ++it)
      if (it->first <= pos) return it->second;
    return 0;
  }
  GenStats stats;
  Rng rng;
  std::vector<float> sample_scratch;

  BlockTable& kv() { return *kv_; }
  const BlockTable& kv() const { return *kv_; }

 private:
  friend class Model;
  friend int64_t prefix_attach(PrefixCache& cache, Session& s, const std::vector<int32_t>& prompt);
  std::shared_ptr<Model> model_;
  // Unique over the process: a speculated step (Model::speculate) names its sessions by it too,
  // since a new session may take a freed one's address.
  const uint64_t serial_ = next_serial();
  static uint64_t next_serial();
  KVType kv_type_;
  int64_t n_ctx_;
  int64_t n_past_ = 0;
  std::unique_ptr<BlockTable> kv_;
  BufferPtr rstate_;
  // Model::forward_greedy's id (the first 4 bytes) and logits (from byte 256) on the backend.
  BufferPtr greedy_;
  std::vector<std::pair<int64_t, BufferPtr>> snaps_;  // by position, ascending
  // The last eval_batch's logits row in a host block shared with the step's other sessions
  // (the reference keeps the block from being reused until this session is done with it).
  std::shared_ptr<float> lazy_block_;
  const float* lazy_ = nullptr;
  int64_t lazy_n_ = 0;
  void init_recurrent();
  void reset_recurrent();
};

class PrefixCache;
// Attaches the longest cached prefix of prompt to a fresh paged session: matched
// pages join its block table and n_past moves past them (capped one token short
// of the prompt). Returns the matched count.
int64_t prefix_attach(PrefixCache& cache, Session& s, const std::vector<int32_t>& prompt);
// Donates the session's full pages of tokens (its evaluated history, checked) to the cache.
void prefix_insert(PrefixCache& cache, Session& s, const std::vector<int32_t>& tokens, const std::string& preview);

}  // namespace dl
