// Fuzz harness for the audio tower loader: loads every mmproj path on argv and, when it
// loads, encodes a short clip both ways (clip rows and full window). dl::Error and
// std::invalid_argument are expected and counted; anything else exits 2. Built under
// -fsanitize by tests/test_audio_asan.py.
#include <cmath>
#include <cstdio>
#include <exception>
#include <stdexcept>
#include <vector>

#include "audio/tower.h"
#include "core/errors.h"

int main(int argc, char** argv) {
  int ok = 0, rejected = 0;
  double sink = 0;
  std::vector<float> x(4000);
  for (size_t i = 0; i < x.size(); ++i) x[i] = 0.3f * std::sin(0.05f * (float)i);
  for (int i = 1; i < argc; ++i) {
    try {
      auto e = dl::audio::AudioEncoder::load(argv[i], "cpu", 1);
      dl::audio::AudioScratch s;
      for (bool full : {false, true}) {
        std::vector<float> out((size_t)(e->n_rows((int64_t)x.size(), full) * e->config().proj_dim));
        const int64_t n = e->encode(x.data(), (int64_t)x.size(), full, s, out.data(), (int64_t)out.size());
        for (int64_t k = 0; k < n * e->config().proj_dim; ++k) sink += out[(size_t)k];
      }
      ++ok;
    } catch (const dl::Error&) {
      ++rejected;
    } catch (const std::invalid_argument&) {
      ++rejected;
    } catch (const std::exception& ex) {
      std::fprintf(stderr, "%s: unexpected exception: %s\n", argv[i], ex.what());
      return 2;
    }
  }
  std::printf("ok %d rejected %d (%d)\n", ok, rejected, std::isfinite(sink) ? 1 : 0);
  return 0;
}
