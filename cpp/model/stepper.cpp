// The serving step loop (see stepper.h): batch building, sampling and stop checks per step.
#include "model/stepper.h"

#include <algorithm>
#include <cstdlib>

#include "core/errors.h"
#include "core/backend.h"
#include "core/threadpool.h"
#include "model/model.h"

namespace dl {

Stepper::Stepper(std::vector<std::shared_ptr<Session>> slots, int64_t chunk)
    : slots_(std::move(slots)), jobs_(slots_.size()), chunk_(chunk) {
  if (slots_.empty()) throw Error("Stepper: no sessions");
  if (chunk_ < 1) throw Error("Stepper: chunk must be >= 1");
  for (auto& s : slots_) {
    if (!s) throw Error("Stepper: a null session");
    if (&s->model() != &slots_[0]->model()) throw Error("Stepper: sessions of different models");
  }
}

int Stepper::check(int slot) const {
  if (slot < 0 || slot >= (int)slots_.size()) throw Error("Stepper: slot " + std::to_string(slot) + " out of range");
  return slot;
}

void Stepper::start(int slot, std::vector<int32_t> prompt, const SamplingParams& p, int64_t max_tokens,
                    std::vector<int32_t> stop_ids, double priority) {
  Session& s = *slots_[check(slot)];
  for (int32_t t : prompt)
    if (t >= s.model().config().vocab_size) throw Error("Stepper: token id " + std::to_string(t) + " out of range");
  if (s.n_past() >= (int64_t)prompt.size())
    throw Error("Stepper: the session already holds the whole prompt (attach stops one token short)");
  Job& j = jobs_[slot];
  j = Job{};
  j.active = true;
  j.prompt = std::move(prompt);
  j.params = p;
  j.max_tokens = max_tokens;
  j.stop_ids = std::move(stop_ids);
  j.priority = priority;
}

void Stepper::end(int slot) { jobs_[check(slot)].active = false; }

int Stepper::next_prefill() const {
  int best = -1;
  for (int i = 0; i < (int)jobs_.size(); ++i) {
    const Job& j = jobs_[i];
    if (j.active && j.next_tok < 0 && (best < 0 || j.priority < jobs_[best].priority)) best = i;
  }
  return best;
}

std::vector<StepEvent> Stepper::step(bool prefill, int64_t* n_decoded) {
  batch_.clear();
  batch_slot_.clear();
  tokens_.clear();
  counts_.clear();
  int64_t n_dec = 0;
  if (prefill) {
    // Prefill rows up to the chunk, from the streams still prefilling, oldest first: many short
    // prompts arriving together start in one step, not one step each. The first is next_prefill;
    // a later one with media rows anywhere in its prompt waits its turn as the first (its
    // caller prefills media turns itself, text runs included).
    order_.clear();
    for (int i = 0; i < (int)jobs_.size(); ++i)
      if (jobs_[i].active && jobs_[i].next_tok < 0) order_.push_back(i);
    std::stable_sort(order_.begin(), order_.end(),
                     [&](int a, int b) { return jobs_[a].priority < jobs_[b].priority; });
    int64_t budget = chunk_;
    for (size_t k = 0; k < order_.size() && budget > 0; ++k) {
      const int p = order_[k];
      Session& s = *slots_[p];
      const Job& j = jobs_[p];
      const int64_t lo = s.n_past(), hi = std::min<int64_t>((int64_t)j.prompt.size(), lo + budget);
      if (k == 0) {
        for (int64_t i = lo; i < hi; ++i)
          if (j.prompt[i] < 0)  // embedding rows are the caller's to prefill (see next_prefill)
            throw Error("Stepper: prompt position " + std::to_string(i) +
                        " is a media row; prefill it with step(false)");
      } else if (std::any_of(j.prompt.begin(), j.prompt.end(), [](int32_t t) { return t < 0; })) {
        continue;
      }
      batch_.push_back(&s);
      batch_slot_.push_back(p);
      tokens_.insert(tokens_.end(), j.prompt.begin() + lo, j.prompt.begin() + hi);
      counts_.push_back(hi - lo);
      budget -= hi - lo;
    }
  }
  for (int i = 0; i < (int)jobs_.size(); ++i) {
    if (!jobs_[i].active || jobs_[i].next_tok < 0) continue;
    batch_.push_back(slots_[i].get());
    batch_slot_.push_back(i);
    tokens_.push_back(jobs_[i].next_tok);
    counts_.push_back(1);
    ++n_dec;
  }
  if (n_decoded) *n_decoded = n_dec;
  std::vector<StepEvent> out;
  if (batch_.empty()) return out;
  // A step whose streams all sample greedily takes its argmaxes on the backend (forward_ragged's
  // greedy_ids, the same argmax_first rule): only the ids cross back, not B x vocab logits.
  // DASLLAMA_DEVICE_GREEDY=0: the logits come back and the host samples (A/B runs, tests).
  const char* e = std::getenv("DASLLAMA_DEVICE_GREEDY");
  bool greedy = !(e && e[0] == '0');
  for (int slot : batch_slot_) greedy = greedy && greedy_only(jobs_[slot].params);
  ids_.resize(batch_.size());
  try {
    batch_[0]->model().forward_ragged(batch_.data(), tokens_.data(), counts_.data(), (int64_t)batch_.size(),
                                      greedy ? ids_.data() : nullptr);
  } catch (const PoolExhaustedError& e) {
    const int64_t b = e.index;
    throw PoolExhaustedError(e.what(), b >= 0 && b < (int64_t)batch_slot_.size() ? batch_slot_[b] : batch_slot_[0]);
  }
  to_sample_.clear();
  drawn_.clear();
  for (size_t b = 0; b < batch_.size(); ++b) {
    const int slot = batch_slot_[b];
    const Job& j = jobs_[slot];
    // A prefilling stream samples once its whole prompt is in the KV.
    if (j.next_tok < 0 && slots_[slot]->n_past() < (int64_t)j.prompt.size()) continue;
    to_sample_.push_back(slot);
    drawn_.push_back(ids_[b]);
  }
  if (greedy) {
    for (size_t k = 0; k < to_sample_.size(); ++k) {
      const Job& j = jobs_[to_sample_[k]];
      if (j.params.seed >= 0) slots_[to_sample_[k]]->rng.reseed((uint64_t)j.params.seed);  // as draw() leaves it
      sampled(to_sample_[k], drawn_[k], out);
    }
    return out;
  }
  // The draws on the host threads (each session has its own generator and scratch, so the same
  // tokens in any order), then the events in slot order.
  const int64_t ns = (int64_t)to_sample_.size();
  drawn_.resize(ns);
  ThreadPool* tp = ns >= 4 ? batch_[0]->model().backend().host_threads() : nullptr;
  auto draws = [&](int64_t lo, int64_t hi) {
    for (int64_t k = lo; k < hi; ++k) drawn_[k] = draw(to_sample_[k]);
  };
  if (tp && tp->size() > 1)
    tp->parallel_for(ns, 1, draws);
  else
    draws(0, ns);
  for (int64_t k = 0; k < ns; ++k) sampled(to_sample_[k], drawn_[k], out);
  return out;
}

int32_t Stepper::draw(int slot) {
  Session& s = *slots_[slot];
  const Job& j = jobs_[slot];
  const int V = s.model().config().vocab_size;
  if (j.params.seed >= 0) s.rng.reseed((uint64_t)j.params.seed);
  return sample_token(s.last_logits(V), V, j.params, s.history, s.rng, s.sample_scratch);
}

void Stepper::sampled(int slot, int32_t tok, std::vector<StepEvent>& out) {
  Session& s = *slots_[slot];
  Job& j = jobs_[slot];
  Model& m = s.model();
  if (m.is_eog(tok) || std::find(j.stop_ids.begin(), j.stop_ids.end(), tok) != j.stop_ids.end()) {
    out.push_back({slot, StepEvent::kStop, tok, {}});
    j.active = false;
    return;
  }
  ++j.n_gen;
  std::string bytes(m.tokenizer().render(tok, false));  // control tokens give no text, as in generate
  if (j.n_gen >= j.max_tokens || s.n_past() + 1 >= s.n_ctx()) {
    out.push_back({slot, StepEvent::kLength, tok, std::move(bytes)});
    j.active = false;
    return;
  }
  j.next_tok = tok;
  out.push_back({slot, StepEvent::kToken, tok, std::move(bytes)});
}

}  // namespace dl
