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
  else if (s.logits_ready().empty()) throw Error("generate: empty prompt and no logits from an earlier eval");
  const auto t1 = clock::now();

  const Tokenizer& tok = m.tokenizer();
  Utf8Holder holder;
  int64_t n = 0;
  auto t_first = t1;
  // The caller's stop set replaces the model's end-of-generation ids (a chat format may need
  // to stop at its own turn end, or run through an id the model calls end-of-generation).
  auto stops = [&](int32_t id) {
    return stop_ids ? std::find(stop_ids->begin(), stop_ids->end(), id) != stop_ids->end() : m.is_eog(id);
  };
  if (greedy_only(p) && m.can_pipeline(s)) {
    // Greedy on a device whose steps run while the host goes on: the step of the next token (the
    // id the running step's argmax leaves on the device) is issued before the host reads that id,
    // so the device does not wait for the callback, the stop checks and the next step's
    // recording. When that id ends the stream its step has been issued already: it is taken back
    // (truncate), and the step before is run again so the session's logits are the ones the id
    // was picked from, as below. The same tokens, logits and cache as the loop below.
    int32_t got[2] = {0, 0};
    int slot = 0;
    int32_t id = sample_token(s.logits.data(), m.config().vocab_size, p, s.history, s.rng, s.sample_scratch);
    t_first = clock::now();
    bool ahead_id = false;  // the step of id is issued and id not yet passed (stop set, callback)
    bool pending = false;   // tk's download not waited for yet
    bool fetch = false;     // s.logits are not the last step's yet
    int64_t tk = 0;
    // id's step, issued ahead, taken back: the session as the loop below leaves it.
    auto take_back = [&] {
      if (pending) m.backend().download_wait(tk);
      pending = ahead_id = false;
      s.truncate(s.n_past() - 1);
      const int32_t prev = s.history.back();
      s.truncate(s.n_past() - 1);
      m.forward(s, &prev, nullptr, 1, false);
      fetch = false;
    };
    try {
      while (n < max_tokens) {
        bool go = !stops(id);
        if (go) {
          ++n;
          std::string piece = holder.push(tok.render(id, special));
          go = !cb || cb(id, piece);
        }
        if (!go) {
          if (ahead_id) take_back();
          break;
        }
        if (!ahead_id) {
          if (s.n_past() >= s.n_ctx()) break;  // the context is full: stop, the session stays usable
          tk = m.forward_greedy(s, &id, &got[slot]);
          pending = fetch = true;
        }
        ahead_id = false;
        // The next token is evaluated unless it ends the stream (known only once it lands). A pool
        // that cannot take its row refuses it here with the session unchanged: the step is then
        // issued (and refused) after the token's callback, as the loop below does.
        bool ahead = n < max_tokens && s.n_past() < s.n_ctx();
        int64_t tk2 = 0;
        if (ahead) {
          try {
            tk2 = m.forward_greedy(s, nullptr, &got[slot ^ 1]);
          } catch (const PoolExhaustedError&) {
            ahead = false;
          }
        }
        m.backend().download_wait(tk);
        id = got[slot];
        if (ahead) s.history.back() = id;
        ahead_id = pending = ahead, tk = tk2, slot ^= 1;
      }
    } catch (...) {
      // An exception (a callback's, a refused step's) leaves no download pending into `got`,
      // and the session as the loop below would.
      try {
        if (ahead_id) take_back();
        if (pending) m.backend().download_wait(tk);
        if (fetch) m.fetch_logits(s);
      } catch (...) {
      }
      throw;
    }
    if (fetch) m.fetch_logits(s);
  } else {
    while (n < max_tokens) {
      const int32_t id = sample_token(s.logits.data(), m.config().vocab_size, p, s.history, s.rng, s.sample_scratch);
      if (n == 0) t_first = clock::now();
      if (stops(id)) break;
      ++n;
      std::string piece = holder.push(tok.render(id, special));
      if (cb && !cb(id, piece)) break;
      if (s.n_past() >= s.n_ctx()) break;  // the context is full: stop, the session stays usable
      m.forward(s, &id, nullptr, 1, false);
    }
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
