// CPU decode GEMVs alone, Gemma-3-270M Q4_K_M's shapes and types: per layer q (Q5_0 1024 x 640), k
// (Q5_0 256), v (Q8_0 256) in one matmul_multi, attn_output (Q4_K 640 x 1024), gate and up (Q5_0
// 2048 x 640) in one, ffn_down (Q6_K 640 x 2048); 18 layers, then the tied output matrix (Q8_0
// 262144 x 640). Random quants with small scales, packed as at load. Every matrix is distinct
// memory (246 MB a step, past the L3), so each step streams them from DRAM as a decode does.
// Prints per op family the median wall ms a step and GB/s of weights, and the step's total.
//
// Build against the extension's build tree (the tree's kernels, as the wheel has them):
//   B=build/cp311-cp311-linux_x86_64; ninja -C $B dl_core
//   g++ -O2 -std=c++17 -Icpp benchmarks/bench_decode_gemv.cpp $B/libdl_core.a -lpthread -ldl -o /tmp/decode_gemv
//   /tmp/decode_gemv [THREADS=1] [STEPS=30] [OUTPUT=1] [LAYERS=18]
#include <time.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "core/backend.h"
#include "quant/types.h"

using namespace dl;

static double now() {
  timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

struct Mat {
  std::vector<uint8_t> bytes;
  Weight w;
};

// Block bytes and where its f16 scales lie (set to small values so sums stay finite).
static std::unique_ptr<Mat> make(Backend& be, GGMLType t, int64_t rows, int64_t cols) {
  int bs = 32, ts = 0;
  std::vector<int> scales;
  switch (t) {
    case GGMLType::Q5_0: ts = 22, scales = {0}; break;
    case GGMLType::Q8_0: ts = 34, scales = {0}; break;
    case GGMLType::Q4_K: bs = 256, ts = 144, scales = {0, 2}; break;
    case GGMLType::Q6_K: bs = 256, ts = 210, scales = {208}; break;
    default: std::abort();
  }
  auto m = std::make_unique<Mat>();
  const size_t rb = (size_t)cols / bs * ts;
  m->bytes.resize(rb * rows);
  for (auto& b : m->bytes) b = (uint8_t)std::rand();
  for (size_t o = 0; o < m->bytes.size(); o += ts)
    for (int s : scales) m->bytes[o + s] = 0x00, m->bytes[o + s + 1] = 0x20;  // f16 ~0.0078
  m->w.type = (uint32_t)t;
  m->w.rows = rows, m->w.cols = cols, m->w.row_bytes = rb;
  m->w.host = m->bytes.data();
  be.load_weight(m->w, WeightUse::matmul);
  return m;
}

int main(int argc, char** argv) {
  const int threads = argc > 1 ? std::atoi(argv[1]) : 1, steps = argc > 2 ? std::atoi(argv[2]) : 30;
  const bool output = argc > 3 ? std::atoi(argv[3]) != 0 : true;
  const int L = argc > 4 ? std::atoi(argv[4]) : 18;  // fewer: the layers fit in L3 (the kernels' own speed)
  const int64_t D = 640, Q = 1024, KV = 256, F = 2048, V = 262144;
  auto be = make_cpu_backend(threads);
  std::srand(1);
  std::vector<std::unique_ptr<Mat>> q, k, v, o, g, u, dn;
  for (int l = 0; l < L; ++l) {
    q.push_back(make(*be, GGMLType::Q5_0, Q, D));
    k.push_back(make(*be, GGMLType::Q5_0, KV, D));
    v.push_back(make(*be, l % 2 ? GGMLType::Q8_0 : GGMLType::Q5_0, KV, D));
    o.push_back(make(*be, GGMLType::Q4_K, D, Q));
    g.push_back(make(*be, GGMLType::Q5_0, F, D));
    u.push_back(make(*be, GGMLType::Q5_0, F, D));
    dn.push_back(make(*be, l % 2 ? GGMLType::Q6_K : GGMLType::Q4_K, D, F));
  }
  std::unique_ptr<Mat> out = output ? make(*be, GGMLType::Q8_0, V, D) : nullptr;
  std::vector<float> x(F), y(V), yq(Q), yk(KV), yv(KV), yg(F), yu(F);
  for (auto& e : x) e = (float)(std::rand() % 2000 - 1000) / 1000.f;
  // Bytes a step per family.
  const double b_qkv = L * (Q + KV + KV) * D / 32 * 22.0 + L / 2 * KV * D / 32 * 12.0;
  const double b_gu = L * 2.0 * F * D / 32 * 22;
  const double b_o = L * (double)D * Q / 256 * 144, b_dn = L / 2 * (double)D * F / 256 * (144 + 210);
  const double b_out = output ? (double)V * D / 32 * 34 : 0;
  std::vector<double> t_qkv, t_o, t_gu, t_dn, t_out, t_all;
  double sink = 0;
  for (int s = 0; s < steps; ++s) {
    double a = 0, b = 0, c = 0, d = 0;
    const double t0 = now();
    for (int l = 0; l < L; ++l) {
      double t = now();
      const Weight* ws[3] = {&q[l]->w, &k[l]->w, &v[l]->w};
      float* ys[3] = {yq.data(), yk.data(), yv.data()};
      be->matmul_multi(ws, ys, 3, x.data(), 1);
      double t2 = now();
      a += t2 - t;
      be->matmul(o[l]->w, x.data(), 1, yg.data());
      t = now();
      b += t - t2;
      const Weight* ws2[2] = {&g[l]->w, &u[l]->w};
      float* ys2[2] = {yg.data(), yu.data()};
      be->matmul_multi(ws2, ys2, 2, x.data(), 1);
      t2 = now();
      c += t2 - t;
      be->matmul(dn[l]->w, x.data(), 1, yq.data());
      d += now() - t2;
      sink += yq[0] + yu[5];
    }
    const double t1 = now();
    if (out) be->matmul(out->w, x.data(), 1, y.data());
    const double t2 = now();
    sink += y[7];
    t_qkv.push_back(a), t_o.push_back(b), t_gu.push_back(c), t_dn.push_back(d), t_out.push_back(t2 - t1);
    t_all.push_back(t2 - t0);
  }
  auto med = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  auto line = [&](const char* what, const std::vector<double>& ts, double bytes) {
    const double m = med(ts);
    std::printf("  %-22s %7.3f ms  %6.2f GB/s\n", what, m * 1e3, bytes / m * 1e-9);
  };
  std::printf("%d thread(s), median of %d steps%s\n", threads, steps, sink == 0.5 ? " " : "");
  line("q,k,v (Q5_0/Q8_0)", t_qkv, b_qkv);
  line("attn_output (Q4_K)", t_o, b_o);
  line("gate,up (Q5_0)", t_gu, b_gu);
  line("ffn_down (Q4_K/Q6_K)", t_dn, b_dn);
  if (out) line("output (Q8_0)", t_out, b_out);
  line("step", t_all, b_qkv + b_o + b_gu + b_dn + b_out);
  return 0;
}
