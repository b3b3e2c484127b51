// The whisper log-mel front end: 16 kHz mono -> (n_mel, 3000 * chunks) features, as
// WhisperFeatureExtractor computes them; and NeMo's filterbank. Knows no tower.
#pragma once
#include <cstdint>
#include <vector>

#include "audio/fft.h"
#include "core/backend.h"

namespace dl::audio {

constexpr int kSampleRate = 16000;
constexpr int kNFFT = 400;            // periodic Hann window of this length
constexpr int kHop = 160;
constexpr int kBins = kNFFT / 2 + 1;  // 201 one-sided frequency bins
constexpr int64_t kChunkSamples = 30 * kSampleRate;
constexpr int64_t kChunkFrames = kChunkSamples / kHop;  // 3000

// 30 s windows a clip fills: at least one, so silence and a 0.1 s clip make one chunk.
int64_t mel_chunks(int64_t n_samples);

// The periodic Hann window, the 400-point FFT and the Slaney mel filters (plain C++ on the host:
// an FFT takes ~10x fewer multiplies than the DFT as a matmul did, whatever backend the tower uses).
struct MelBank {
  int n_mel = 0;
  std::vector<float> window;   // kNFFT
  RealFFT fft{kNFFT};
  std::vector<float> filters;  // [n_mel][kBins]
  std::vector<int> lo, hi;     // filter m's nonzero bins [lo[m], hi[m])
  explicit MelBank(int n_mel);
};

struct MelScratch {
  std::vector<float> frames, spec, power, mel;
};

// The frames are spread over `pool`'s threads where one is given (the tower's CPU backend's).
// out[m * frames + t] for frames = mel_chunks(n) * 3000: the clip zero-padded to whole
// chunks, reflect-padded by 200 at both ends (torch.stft center=True), power spectrum,
// mel, log10 with the (max - 8) floor over the whole clip and (x + 4) / 4.
// Throws std::invalid_argument on an empty clip or a non-finite sample.
void log_mel(const MelBank& bank, const float* x, int64_t n, MelScratch& s, float* out, ThreadPool* pool = nullptr);

// The clip's own frames, as a feature extractor that pads to the longest clip computes them
// (Qwen3-ASR's processor): n / kHop frames (the STFT's last dropped), reflect-padded by 200 at
// both ends of the clip itself, the (max - 8) floor over those frames only. out[m * stride + t]
// for t < n / kHop, and 0 (the processor's padding value) for the columns up to stride.
// Throws std::invalid_argument on a clip shorter than one hop or a non-finite sample.
void log_mel_clip(const MelBank& bank, const float* x, int64_t n, MelScratch& s, float* out, int64_t stride,
                  ThreadPool* pool = nullptr);

// NeMo's filterbank front end (FastConformer models: Parakeet, Canary), as transformers'
// ParakeetFeatureExtractor computes it for one clip: preemphasis 0.97 (y[0] = x[0]), a symmetric
// Hann of 400 centred in a 512-point DFT, the clip zero-padded by 256 at both ends (torch.stft
// center=True, constant), power spectrum, Slaney mel over [0, 8 kHz], ln(x + 2^-24); then each mel
// bin normalized over the clip's valid frames (n / 160 of them): mean, unbiased std + 1e-5.
// The frames are spread over `pool`'s threads where one is given (the tower's CPU backend's).
// out[m * frames + t] for frames = fbank_frames(n) = 1 + n / 160; frames past the valid ones are 0.
// Throws std::invalid_argument on a clip shorter than two hops or a non-finite sample.
struct FbankBank {
  int n_mel = 0;
  Weight dft;      // 2 * 257 rows (cos | -sin) of 512, the window folded in
  Weight filters;  // n_mel rows of 257
  explicit FbankBank(int n_mel);
};
int64_t fbank_frames(int64_t n_samples);
void nemo_fbank(Backend& be, const FbankBank& bank, const float* x, int64_t n, MelScratch& s, float* out);

}  // namespace dl::audio
