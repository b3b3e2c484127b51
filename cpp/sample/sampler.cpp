// The sampler chain; scratch is caller-owned so the token loop allocates nothing.
#include "sample/sampler.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <unordered_map>

namespace dl {

void Rng::reseed(uint64_t seed) {
  uint64_t z = seed;
  for (auto& s : s_) {
    z += 0x9e3779b97f4a7c15ull;
    uint64_t x = z;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    s = x ^ (x >> 31);
  }
}

uint64_t Rng::next() {
  auto rotl = [](uint64_t x, int k) { return (x << k) | (x >> (64 - k)); };
  const uint64_t r = rotl(s_[1] * 5, 7) * 9;
  const uint64_t t = s_[1] << 17;
  s_[2] ^= s_[0];
  s_[3] ^= s_[1];
  s_[1] ^= s_[2];
  s_[0] ^= s_[3];
  s_[2] ^= t;
  s_[3] = rotl(s_[3], 45);
  return r;
}

int32_t sample_token(const float* logits, int32_t n, const SamplingParams& p, const std::vector<int32_t>& history,
                     Rng& rng, std::vector<float>& l) {
  l.assign(logits, logits + n);
  // Penalties over the last penalty_last_n tokens (llama.cpp semantics: repeat
  // divides positive logits and multiplies negative ones; presence/frequency subtract).
  const bool penal = p.repeat_penalty != 1.f || p.presence_penalty != 0.f || p.frequency_penalty != 0.f;
  if (penal && p.penalty_last_n != 0 && !history.empty()) {
    size_t start = p.penalty_last_n < 0 ? 0 : history.size() - std::min<size_t>(history.size(), p.penalty_last_n);
    std::unordered_map<int32_t, int> count;
    for (size_t i = start; i < history.size(); ++i)
      if (history[i] >= 0 && history[i] < n) ++count[history[i]];
    for (auto& [id, c] : count) {
      float& x = l[id];
      if (p.repeat_penalty != 1.f) x = x > 0 ? x / p.repeat_penalty : x * p.repeat_penalty;
      x -= c * p.frequency_penalty + (c > 0 ? p.presence_penalty : 0.f);
    }
  }
  if (p.temp <= 0.f) return (int32_t)(std::max_element(l.begin(), l.end()) - l.begin());

  // Candidates sorted by logit (partial sort to top_k when given).
  thread_local std::vector<int32_t> idx;
  idx.resize(n);
  std::iota(idx.begin(), idx.end(), 0);
  int32_t k = (p.top_k > 0 && p.top_k < n) ? p.top_k : n;
  auto by_logit = [&](int32_t a, int32_t b) { return l[a] > l[b] || (l[a] == l[b] && a < b); };
  std::partial_sort(idx.begin(), idx.begin() + k, idx.end(), by_logit);
  idx.resize(k);
  // Softmax with temperature over the survivors.
  thread_local std::vector<double> prob;
  prob.resize(k);
  const double mx = l[idx[0]];
  double sum = 0;
  for (int32_t i = 0; i < k; ++i) sum += prob[i] = std::exp((l[idx[i]] - mx) / p.temp);
  for (int32_t i = 0; i < k; ++i) prob[i] /= sum;
  int32_t keep = k;
  if (p.top_p < 1.f) {
    double cum = 0;
    for (int32_t i = 0; i < k; ++i) {
      cum += prob[i];
      if (cum >= p.top_p) {
        keep = i + 1;
        break;
      }
    }
  }
  if (p.min_p > 0.f) {
    const double floor = prob[0] * p.min_p;
    int32_t m = 1;
    while (m < keep && prob[m] >= floor) ++m;
    keep = m;
  }
  double total = 0;
  for (int32_t i = 0; i < keep; ++i) total += prob[i];
  double r = rng.uniform() * total;
  for (int32_t i = 0; i < keep; ++i) {
    r -= prob[i];
    if (r < 0) return idx[i];
  }
  return idx[keep - 1];
}

}  // namespace dl
