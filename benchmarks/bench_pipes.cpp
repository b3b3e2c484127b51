// Per-core ceilings of the CPU prefill kernels' inner loops, with no memory beyond L2: what the
// attention score tile and the packed int8 tile could reach on this core at best. One thread, CPU
// time (on a shared machine CPU time scatters less than wall time), best of 3 passes per mode:
//   score     attn_isa.cpp's score tile: 4 query rows, 16 partial chains, a broadcast q element
//             per FMA, the transposed K tiles of a 512-key chunk (128 KB) streamed from L2
//   dp        vpdpbusd alone, packed_tile's 2 groups x 4 tokens (weights and activations in L1)
//   dp+epi    the same with packed_tile's f32 epilogue per block and output (cvt, dw * da, two FMAs)
//   dp+epi-1  the epilogue without the zero-point FMA (as an exact integer offset would allow)
//   dp+cvt    the epilogue's conversion and an add only
//
//   g++ -O3 -std=c++17 -mavx512f -mavx512bw -mavx512vnni -mf16c benchmarks/bench_pipes.cpp -o /tmp/pipes
//   /tmp/pipes
#include <immintrin.h>
#include <time.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>

static double cpu_now() {
  timespec t;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

alignas(64) static float q[4][64];
alignas(64) static float S[4][512];
alignas(64) static unsigned char W[2][8][64];
alignas(64) static signed char A[4][2048];
alignas(64) static float SC[32][8];
alignas(64) static unsigned short DW[2][32][16];
static volatile float sink;

// attn_isa.cpp's score_tile<4, 64>: partial sum l = d % 16 per key, then the fixed add tree.
__attribute__((noinline)) static void score_tile(const float* Kt, float* const* out) {
  __m512 t01[4], s0[4];
  for (int g = 0; g < 4; ++g) {
    __m512 p[4][4];
    for (int i = 0; i < 4; ++i)
      for (int e = 0; e < 4; ++e) p[i][e] = _mm512_setzero_ps();
    for (int c = 0; c < 64; c += 16)
      for (int e = 0; e < 4; ++e) {
        const int d = c + 4 * g + e;
        const __m512 kt = _mm512_loadu_ps(Kt + d * 16);
        for (int i = 0; i < 4; ++i) p[i][e] = _mm512_fmadd_ps(_mm512_set1_ps(q[i][d]), kt, p[i][e]);
      }
    for (int i = 0; i < 4; ++i) {
      const __m512 sg = _mm512_add_ps(_mm512_add_ps(p[i][0], p[i][2]), _mm512_add_ps(p[i][1], p[i][3]));
      if (g == 0 || g == 2)
        s0[i] = sg;
      else if (g == 1)
        t01[i] = _mm512_add_ps(s0[i], sg);
      else
        _mm512_storeu_ps(out[i], _mm512_add_ps(t01[i], _mm512_add_ps(s0[i], sg)));
    }
  }
}

static double score(long n, const float* kt) {
  for (long r = 0; r < n; ++r) {
    float* out[4] = {S[0], S[1], S[2], S[3]};
    for (int jb = 0; jb < 512; jb += 16) {
      score_tile(kt + jb * 64, out);
      for (int i = 0; i < 4; ++i) out[i] += 16;
    }
  }
  sink = S[1][7];
  return 4.0 * 512 * 64 / 16 * n;
}

// MODE 0: dp only; 1: packed_tile's epilogue; 2: without the zero-point FMA; 3: cvt + add.
template <int MODE>
__attribute__((noinline)) static double dp(long n) {
  __m512 acc[2][4];
  for (int i = 0; i < 2; ++i)
    for (int t = 0; t < 4; ++t) acc[i][t] = _mm512_setzero_ps();
  __m512i keep[2][4];
  for (long r = 0; r < n; ++r) {
    const int b = (int)(r & 31);
    __m512i is[2][4];
    for (int i = 0; i < 2; ++i)
      for (int t = 0; t < 4; ++t) is[i][t] = _mm512_setzero_si512();
    for (int j = 0; j < 8; ++j) {
      const __m512i w0 = _mm512_load_si512(W[0][j]), w1 = _mm512_load_si512(W[1][j]);
      for (int t = 0; t < 4; ++t) {
        int v;
        std::memcpy(&v, A[t] + b * 32 + j * 4, 4);
        const __m512i x = _mm512_set1_epi32(v);
        is[0][t] = _mm512_dpbusd_epi32(is[0][t], w0, x);
        is[1][t] = _mm512_dpbusd_epi32(is[1][t], w1, x);
      }
    }
    if (MODE == 0) {
      for (int i = 0; i < 2; ++i)
        for (int t = 0; t < 4; ++t) keep[i][t] = _mm512_add_epi32(r ? keep[i][t] : _mm512_setzero_si512(), is[i][t]);
      continue;
    }
    for (int i = 0; i < 2; ++i) {
      const __m512 dw = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(DW[i][b])));
      for (int t = 0; t < 4; ++t) {
        const __m512 f = _mm512_cvtepi32_ps(is[i][t]);
        if (MODE == 3) {
          acc[i][t] = _mm512_add_ps(f, acc[i][t]);
          continue;
        }
        acc[i][t] = _mm512_fmadd_ps(f, _mm512_mul_ps(dw, _mm512_set1_ps(SC[b][t])), acc[i][t]);
        if (MODE == 1) acc[i][t] = _mm512_fmadd_ps(dw, _mm512_set1_ps(SC[b][4 + t]), acc[i][t]);
      }
    }
  }
  float s = 0;
  for (int i = 0; i < 2; ++i)
    for (int t = 0; t < 4; ++t)
      s += _mm512_reduce_add_ps(acc[i][t]) + (MODE == 0 ? (float)_mm512_reduce_add_epi32(keep[i][t]) : 0.f);
  sink = s;
  return 64.0 * n;
}

template <class F>
static void report(const char* name, const char* unit, F f) {
  double best = 0;
  for (int k = 0; k < 3; ++k) {
    const double t0 = cpu_now();
    const double ops = f();
    best = std::max(best, ops / (cpu_now() - t0));
  }
  std::printf("%-9s %5.2f G %s per CPU s\n", name, best / 1e9, unit);
}

int main() {
  float* kt = static_cast<float*>(std::aligned_alloc(64, 512 * 64 * 4));
  for (int i = 0; i < 512 * 64; ++i) kt[i] = 1e-6f * (i % 977);
  for (int i = 0; i < 4 * 64; ++i) q[i / 64][i % 64] = 1e-3f * i;
  for (int i = 0; i < 2 * 8 * 64; ++i) (&W[0][0][0])[i] = (unsigned char)(i * 7);
  for (int i = 0; i < 4 * 2048; ++i) (&A[0][0])[i] = (signed char)(i * 13);
  for (int i = 0; i < 32 * 8; ++i) (&SC[0][0])[i] = 1e-3f * (i % 17);
  for (int i = 0; i < 2 * 32 * 16; ++i) (&DW[0][0][0])[i] = 0x2000 + (i % 97);
  report("score", "zmm FMA", [&] { return score(20000, kt); });
  report("dp", "vpdpbusd", [] { return dp<0>(20000000); });
  report("dp+epi", "vpdpbusd", [] { return dp<1>(20000000); });
  report("dp+epi-1", "vpdpbusd", [] { return dp<2>(20000000); });
  report("dp+cvt", "vpdpbusd", [] { return dp<3>(20000000); });
  std::free(kt);
  return 0;
}
