// CPU decode attention alone, Gemma-3-270M's shape: 18 layers of 4 query heads on 1 KV head of 256,
// f16 cache, every sixth layer global and the rest a 512-key sliding window; one query row a step at
// positions depth - 1, depth, ... (so a window straddles its two 512-key chunks as in a real
// decode). Between steps a 300 MB read evicts the cache from L2/L3 as the step's weights would.
// Prints the median and best process CPU time of a step's attention (CPU time: on a shared
// machine it scatters far less than wall time; with 2 threads it counts the pool's spinning too).
//
// Build against the extension's build tree (the tree's kernels, as the wheel has them):
//   B=build/cp311-cp311-linux_x86_64; ninja -C $B
//   g++ -O2 -std=c++17 -Icpp benchmarks/bench_attention_decode.cpp $B/libdl_core.a -lpthread -ldl -o /tmp/attn_decode
//   /tmp/attn_decode DEPTH [THREADS=1] [STEPS=40] [EVICT=1] [LAYERS=all|swa|global]
#include <time.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "core/backend.h"

using namespace dl;

static double cpu_now() {
  timespec t;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s DEPTH [THREADS] [STEPS] [EVICT] [all|swa|global]\n", argv[0]);
    return 2;
  }
  const int depth = std::atoi(argv[1]), threads = argc > 2 ? std::atoi(argv[2]) : 1;
  const int steps = argc > 3 ? std::atoi(argv[3]) : 40;
  const bool evict_caches = argc > 4 ? std::atoi(argv[4]) != 0 : true;
  const std::string layers = argc > 5 ? argv[5] : "all";
  const int L = 18, H = 4, hd = 256, window = 512;
  const int64_t ctx = depth + steps;
  auto be = make_cpu_backend(threads);
  const size_t row = hd * 2, layer_bytes = 2 * (size_t)ctx * row;  // [K rows | V rows] per layer
  BufferPtr pool = be->alloc(layer_bytes * L, "kv");
  uint16_t* kv = static_cast<uint16_t*>(pool->data());
  std::srand(1);
  for (size_t i = 0; i < layer_bytes * L / 2; ++i)  // f16 of magnitude 0.125 .. 0.25, either sign
    kv[i] = (uint16_t)(0x3000 + (std::rand() & 0x3ff) + ((std::rand() & 1) << 15));
  std::vector<float> q(H * hd), out(H * hd);
  for (auto& x : q) x = (float)(std::rand() % 2000 - 1000) / 1000.f;
  std::vector<char> evict((size_t)300 << 20, 1);
  std::vector<double> ts;
  double sink = 0;
  int32_t page0 = 0, pos = 0;
  for (int s = 0; s < steps; ++s) {
    pos = depth - 1 + s;
    if (evict_caches)
      for (size_t i = 0; i < evict.size(); i += 64) sink += evict[i];
    const double t0 = cpu_now();
    for (int l = 0; l < L; ++l) {
      const bool global = l % 6 == 5;
      if ((layers == "swa" && global) || (layers == "global" && !global)) continue;
      AttnArgs a;
      a.q = q.data();
      a.q_stride = H * hd;
      a.kv.base = static_cast<uint8_t*>(pool->data()) + l * layer_bytes;
      a.kv.pages = &page0;
      a.kv.n_pages = 1;
      a.kv.page_shift = 62;
      a.kv.page_bytes = layer_bytes;
      a.kv.k_off = 0;
      a.kv.v_off = (size_t)ctx * row;
      a.kv.row_bytes = row;
      a.kv.type = KVType::f16;
      a.n_tok = 1;
      a.n_kv = pos + 1;
      a.n_heads = H;
      a.n_kv_heads = 1;
      a.head_dim = hd;
      a.q_pos = &pos;
      a.window = global ? 0 : window;
      a.scale = 1.f / 16.f;
      a.out = out.data();
      a.out_stride = H * hd;
      be->attention(a);
      sink += out[0];
    }
    ts.push_back(cpu_now() - t0);
  }
  std::sort(ts.begin(), ts.end());
  std::printf("depth %d, %d thread(s), layers %s: attention %.3f CPU ms a step (median of %d), best %.3f%s\n", depth,
              threads, layers.c_str(), ts[ts.size() / 2] * 1e3, steps, ts[0] * 1e3, sink == 0.5 ? " " : "");
  return 0;
}
