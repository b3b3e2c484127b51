// Power spectra of real frames (see fft.h): the n-point real DFT as an n/2-point complex FFT of
// z_m = x_{2m} + i x_{2m+1} (Stockham steps, natural order, no bit reversal), then the split into
// the even and odd halves' spectra. Twiddles are computed in double and rounded once.
#include "audio/fft.h"

#include <cmath>
#include <stdexcept>
#include <string>
#include <utility>

namespace dl::audio {

namespace {

constexpr int L = kFFTLanes;

// One radix-R butterfly over the lanes: inputs a_j at x + in0 + j * in_step, outputs
// b_u = sum_j a_j W_R^{j u} times the twiddle w_u at y + out0 + u * out_step. Everything is
// copied through local arrays, so the lane loops vectorize (no aliasing to prove).
template <int R>
inline void butterfly(const float* xr, const float* xi, size_t in0, size_t in_step, float* yr, float* yi, size_t out0,
                      size_t out_step, const float* twr, const float* twi, const float (*c)[2], const float (*sn)[2]) {
  alignas(64) float ar[R][L], ai[R][L], br[R][L], bi[R][L];
  for (int j = 0; j < R; ++j)
    for (int l = 0; l < L; ++l) ar[j][l] = xr[in0 + j * in_step + l], ai[j][l] = xi[in0 + j * in_step + l];
  if constexpr (R == 2) {
    for (int l = 0; l < L; ++l) {
      br[0][l] = ar[0][l] + ar[1][l], bi[0][l] = ai[0][l] + ai[1][l];
      br[1][l] = ar[0][l] - ar[1][l], bi[1][l] = ai[0][l] - ai[1][l];
    }
  } else if constexpr (R == 4) {
    for (int l = 0; l < L; ++l) {
      const float t0r = ar[0][l] + ar[2][l], t0i = ai[0][l] + ai[2][l], t1r = ar[0][l] - ar[2][l], t1i = ai[0][l] - ai[2][l];
      const float t2r = ar[1][l] + ar[3][l], t2i = ai[1][l] + ai[3][l], t3r = ar[1][l] - ar[3][l], t3i = ai[1][l] - ai[3][l];
      br[0][l] = t0r + t2r, bi[0][l] = t0i + t2i;
      br[2][l] = t0r - t2r, bi[2][l] = t0i - t2i;
      br[1][l] = t1r + t3i, bi[1][l] = t1i - t3r;  // t1 - i t3
      br[3][l] = t1r - t3i, bi[3][l] = t1i + t3r;  // t1 + i t3
    }
  } else {
    // Odd R (3, 5): inputs j and R - j share cos and flip sin, so
    // b_u = a_0 + sum_j cos(2 pi j u / R) (a_j + a_{R-j}) - i sum_j sin(2 pi j u / R) (a_j - a_{R-j}).
    constexpr int H = R / 2;
    alignas(64) float sr[H][L], si[H][L], dr[H][L], di[H][L];
    for (int j = 0; j < H; ++j)
      for (int l = 0; l < L; ++l) {
        sr[j][l] = ar[j + 1][l] + ar[R - 1 - j][l], si[j][l] = ai[j + 1][l] + ai[R - 1 - j][l];
        dr[j][l] = ar[j + 1][l] - ar[R - 1 - j][l], di[j][l] = ai[j + 1][l] - ai[R - 1 - j][l];
      }
    for (int l = 0; l < L; ++l) {
      float tr = ar[0][l], ti = ai[0][l];
      for (int j = 0; j < H; ++j) tr += sr[j][l], ti += si[j][l];
      br[0][l] = tr, bi[0][l] = ti;
    }
    for (int u = 1; u <= H; ++u)
      for (int l = 0; l < L; ++l) {
        float tr = ar[0][l], ti = ai[0][l], ur = 0.f, ui = 0.f;
        for (int j = 0; j < H; ++j) {
          tr += c[u - 1][j] * sr[j][l], ti += c[u - 1][j] * si[j][l];
          ur += sn[u - 1][j] * dr[j][l], ui += sn[u - 1][j] * di[j][l];
        }
        br[u][l] = tr + ui, bi[u][l] = ti - ur;          // T - i U
        br[R - u][l] = tr - ui, bi[R - u][l] = ti + ur;  // T + i U
      }
  }
  for (int u = 0; u < R; ++u) {
    const float wr = twr[u], wi = twi[u];
    float* orr = yr + out0 + u * out_step;
    float* oi = yi + out0 + u * out_step;
    for (int l = 0; l < L; ++l) {
      orr[l] = br[u][l] * wr - bi[u][l] * wi;
      oi[l] = br[u][l] * wi + bi[u][l] * wr;
    }
  }
}

}  // namespace

RealFFT::RealFFT(int n) : n_(n), h_(n / 2) {
  if (n < 2 || n % 2 != 0 || n > (1 << 16)) throw std::invalid_argument("RealFFT: bad size " + std::to_string(n));
  int rest = h_;
  std::vector<int> radices;
  for (int r : {4, 2, 3, 5})
    while (rest % r == 0) {
      radices.push_back(r);
      rest /= r;
    }
  if (rest != 1) throw std::invalid_argument("RealFFT: " + std::to_string(n) + " / 2 is not a product of 2, 3, 5");
  int len = h_, s = 1;
  for (int r : radices) {
    Stage st;
    st.r = r;
    st.m = len / r;
    st.s = s;
    st.tw_re.resize((size_t)st.m * r);
    st.tw_im.resize((size_t)st.m * r);
    for (int p = 0; p < st.m; ++p)
      for (int u = 0; u < r; ++u) {
        const double a = -2.0 * M_PI * (double)((int64_t)p * u % len) / len;
        st.tw_re[(size_t)p * r + u] = (float)std::cos(a);
        st.tw_im[(size_t)p * r + u] = (float)std::sin(a);
      }
    for (int u = 1; u <= r / 2 && r % 2 == 1; ++u)
      for (int j = 1; j <= r / 2; ++j) {
        const double a = 2.0 * M_PI * (double)(j * u % r) / r;
        st.c[u - 1][j - 1] = (float)std::cos(a);
        st.sn[u - 1][j - 1] = (float)std::sin(a);
      }
    stages_.push_back(std::move(st));
    len /= r;
    s *= r;
  }
  post_re_.resize((size_t)h_ + 1);
  post_im_.resize((size_t)h_ + 1);
  for (int k = 0; k <= h_; ++k) {
    const double a = -2.0 * M_PI * k / n;
    post_re_[k] = (float)std::cos(a);
    post_im_[k] = (float)std::sin(a);
  }
}

void RealFFT::power(const float* x, float* work, float* power) const {
  const int h = h_;
  float* xr = work;
  float* xi = work + (size_t)h * L;
  float* yr = work + (size_t)2 * h * L;
  float* yi = work + (size_t)3 * h * L;
  for (int m = 0; m < h; ++m)
    for (int l = 0; l < L; ++l) {
      xr[m * L + l] = x[(2 * m) * L + l];
      xi[m * L + l] = x[(2 * m + 1) * L + l];
    }
  // DIF Stockham: for a sub-transform of r m points (stride s), b_u = sum_j a_{p + j m} W_r^{j u}
  // goes to output r p + u times W_{rm}^{p u}; the next step transforms each u's m points.
  for (const Stage& st : stages_) {
    const int r = st.r, m = st.m, s = st.s;
    const size_t in_step = (size_t)s * m * L, out_step = (size_t)s * L;
    for (int p = 0; p < m; ++p) {
      const float* twr = st.tw_re.data() + (size_t)p * r;
      const float* twi = st.tw_im.data() + (size_t)p * r;
      for (int q = 0; q < s; ++q) {
        const size_t in0 = (size_t)(q + s * p) * L, out0 = (size_t)(q + s * r * p) * L;
        switch (r) {
          case 2: butterfly<2>(xr, xi, in0, in_step, yr, yi, out0, out_step, twr, twi, st.c, st.sn); break;
          case 3: butterfly<3>(xr, xi, in0, in_step, yr, yi, out0, out_step, twr, twi, st.c, st.sn); break;
          case 4: butterfly<4>(xr, xi, in0, in_step, yr, yi, out0, out_step, twr, twi, st.c, st.sn); break;
          default: butterfly<5>(xr, xi, in0, in_step, yr, yi, out0, out_step, twr, twi, st.c, st.sn); break;
        }
      }
    }
    std::swap(xr, yr);
    std::swap(xi, yi);
  }
  // X_k = E_k + W_n^k O_k with E_k = (Z_k + conj Z_{h-k}) / 2, O_k = (Z_k - conj Z_{h-k}) / (2i).
  for (int k = 0; k <= h; ++k) {
    const float *zr = xr + (size_t)(k % h) * L, *zi = xi + (size_t)(k % h) * L;
    const float *cr = xr + (size_t)((h - k) % h) * L, *ci = xi + (size_t)((h - k) % h) * L;
    const float wr = post_re_[k], wi = post_im_[k];
    float* pw = power + (size_t)k * L;
    for (int l = 0; l < L; ++l) {
      const float er = 0.5f * (zr[l] + cr[l]), ei = 0.5f * (zi[l] - ci[l]);
      const float or_ = 0.5f * (zi[l] + ci[l]), oi = -0.5f * (zr[l] - cr[l]);
      const float re = er + (wr * or_ - wi * oi), im = ei + (wr * oi + wi * or_);
      pw[l] = re * re + im * im;
    }
  }
}

}  // namespace dl::audio
