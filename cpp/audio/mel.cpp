// The whisper log-mel front end (framing, FFT power spectra, mel filters, log, all here on the host)
// and NeMo's filterbank (its DFT and filters as backend matmuls).
#include "audio/mel.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>

#include "core/threadpool.h"
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
  w.host_kept = true;  // the bank keeps its tables: the CPU packs them (the DFT is most of the mel's work)
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

// Triangular Slaney filters of n_mel over bins of an n_fft DFT at 16 kHz, [0, 8 kHz], each scaled
// by 2 / (its width in Hz) (Slaney's area normalization).
std::vector<float> slaney_filters(int nm, int bins) {
  std::vector<double> pts((size_t)nm + 2);
  const double m0 = hz_to_mel(0.0), m1 = hz_to_mel(kSampleRate / 2.0);
  for (int i = 0; i < nm + 2; ++i) pts[i] = mel_to_hz(m0 + (m1 - m0) * i / (nm + 1));
  std::vector<float> f((size_t)nm * bins);
  for (int m = 0; m < nm; ++m) {
    const double lo = pts[m], c = pts[m + 1], hi = pts[m + 2];
    const double enorm = 2.0 / (hi - lo);
    for (int k = 0; k < bins; ++k) {
      const double fk = (double)k * (kSampleRate / 2.0) / (bins - 1);
      const double down = (fk - lo) / (c - lo), up = (hi - fk) / (hi - c);
      f[(size_t)m * bins + k] = (float)(std::max(0.0, std::min(down, up)) * enorm);
    }
  }
  return f;
}

constexpr int kFbankFFT = 512, kFbankWin = 400, kFbankBins = kFbankFFT / 2 + 1;

}  // namespace

int64_t mel_chunks(int64_t n) { return std::max<int64_t>(1, (n + kChunkSamples - 1) / kChunkSamples); }

MelBank::MelBank(int nm) : n_mel(nm) {
  if (nm <= 0 || nm > 512) throw std::invalid_argument("n_mel must be in [1, 512], got " + std::to_string(nm));
  window.resize(kNFFT);
  for (int i = 0; i < kNFFT; ++i) window[i] = (float)(0.5 - 0.5 * std::cos(2.0 * M_PI * i / kNFFT));
  filters = slaney_filters(nm, kBins);
  lo.assign(nm, 0);
  hi.assign(nm, 0);
  for (int m = 0; m < nm; ++m) {
    const float* f = filters.data() + (size_t)m * kBins;
    int a = 0, b = kBins;
    while (a < kBins && f[a] == 0.f) ++a;
    while (b > a && f[b - 1] == 0.f) --b;
    lo[m] = a, hi[m] = b;
  }
}

namespace {

// out[m * stride + t] = log10(max(mel power, 1e-10)) of frames t in [0, frames), frame t being
// padded[t * kHop + i], i < kNFFT: windowed, FFT power spectra 16 frames at a time, then each
// filter over its nonzero bins. Groups of 16 frames go to the pool's threads, when there is one.
void log_mel_power(const MelBank& bank, const float* padded, int64_t frames, float* out, int64_t stride,
                   ThreadPool* pool) {
  constexpr int L = kFFTLanes;
  auto groups = [&](int64_t g0, int64_t g1) {
    thread_local std::vector<float> scratch;  // frames in lanes, the FFT's work, power
    scratch.resize((size_t)kNFFT * L + bank.fft.work_floats() + (size_t)kBins * L);
    float* xl = scratch.data();
    float* work = xl + (size_t)kNFFT * L;
    float* pw = work + bank.fft.work_floats();
    const float* win = bank.window.data();
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t t0 = g * L;
      const int cnt = (int)std::min<int64_t>(L, frames - t0);
      for (int l = 0; l < L; ++l) {  // lanes past the last frame repeat it (computed, not stored)
        const float* fr = padded + (t0 + std::min(l, cnt - 1)) * kHop;
        for (int i = 0; i < kNFFT; ++i) xl[i * L + l] = fr[i] * win[i];
      }
      bank.fft.power(xl, work, pw);
      for (int m = 0; m < bank.n_mel; ++m) {
        const float* f = bank.filters.data() + (size_t)m * kBins;
        float acc[L] = {};
        for (int k = bank.lo[m]; k < bank.hi[m]; ++k)
          for (int l = 0; l < L; ++l) acc[l] += f[k] * pw[k * L + l];
        float* o = out + (size_t)m * stride + t0;
        for (int l = 0; l < cnt; ++l) o[l] = std::log10(std::max(acc[l], 1e-10f));
      }
    }
  };
  const int64_t n_groups = (frames + L - 1) / L;
  if (pool && pool->size() > 1)
    pool->parallel_for(n_groups, 4, groups);
  else
    groups(0, n_groups);
}

void check_finite(const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    if (!std::isfinite(x[i])) throw std::invalid_argument("audio sample " + std::to_string(i) + " is not finite");
}

// The signal that frames 0..frames-1 read (from sample -kNFFT / 2 on) into s.frames: the clip
// copied, sample(i) for the positions around it (each caller's reflection).
template <class Sample>
const float* framed_signal(const float* x, int64_t n, int64_t frames, MelScratch& s, Sample sample) {
  const int64_t len = frames * kHop + kNFFT, off = kNFFT / 2;
  s.frames.resize((size_t)len);
  float* pb = s.frames.data();
  const int64_t mid = std::min(n, len - off);
  for (int64_t j = 0; j < off; ++j) pb[j] = sample(j - off);
  std::memcpy(pb + off, x, (size_t)mid * 4);
  for (int64_t j = off + mid; j < len; ++j) pb[j] = sample(j - off);
  return pb;
}

}  // namespace

void log_mel(const MelBank& bank, const float* x, int64_t n, MelScratch& s, float* out, ThreadPool* pool) {
  if (n <= 0) throw std::invalid_argument("audio clip is empty");
  check_finite(x, n);
  const int nm = bank.n_mel;
  const int64_t n_chunks = mel_chunks(n), total = n_chunks * kChunkFrames, padded = n_chunks * kChunkSamples;
  auto sample = [&](int64_t i) -> float {
    if (i < 0) i = -i;  // reflect about the first sample
    if (i >= padded) i = 2 * (padded - 1) - i;
    return i < n ? x[i] : 0.f;
  };
  // The signal frame t reads from: samples from -kNFFT / 2 on, the clip itself copied.
  const float* pb = framed_signal(x, n, total, s, sample);
  log_mel_power(bank, pb, total, out, total, pool);
  float mx = -INFINITY;
  for (int64_t i = 0; i < (int64_t)nm * total; ++i) mx = std::max(mx, out[i]);
  const float floor = mx - 8.f;
  for (int64_t i = 0; i < (int64_t)nm * total; ++i) out[i] = (std::max(out[i], floor) + 4.f) / 4.f;
}

FbankBank::FbankBank(int nm) : n_mel(nm) {
  if (nm <= 0 || nm > 512) throw std::invalid_argument("n_mel must be in [1, 512], got " + std::to_string(nm));
  // torch.hann_window(400, periodic=False), centred in the 512-point frame (56 zeros each side).
  const int off = (kFbankFFT - kFbankWin) / 2;
  std::vector<float> d((size_t)2 * kFbankBins * kFbankFFT, 0.f);
  for (int k = 0; k < kFbankBins; ++k)
    for (int i = 0; i < kFbankWin; ++i) {
      const double w = 0.5 - 0.5 * std::cos(2.0 * M_PI * i / (kFbankWin - 1));
      const int j = i + off;
      const double a = 2.0 * M_PI * (double)((int64_t)k * j % kFbankFFT) / kFbankFFT;
      d[(size_t)k * kFbankFFT + j] = (float)(w * std::cos(a));
      d[(size_t)(kFbankBins + k) * kFbankFFT + j] = (float)(-w * std::sin(a));
    }
  dft = owned_f32(std::move(d), 2 * kFbankBins, kFbankFFT);
  filters = owned_f32(slaney_filters(nm, kFbankBins), nm, kFbankBins);
}

int64_t fbank_frames(int64_t n) { return 1 + n / kHop; }

void nemo_fbank(Backend& be, const FbankBank& bank, const float* x, int64_t n, MelScratch& s, float* out) {
  if (n < 2 * kHop) throw std::invalid_argument("audio clip is shorter than two hops (320 samples)");
  check_finite(x, n);
  const int nm = bank.n_mel;
  const int64_t T = fbank_frames(n), valid = n / kHop;
  auto sample = [&](int64_t i) -> float {  // preemphasized, zero outside the clip
    if (i < 0 || i >= n) return 0.f;
    return i == 0 ? x[0] : x[i] - 0.97f * x[i - 1];
  };
  s.frames.resize((size_t)kChunkFrames * kFbankFFT);
  s.spec.resize((size_t)kChunkFrames * 2 * kFbankBins);
  s.power.resize((size_t)kChunkFrames * kFbankBins);
  s.mel.resize((size_t)kChunkFrames * nm);
  for (int64_t t0 = 0; t0 < T; t0 += kChunkFrames) {
    const int64_t cnt = std::min<int64_t>(kChunkFrames, T - t0);
    for (int64_t t = 0; t < cnt; ++t) {
      float* fr = s.frames.data() + t * kFbankFFT;
      const int64_t start = (t0 + t) * kHop - kFbankFFT / 2;
      for (int i = 0; i < kFbankFFT; ++i) fr[i] = sample(start + i);
    }
    be.matmul(bank.dft, s.frames.data(), cnt, s.spec.data());
    for (int64_t t = 0; t < cnt; ++t) {
      const float* sp = s.spec.data() + t * 2 * kFbankBins;
      float* pw = s.power.data() + t * kFbankBins;
      for (int k = 0; k < kFbankBins; ++k) pw[k] = sp[k] * sp[k] + sp[kFbankBins + k] * sp[kFbankBins + k];
    }
    be.matmul(bank.filters, s.power.data(), cnt, s.mel.data());
    for (int64_t t = 0; t < cnt; ++t)
      for (int m = 0; m < nm; ++m)
        out[(size_t)m * T + t0 + t] = std::log(s.mel[(size_t)t * nm + m] + 5.9604644775390625e-08f);  // 2^-24
  }
  for (int m = 0; m < nm; ++m) {
    float* r = out + (size_t)m * T;
    double sum = 0;
    for (int64_t t = 0; t < valid; ++t) sum += r[t];
    const double mean = sum / valid;
    double var = 0;
    for (int64_t t = 0; t < valid; ++t) var += (r[t] - mean) * (r[t] - mean);
    const double inv = 1.0 / (std::sqrt(var / (valid - 1)) + 1e-5);
    for (int64_t t = 0; t < valid; ++t) r[t] = (float)((r[t] - mean) * inv);
    for (int64_t t = valid; t < T; ++t) r[t] = 0.f;
  }
}

void log_mel_clip(const MelBank& bank, const float* x, int64_t n, MelScratch& s, float* out, int64_t stride,
                  ThreadPool* pool) {
  const int64_t F = n / kHop;
  if (n <= kNFFT / 2) throw std::invalid_argument("audio clip is shorter than half a window (200 samples)");
  if (stride < F) throw std::invalid_argument("mel stride is shorter than the clip's frames");
  check_finite(x, n);
  const int nm = bank.n_mel;
  auto sample = [&](int64_t i) -> float {
    if (i < 0) i = -i;  // reflect about the first sample
    if (i >= n) i = 2 * (n - 1) - i;  // and about the last (n > 200 here, so once is enough)
    return x[i];
  };
  const float* pb = framed_signal(x, n, F, s, sample);
  log_mel_power(bank, pb, F, out, stride, pool);
  float mx = -INFINITY;
  for (int m = 0; m < nm; ++m)
    for (int64_t t = 0; t < F; ++t) mx = std::max(mx, out[(size_t)m * stride + t]);
  const float floor = mx - 8.f;
  for (int m = 0; m < nm; ++m) {
    float* r = out + (size_t)m * stride;
    for (int64_t t = 0; t < F; ++t) r[t] = (std::max(r[t], floor) + 4.f) / 4.f;
    for (int64_t t = F; t < stride; ++t) r[t] = 0.f;
  }
}

}  // namespace dl::audio
