// What this machine's memory delivers to 1 and 2 threads streaming a buffer far past the L3: the
// floor a decode step (a few hundred MB of weights read once a token) cannot beat. Each mode sums
// 64-byte lines with AVX-512 loads (AVX2 where the CPU has no AVX-512); the threads read disjoint
// contiguous halves, or 64 KB chunks taken in turn (how a GEMV's row tiles are dealt), with and
// without software prefetch, and a non-temporal-hinted prefetch. Prints the median GB/s of REPS
// passes per mode and the best pass.
//
//   g++ -O2 -std=c++17 -march=native -pthread benchmarks/bench_membw.cpp -o /tmp/membw
//   /tmp/membw [MB=512] [REPS=10] [HUGE=1]   (HUGE: 2 MiB pages advised, as the packed weights get)
#include <immintrin.h>
#include <sys/mman.h>
#include <time.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

static double now() {
  timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

enum Pf { none, t0, t1, nta };

// Sum of the lines [b, e); four accumulators so the adds do not bound it.
template <int P>
static double sum_range(const uint8_t* b, const uint8_t* e, int dist) {
#if defined(__AVX512F__)
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (const uint8_t* p = b; p < e; p += 256) {
    if (P == t0) _mm_prefetch((const char*)p + dist, _MM_HINT_T0), _mm_prefetch((const char*)p + dist + 128, _MM_HINT_T0);
    if (P == t1) _mm_prefetch((const char*)p + dist, _MM_HINT_T1), _mm_prefetch((const char*)p + dist + 128, _MM_HINT_T1);
    if (P == nta) _mm_prefetch((const char*)p + dist, _MM_HINT_NTA), _mm_prefetch((const char*)p + dist + 128, _MM_HINT_NTA);
    a0 = _mm512_add_ps(a0, _mm512_load_ps(p));
    a1 = _mm512_add_ps(a1, _mm512_load_ps(p + 64));
    a2 = _mm512_add_ps(a2, _mm512_load_ps(p + 128));
    a3 = _mm512_add_ps(a3, _mm512_load_ps(p + 192));
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
#else
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (const uint8_t* p = b; p < e; p += 128) {
    if (P == t0) _mm_prefetch((const char*)p + dist, _MM_HINT_T0);
    if (P == t1) _mm_prefetch((const char*)p + dist, _MM_HINT_T1);
    if (P == nta) _mm_prefetch((const char*)p + dist, _MM_HINT_NTA);
    a0 = _mm256_add_ps(a0, _mm256_load_ps((const float*)p));
    a1 = _mm256_add_ps(a1, _mm256_load_ps((const float*)(p + 32)));
    a2 = _mm256_add_ps(a2, _mm256_load_ps((const float*)(p + 64)));
    a3 = _mm256_add_ps(a3, _mm256_load_ps((const float*)(p + 96)));
  }
  a0 = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
  float f[8];
  _mm256_storeu_ps(f, a0);
  return f[0] + f[1] + f[2] + f[3] + f[4] + f[5] + f[6] + f[7];
#endif
}

static double sum_any(Pf pf, const uint8_t* b, const uint8_t* e, int dist) {
  switch (pf) {
    case t0: return sum_range<t0>(b, e, dist);
    case t1: return sum_range<t1>(b, e, dist);
    case nta: return sum_range<nta>(b, e, dist);
    default: return sum_range<none>(b, e, dist);
  }
}

struct Mode {
  const char* name;
  int threads;
  bool chunked;  // 64 KB chunks taken from a shared counter, else contiguous halves
  Pf pf;
  int dist;  // prefetch distance in bytes
};

int main(int argc, char** argv) {
  const size_t mb = argc > 1 ? std::atoi(argv[1]) : 512;
  const int reps = argc > 2 ? std::atoi(argv[2]) : 10;
  const size_t n = mb << 20, chunk = 64 << 10;
  const bool huge = argc > 3 ? std::atoi(argv[3]) != 0 : true;
  uint8_t* buf = (uint8_t*)std::aligned_alloc(2 << 20, n);
  if (huge) madvise(buf, n, MADV_HUGEPAGE);
  for (size_t i = 0; i < n; i += 4) {
    float f = (float)(i & 1023) * 1e-3f;
    std::memcpy(buf + i, &f, 4);
  }
  const Mode modes[] = {
      {"1 thread, no prefetch", 1, false, none, 0},
      {"1 thread, T0 +1 KB", 1, false, t0, 1024},
      {"1 thread, T0 +4 KB", 1, false, t0, 4096},
      {"1 thread, T1 +4 KB", 1, false, t1, 4096},
      {"1 thread, T1 +16 KB", 1, false, t1, 16384},
      {"1 thread, NTA +4 KB", 1, false, nta, 4096},
      {"2 threads halves, no prefetch", 2, false, none, 0},
      {"2 threads halves, T0 +1 KB", 2, false, t0, 1024},
      {"2 threads halves, T1 +4 KB", 2, false, t1, 4096},
      {"2 threads halves, T1 +16 KB", 2, false, t1, 16384},
      {"2 threads halves, NTA +4 KB", 2, false, nta, 4096},
      {"2 threads 64 KB chunks, no pf", 2, true, none, 0},
      {"2 threads 64 KB chunks, T0 +1 KB", 2, true, t0, 1024},
  };
  double sink = 0;
  std::printf("buffer %zu MB%s, %d passes a mode, GB/s median (best)\n", mb, huge ? " (2 MiB pages advised)" : "", reps);
  for (const Mode& m : modes) {
    std::vector<double> gbs;
    for (int r = 0; r < reps; ++r) {
      std::atomic<size_t> next{0};
      std::vector<double> part(m.threads);
      auto work = [&](int t) {
        if (!m.chunked) {
          const size_t lo = n / m.threads * t, hi = n / m.threads * (t + 1);
          part[t] = sum_any(m.pf, buf + lo, buf + hi, m.dist);
        } else {
          double s = 0;
          for (size_t c; (c = next.fetch_add(1)) * chunk < n;)
            s += sum_any(m.pf, buf + c * chunk, buf + std::min(n, (c + 1) * chunk), m.dist);
          part[t] = s;
        }
      };
      const double t = now();
      std::vector<std::thread> th;
      for (int i = 1; i < m.threads; ++i) th.emplace_back(work, i);
      work(0);
      for (auto& x : th) x.join();
      const double dt = now() - t;
      for (double p : part) sink += p;
      gbs.push_back(n / dt * 1e-9);
    }
    std::sort(gbs.begin(), gbs.end());
    std::printf("  %-34s %6.1f (%5.1f)\n", m.name, gbs[gbs.size() / 2], gbs.back());
  }
  std::printf("%s", sink == 0.5 ? " " : "");
  std::free(buf);
  return 0;
}
