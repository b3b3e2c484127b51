// The sampler chain; scratch is caller-owned so the token loop allocates nothing.
#include "sample/sampler.h"

#include <algorithm>
#include <cmath>
#include <cstring>
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

// The first index of the largest value (std::max_element's tie rule; NaN never the largest, 0
// when no value is a number), in two passes: the max over eight independent lanes (no serial
// compare chain), then the first index that holds it. Backend::argmax keeps this rule.
int32_t argmax_first(const float* l, int32_t n) {
  float m[8];
  for (int k = 0; k < 8; ++k) m[k] = -INFINITY;
  int32_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int k = 0; k < 8; ++k) m[k] = l[i + k] > m[k] ? l[i + k] : m[k];
  float mx = m[0];
  for (int k = 1; k < 8; ++k) mx = m[k] > mx ? m[k] : mx;
  for (; i < n; ++i) mx = l[i] > mx ? l[i] : mx;
  for (int32_t j = 0; j < n; ++j)
    if (l[j] == mx) return j;
  return 0;  // all NaN
}

namespace {

// w[i] = exp((l[i] - mx) * inv_t) for every i (arguments <= 0), by a polynomial the compiler
// vectorizes (Cephes' expf: 2^n e^r, |r| <= ln2 / 2; ~1 ulp), as libm's exp is a call per value.
void exp_weights(const float* l, int32_t n, float mx, float inv_t, float* w) {
  // The clamp in a loop of its own: in one loop with the rest, GCC 12 does not vectorize.
  for (int32_t i = 0; i < n; ++i) w[i] = std::max((l[i] - mx) * inv_t, -87.f);  // 2^n stays normal
  for (int32_t i = 0; i < n; ++i) {
    const float x = w[i];
    const float fn = (x * 1.44269504f + 12582912.f) - 12582912.f;  // round(x log2 e)
    const float r = (x - fn * 0.693359375f) + fn * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.f;
    const int32_t bits = ((int32_t)fn + 127) << 23;  // 2^n
    float sc;
    std::memcpy(&sc, &bits, 4);
    w[i] = p * sc;
  }
}

// Whether token a comes before token b in the candidates' order: larger logit, then lower id.
inline bool before(const float* l, int32_t a, int32_t b) { return l[a] > l[b] || (l[a] == l[b] && a < b); }

// The top_k candidates in order, by one pass that keeps the k best seen in a heap (its root the
// worst of them): the same set and order as a partial sort of every id, at the cost of a scan.
void top_k_ids(const float* l, int32_t n, int32_t k, std::vector<int32_t>& idx) {
  idx.resize(k);
  std::iota(idx.begin(), idx.end(), 0);
  auto worse_first = [l](int32_t a, int32_t b) { return before(l, a, b); };
  std::make_heap(idx.begin(), idx.end(), worse_first);
  for (int32_t i = k; i < n; ++i) {
    if (!(l[i] > l[idx[0]])) continue;  // i loses to the root (a tie goes to the root's lower id)
    std::pop_heap(idx.begin(), idx.end(), worse_first);
    idx[k - 1] = i;
    std::push_heap(idx.begin(), idx.end(), worse_first);
  }
  std::sort(idx.begin(), idx.end(), worse_first);
}

// A draw over the whole vocabulary (no top_k): w[i] = exp((l[i] - max) / temp) for every id,
// top_p's and min_p's cuts as prefixes of the candidates' order, found without sorting the
// vocabulary (top_p: below; min_p keeps w >= min_p, the max having w = 1). The CDF walk then
// goes over the kept ids in id order: the same distribution as a walk in the candidates' order.
int32_t sample_all(const float* l, int32_t n, const SamplingParams& p, Rng& rng, std::vector<float>& w) {
  const float mx = l[argmax_first(l, n)];
  w.resize(n);
  const float inv_t = 1.f / p.temp;
  exp_weights(l, n, mx, inv_t, w.data());
  double part[4] = {0, 0, 0, 0};  // four chains, not one serial add a value
  int32_t i4 = 0;
  for (; i4 + 4 <= n; i4 += 4)
    for (int k = 0; k < 4; ++k) part[k] += w[i4 + k];
  double sum = (part[0] + part[1]) + (part[2] + part[3]);
  for (; i4 < n; ++i4) sum += w[i4];
  // The top_p cut: the last id of the shortest prefix (in the candidates' order) whose mass
  // reaches top_p. Without sorting the vocabulary: the ids go into buckets by (max - logit) /
  // temp (the bucket never falls as the logit rises, and equal logits share one), the buckets'
  // masses locate the one where the prefix crosses top_p, and only that bucket's ids are sorted.
  // -1: no cut.
  int32_t cut = -1;
  if (p.top_p < 1.f) {
    constexpr int NB = 1024;
    thread_local std::vector<uint16_t> bucket;
    thread_local std::vector<int32_t> idx;
    double mass4[4][NB] = {};  // four histograms: neighbours in one bucket add on separate chains
    bucket.resize(n);
    const float k = inv_t * (NB / 87.f);
    for (int32_t i = 0; i < n; ++i) bucket[i] = (uint16_t)(int)std::min((mx - l[i]) * k, NB - 1.f);
    for (int32_t i = 0; i < n; ++i) mass4[i & 3][bucket[i]] += w[i];
    double mass[NB];
    for (int b = 0; b < NB; ++b) mass[b] = (mass4[0][b] + mass4[1][b]) + (mass4[2][b] + mass4[3][b]);
    const double need = (double)p.top_p * sum;
    double acc = 0;
    int cross = 0;
    while (cross < NB && acc + mass[cross] < need) acc += mass[cross++];
    if (cross < NB) {
      idx.resize(n);
      int32_t c = 0;
      for (int32_t i = 0; i < n; ++i) idx[c] = i, c += bucket[i] == cross;  // no branch to mispredict
      idx.resize(c);
      std::sort(idx.begin(), idx.end(), [l](int32_t a, int32_t b) { return before(l, a, b); });
      for (int32_t i : idx)
        if ((acc += w[i]) >= need) {
          cut = i;
          break;
        }
    }
    // Not reached (rounding kept the whole mass short of top_p): no cut, every id stays.
  }
  // Kept: at or before the cut (logit above the cut's, or equal with an id not past it) and
  // w >= min_p.
  const float lc = cut < 0 ? -INFINITY : l[cut];
  const int32_t ic = cut < 0 ? n : cut;
  const float wmin = p.min_p;
  // (Evaluated without branches: a kept id is a coin flip for the predictor on a flat distribution.)
  auto kept = [&](int32_t i) { return ((l[i] > lc) | ((l[i] == lc) & (i <= ic))) & (w[i] >= wmin); };
  double total = 0;
  int32_t last = -1;
  for (int32_t i = 0; i < n; ++i) {
    const bool k = kept(i);
    total += k ? (double)w[i] : 0.0;
    last = k ? i : last;
  }
  if (last < 0) return argmax_first(l, n);  // NaN logits: nothing to draw from
  double r = rng.uniform() * total;
  for (int32_t i = 0; i <= last; ++i)
    if ((r -= kept(i) ? (double)w[i] : 0.0) < 0) return i;
  return last;
}

}  // namespace

int32_t sample_token(const float* logits, int32_t n, const SamplingParams& p, const std::vector<int32_t>& history,
                     Rng& rng, std::vector<float>& scratch) {
  // Penalties over the last penalty_last_n tokens (llama.cpp semantics: repeat
  // divides positive logits and multiplies negative ones; presence/frequency subtract),
  // on a copy; without them the logits are read where they lie.
  const float* l = logits;
  const bool penal = p.repeat_penalty != 1.f || p.presence_penalty != 0.f || p.frequency_penalty != 0.f;
  if (penal && p.penalty_last_n != 0 && !history.empty()) {
    scratch.assign(logits, logits + n);
    size_t start = p.penalty_last_n < 0 ? 0 : history.size() - std::min<size_t>(history.size(), p.penalty_last_n);
    std::unordered_map<int32_t, int> count;
    for (size_t i = start; i < history.size(); ++i)
      if (history[i] >= 0 && history[i] < n) ++count[history[i]];
    for (auto& [id, c] : count) {
      float& x = scratch[id];
      if (p.repeat_penalty != 1.f) x = x > 0 ? x / p.repeat_penalty : x * p.repeat_penalty;
      x -= c * p.frequency_penalty + (c > 0 ? p.presence_penalty : 0.f);
    }
    l = scratch.data();
  }
  // A temperature so small that 1 / temp overflows is greedy (its scaled logits would be NaN).
  if (p.temp <= 0.f || !std::isfinite(1.f / p.temp)) return argmax_first(l, n);
  thread_local std::vector<float> w;
  if (p.top_k <= 0 || p.top_k >= n) return sample_all(l, n, p, rng, w);

  // top_k candidates in order, softmax with temperature over them, top_p / min_p cuts of that
  // order, and a CDF draw walking it.
  thread_local std::vector<int32_t> idx;
  const int32_t k = p.top_k;
  top_k_ids(l, n, k, idx);
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
