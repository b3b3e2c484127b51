// Sampling: penalties over the recent history, then greedy argmax (temp <= 0) or
// top-k, temperature, top-p, min-p and a CDF draw from a seeded generator.
#pragma once
#include <cmath>
#include <cstdint>
#include <vector>

namespace dl {

struct SamplingParams {
  float temp = 0.f;  // <= 0: greedy
  int top_k = 0;     // 0: no cutoff
  float top_p = 1.f;
  float min_p = 0.f;
  float repeat_penalty = 1.f;  // 1: none
  int penalty_last_n = 64;
  float presence_penalty = 0.f;
  float frequency_penalty = 0.f;
  int64_t seed = -1;  // -1: leave the session's generator as it is
};

// A small, fast, reproducible generator (splitmix64 seeding, xoshiro256**).
class Rng {
 public:
  explicit Rng(uint64_t seed = 0x5eed) { reseed(seed); }
  void reseed(uint64_t seed);
  uint64_t next();
  double uniform() { return (next() >> 11) * (1.0 / 9007199254740992.0); }  // [0, 1)

 private:
  uint64_t s_[4];
};

// The first index of the largest of n values; NaN never the largest, 0 when none is a number.
int32_t argmax_first(const float* l, int32_t n);
// Whether p picks every token by argmax_first of the logits as they are (greedy, no penalty).
inline bool greedy_only(const SamplingParams& p) {
  const bool penal = p.repeat_penalty != 1.f || p.presence_penalty != 0.f || p.frequency_penalty != 0.f;
  return (p.temp <= 0.f || !std::isfinite(1.f / p.temp)) && !(penal && p.penalty_last_n != 0);
}

// Picks the next token from logits (n_vocab floats); history supplies the penalty window.
int32_t sample_token(const float* logits, int32_t n_vocab, const SamplingParams& p, const std::vector<int32_t>& history,
                     Rng& rng, std::vector<float>& scratch);

}  // namespace dl
