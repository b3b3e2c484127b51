// The serving step loop: streams over sessions of one model; each step is one ragged forward
// (up to a chunk of prefill rows, oldest prefilling streams first, + a decode token of every
// running stream),
// then a sample and the stop checks per stream. Uses only Model's public API (forward_ragged,
// the sampler, the tokenizer), so it runs unchanged on any backend. No text, HTTP or caching here.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "model/session.h"
#include "sample/sampler.h"

namespace dl {

struct StepEvent {
  enum Kind : int32_t { kToken = 0, kStop = 1, kLength = 2 };
  int32_t slot;
  Kind kind;
  int32_t token;      // the sampled id (the stop id for kStop)
  std::string bytes;  // what the token adds to decode() (empty for kStop)
};

class Stepper {
 public:
  // Every slot session must be of one model; chunk caps a step's prefill rows (all streams').
  Stepper(std::vector<std::shared_ptr<Session>> slots, int64_t chunk);

  // A job on slot: the session already holds prompt[:n_past] (attached), the rest is prefilled
  // by step() a chunk at a time. stop_ids end the reply beside the model's end-of-generation ids.
  // priority orders the prefills (lowest first: the submission time).
  void start(int slot, std::vector<int32_t> prompt, const SamplingParams& p, int64_t max_tokens,
             std::vector<int32_t> stop_ids, double priority);
  // Ends slot's job (idempotent); the caller releases or donates the session's pages.
  void end(int slot);
  bool active(int slot) const { return jobs_.at(check(slot)).active; }
  // The slot the next step() prefills (-1 when none): a caller that prefills it itself (media
  // rows) calls step(false) so that no second prefill runs that step.
  int next_prefill() const;
  // One step. n_decoded: the decode rows it ran. On PoolExhaustedError (index = the slot
  // asking) no session moved. A stream whose event is kStop or kLength has ended.
  std::vector<StepEvent> step(bool prefill, int64_t* n_decoded);
  int64_t n_slots() const { return (int64_t)slots_.size(); }

 private:
  struct Job {
    bool active = false;
    std::vector<int32_t> prompt;
    SamplingParams params;
    int64_t max_tokens = 0, n_gen = 0;
    std::vector<int32_t> stop_ids;
    double priority = 0;
    int32_t next_tok = -1;  // sampled, not yet evaluated (-1: still prefilling)
  };
  int check(int slot) const;
  int32_t draw(int slot);  // samples slot's next token from its logits
  void sampled(int slot, int32_t tok, std::vector<StepEvent>& out);

  std::vector<std::shared_ptr<Session>> slots_;
  std::vector<Job> jobs_;
  int64_t chunk_;
  // One step's batch, reused.
  std::vector<Session*> batch_;
  std::vector<int> batch_slot_;
  std::vector<int32_t> tokens_;
  std::vector<int64_t> counts_;
  std::vector<int> order_;
  std::vector<int> to_sample_;
  std::vector<int32_t> drawn_;
  std::vector<int32_t> ids_;  // a greedy step's ids, one a batch row
};

}  // namespace dl
