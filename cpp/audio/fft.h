// Power spectra of real frames by a mixed-radix FFT, 16 frames at a time (one per lane), for the
// mel front ends. Portable C++: the lane loops vectorize on any ISA. Knows no window or mel.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

namespace dl::audio {

constexpr int kFFTLanes = 16;

class RealFFT {
 public:
  // n even, n / 2 a product of 2, 3, 4 and 5 (400 and 512 are); throws std::invalid_argument.
  explicit RealFFT(int n);
  int size() const { return n_; }
  // x: [n][kFFTLanes], sample i of frame l at x[i * kFFTLanes + l]. power: [n / 2 + 1][kFFTLanes],
  // |X_k|^2 of the unnormalized DFT X_k = sum_i x_i e^{-2 pi i k / n}. work: work_floats() floats.
  void power(const float* x, float* work, float* power) const;
  size_t work_floats() const { return (size_t)4 * h_ * kFFTLanes; }

 private:
  // One Stockham step over sub-transforms of r * m points at stride s: twiddles W_{rm}^{p u}.
  struct Stage {
    int r = 0, m = 0, s = 0;
    std::vector<float> tw_re, tw_im;  // [p][u]
    float c[2][2] = {}, sn[2][2] = {};  // odd r: cos and sin of 2 pi j u / r, [u - 1][j - 1]
  };
  int n_ = 0, h_ = 0;  // h: the half-length complex transform
  std::vector<Stage> stages_;
  std::vector<float> post_re_, post_im_;  // W_n^k, k in [0, h]
};

}  // namespace dl::audio
