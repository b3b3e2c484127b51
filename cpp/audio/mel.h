// The whisper log-mel front end: 16 kHz mono -> (n_mel, 3000 * chunks) features, as
// WhisperFeatureExtractor computes them. Knows no tower.
#pragma once
#include <cstdint>
#include <vector>

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

// The DFT (window folded in) and the Slaney mel filters, as backend weights.
struct MelBank {
  int n_mel = 0;
  Weight dft;      // 2 * kBins rows (cos | -sin) of kNFFT
  Weight filters;  // n_mel rows of kBins
  explicit MelBank(int n_mel);
  // Hands both matrices to the backend that runs log_mel (the CPU packs them for its matmul).
  void prepare(Backend& be);
};

struct MelScratch {
  std::vector<float> frames, spec, power, mel;
};

// out[m * frames + t] for frames = mel_chunks(n) * 3000: the clip zero-padded to whole
// chunks, reflect-padded by 200 at both ends (torch.stft center=True), power spectrum,
// mel, log10 with the (max - 8) floor over the whole clip and (x + 4) / 4.
// Throws std::invalid_argument on an empty clip or a non-finite sample.
void log_mel(Backend& be, const MelBank& bank, const float* x, int64_t n, MelScratch& s, float* out);

}  // namespace dl::audio
