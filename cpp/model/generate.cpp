// The decode loop: prefill, then sample/eval one token at a time, all in C++;
// only the per-token callback crosses into the caller.
#include <algorithm>
#include <chrono>

#include "core/errors.h"
#include "model/model.h"
#include "model/session.h"

namespace dl {

int64_t generate(Model& m, Session& s, const std::vector<int32_t>& prompt, const float* embd, int64_t npos,
                 const SamplingParams& p, int64_t max_tokens, const TokenCallback& cb,
                 const std::vector<int32_t>* stop_ids, bool special) {
  using clock = std::chrono::steady_clock;
  const int64_t n_prompt = embd ? npos : (int64_t)prompt.size();
  if (s.n_past() + n_prompt > s.n_ctx())
    throw ContextOverflowError("prompt of " + std::to_string(n_prompt) + " tokens does not fit: " +
                               std::to_string(s.n_past()) + " of " + std::to_string(s.n_ctx()) + " positions used");
  if (p.seed >= 0) s.rng.reseed((uint64_t)p.seed);
  s.stats = GenStats{};
  s.stats.n_prompt = n_prompt;
  const auto t0 = clock::now();
  if (n_prompt > 0) m.forward(s, embd ? nullptr : prompt.data(), embd, n_prompt, false);
  else if (s.logits.empty()) throw Error("generate: empty prompt and no logits from an earlier eval");
  const auto t1 = clock::now();

  const Tokenizer& tok = m.tokenizer();
  Utf8Holder holder;
  int64_t n = 0;
  auto t_first = t1;
  while (n < max_tokens) {
    const int32_t id = sample_token(s.logits.data(), m.config().vocab_size, p, s.history, s.rng, s.sample_scratch);
    if (n == 0) t_first = clock::now();
    // The caller's stop set replaces the model's end-of-generation ids (a chat format may need
    // to stop at its own turn end, or run through an id the model calls end-of-generation).
    if (stop_ids ? std::find(stop_ids->begin(), stop_ids->end(), id) != stop_ids->end() : m.is_eog(id)) break;
    ++n;
    std::string piece = holder.push(tok.render(id, special));
    if (cb && !cb(id, piece)) break;
    if (s.n_past() >= s.n_ctx()) break;  // the context is full: stop, the session stays usable
    m.forward(s, &id, nullptr, 1, false);
  }
  // Bytes still held (an incomplete UTF-8 tail at the end) go out with a last callback.
  std::string tail = holder.flush();
  if (!tail.empty() && cb) cb(-1, tail);
  const auto t2 = clock::now();
  auto secs = [](clock::duration d) { return std::chrono::duration<double>(d).count(); };
  s.stats.n_gen = n;
  s.stats.ttft_s = secs(t_first - t0);
  s.stats.prefill_tps = n_prompt > 0 && secs(t1 - t0) > 0 ? n_prompt / secs(t1 - t0) : 0;
  s.stats.gen_tps = n > 1 && secs(t2 - t_first) > 0 ? (n - 1) / secs(t2 - t_first) : 0;
  return n;
}

}  // namespace dl
