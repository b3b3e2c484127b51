// The whisper log-mel front end: framing here, the DFT and the mel filters as backend matmuls.
#include "audio/mel.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>

#include "quant/types.h"

namespace dl::audio {

namespace {

Weight owned_f32(std::vector<float> v, int64_t rows, int64_t cols) {
  Weight w;
  w.type = (uint32_t)GGMLType::F32;
  w.rows = rows;
  w.cols = cols;
  w.row_bytes = (size_t)cols * 4;
  w.owned = std::make_shared<std::vector<uint8_t>>(v.size() * 4);
  std::memcpy(w.owned->data(), v.data(), v.size() * 4);
  w.host = w.data = w.owned->data();
  return w;
}

// Slaney's mel scale (librosa's default, htk=False): linear below 1 kHz, log above.
double hz_to_mel(double f) {
  const double logstep = 27.0 / std::log(6.4);
  return f < 1000.0 ? 3.0 * f / 200.0 : 15.0 + std::log(f / 1000.0) * logstep;
}
double mel_to_hz(double m) {
  const double logstep = std::log(6.4) / 27.0;
  return m < 15.0 ? 200.0 * m / 3.0 : 1000.0 * std::exp(logstep * (m - 15.0));
}

}  // namespace

void MelBank::prepare(Backend& be) {
  be.load_weight(dft, WeightUse::matmul);
  be.load_weight(filters, WeightUse::matmul);
}

int64_t mel_chunks(int64_t n) { return std::max<int64_t>(1, (n + kChunkSamples - 1) / kChunkSamples); }

MelBank::MelBank(int nm) : n_mel(nm) {
  if (nm <= 0 || nm > 512) throw std::invalid_argument("n_mel must be in [1, 512], got " + std::to_string(nm));
  // The DFT in double, rounded once to f32; the periodic Hann window folded into it.
  std::vector<float> d((size_t)2 * kBins * kNFFT);
  for (int k = 0; k < kBins; ++k)
    for (int i = 0; i < kNFFT; ++i) {
      const double w = 0.5 - 0.5 * std::cos(2.0 * M_PI * i / kNFFT);
      const double a = 2.0 * M_PI * (double)((int64_t)k * i % kNFFT) / kNFFT;
      d[(size_t)k * kNFFT + i] = (float)(w * std::cos(a));
      d[(size_t)(kBins + k) * kNFFT + i] = (float)(-w * std::sin(a));
    }
  dft = owned_f32(std::move(d), 2 * kBins, kNFFT);
  // Triangular filters between n_mel + 2 points evenly spaced in mel over [0, 8 kHz],
  // each scaled by 2 / (its width in Hz) (Slaney's area normalization).
  std::vector<double> pts((size_t)nm + 2);
  const double m0 = hz_to_mel(0.0), m1 = hz_to_mel(kSampleRate / 2.0);
  for (int i = 0; i < nm + 2; ++i) pts[i] = mel_to_hz(m0 + (m1 - m0) * i / (nm + 1));
  std::vector<float> f((size_t)nm * kBins);
  for (int m = 0; m < nm; ++m) {
    const double lo = pts[m], c = pts[m + 1], hi = pts[m + 2];
    const double enorm = 2.0 / (hi - lo);
    for (int k = 0; k < kBins; ++k) {
      const double fk = (double)k * (kSampleRate / 2.0) / (kBins - 1);
      const double down = (fk - lo) / (c - lo), up = (hi - fk) / (hi - c);
      f[(size_t)m * kBins + k] = (float)(std::max(0.0, std::min(down, up)) * enorm);
    }
  }
  filters = owned_f32(std::move(f), nm, kBins);
}

void log_mel(Backend& be, const MelBank& bank, const float* x, int64_t n, MelScratch& s, float* out) {
  if (n <= 0) throw std::invalid_argument("audio clip is empty");
  for (int64_t i = 0; i < n; ++i)
    if (!std::isfinite(x[i])) throw std::invalid_argument("audio sample " + std::to_string(i) + " is not finite");
  const int nm = bank.n_mel;
  const int64_t n_chunks = mel_chunks(n), total = n_chunks * kChunkFrames, padded = n_chunks * kChunkSamples;
  auto sample = [&](int64_t i) -> float {
    if (i < 0) i = -i;  // reflect about the first sample
    if (i >= padded) i = 2 * (padded - 1) - i;
    return i < n ? x[i] : 0.f;
  };
  s.frames.resize((size_t)kChunkFrames * kNFFT);
  s.spec.resize((size_t)kChunkFrames * 2 * kBins);
  s.power.resize((size_t)kChunkFrames * kBins);
  s.mel.resize((size_t)kChunkFrames * nm);
  for (int64_t c = 0; c < n_chunks; ++c) {
    const int64_t t0 = c * kChunkFrames;
    // A frame wholly past the clip is all zeros: skip its matmul rows (log10(1e-10) below).
    int64_t live = 0;
    for (int64_t t = 0; t < kChunkFrames; ++t) {
      const int64_t start = (t0 + t) * kHop - kNFFT / 2;
      if (start >= n && start + kNFFT - 1 < padded) break;
      float* fr = s.frames.data() + t * kNFFT;
      for (int i = 0; i < kNFFT; ++i) fr[i] = sample(start + i);
      live = t + 1;
    }
    if (live > 0) {
      be.matmul(bank.dft, s.frames.data(), live, s.spec.data());
      for (int64_t t = 0; t < live; ++t) {
        const float* sp = s.spec.data() + t * 2 * kBins;
        float* pw = s.power.data() + t * kBins;
        for (int k = 0; k < kBins; ++k) pw[k] = sp[k] * sp[k] + sp[kBins + k] * sp[kBins + k];
      }
      be.matmul(bank.filters, s.power.data(), live, s.mel.data());
    }
    for (int64_t t = 0; t < kChunkFrames; ++t)
      for (int m = 0; m < nm; ++m) {
        const float v = t < live ? s.mel[(size_t)t * nm + m] : 0.f;
        out[(size_t)m * total + t0 + t] = std::log10(std::max(v, 1e-10f));
      }
  }
  float mx = -INFINITY;
  for (int64_t i = 0; i < (int64_t)nm * total; ++i) mx = std::max(mx, out[i]);
  const float floor = mx - 8.f;
  for (int64_t i = 0; i < (int64_t)nm * total; ++i) out[i] = (std::max(out[i], floor) + 4.f) / 4.f;
}

}  // namespace dl::audio
