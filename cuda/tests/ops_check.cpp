// Standalone check of the CUDA backend: every op and weight type against a host
// reference on random data and awkward shapes, plus rough decode timings.
// Build: see cuda/tests/run_check.sh. Exit status 1 if any case fails.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "core/backend.h"
#include "core/errors.h"
#include "core/half.h"
#include "cuda_backend.h"
#include "quant/quant.h"
#include "quant/types.h"

using namespace dl;

namespace {

std::mt19937 rng(1234);
int n_fail = 0, n_pass = 0;

float urand(float lo, float hi) { return std::uniform_real_distribution<float>(lo, hi)(rng); }
std::vector<float> rand_vec(size_t n, float lo = -1.f, float hi = 1.f) {
  std::vector<float> v(n);
  for (auto& x : v) x = urand(lo, hi);
  return v;
}

// max|a-b| / max|b|; NaN anywhere counts as infinite error.
double nerr(const float* a, const double* b, size_t n) {
  double md = 0, mb = 0;
  for (size_t i = 0; i < n; ++i) {
    const double d = std::fabs((double)a[i] - b[i]);
    if (!(d == d) || std::isinf(a[i])) return INFINITY;
    md = std::max(md, d);
    mb = std::max(mb, std::fabs(b[i]));
  }
  return mb > 0 ? md / mb : md;
}
double nerr(const std::vector<float>& a, const std::vector<double>& b) { return nerr(a.data(), b.data(), b.size()); }

void report(const char* op, const std::string& what, double err, double tol) {
  const bool ok = err <= tol;
  (ok ? n_pass : n_fail)++;
  std::printf("%-12s %-54s err %.2e %s\n", op, what.c_str(), err, ok ? "ok" : "FAIL");
}

struct Dev {
  Backend& be;
  template <class T>
  BufferPtr up(const std::vector<T>& v, const char* what = "test") {
    BufferPtr b = be.alloc(v.size() * sizeof(T), what);
    be.upload(b->data(), v.data(), v.size() * sizeof(T));
    return b;
  }
  BufferPtr nan(size_t n) { return up(std::vector<float>(n, NAN)); }
  template <class T = float>
  std::vector<T> down(const BufferPtr& b, size_t n) {
    std::vector<T> v(n);
    be.download(v.data(), b->data(), n * sizeof(T));
    return v;
  }
};

const char* tname(uint32_t t) { return type_traits(t)->name; }

// A rows x cols matrix of `type`: quantized from random floats where quantize_row can,
// else random blocks with small f16 scales (k-quants).
std::vector<uint8_t> make_weight(uint32_t type, int64_t rows, int64_t cols) {
  const size_t rb = (size_t)type_nbytes(type, cols);
  std::vector<uint8_t> w(rb * rows);
  const GGMLType t = (GGMLType)type;
  if (t == GGMLType::Q4_K || t == GGMLType::Q5_K || t == GGMLType::Q6_K) {
    for (auto& b : w) b = (uint8_t)(rng() & 0xff);
    const size_t bs = (size_t)type_traits(type)->type_size;
    for (size_t off = 0; off < w.size(); off += bs) {
      const uint16_t d = f32_to_f16(urand(0.001f, 0.01f)), m = f32_to_f16(urand(0.001f, 0.01f));
      if (t == GGMLType::Q6_K) {
        std::memcpy(&w[off + 208], &d, 2);
      } else {
        std::memcpy(&w[off], &d, 2);
        std::memcpy(&w[off + 2], &m, 2);
      }
    }
  } else {
    for (int64_t r = 0; r < rows; ++r) {
      const std::vector<float> x = rand_vec((size_t)cols);
      quantize_row(type, x.data(), w.data() + r * rb, cols);
    }
  }
  return w;
}

std::vector<float> dequant(uint32_t type, const std::vector<uint8_t>& w, int64_t rows, int64_t cols) {
  const size_t rb = (size_t)type_nbytes(type, cols);
  std::vector<float> f((size_t)(rows * cols));
  for (int64_t r = 0; r < rows; ++r) dequantize_row(type, w.data() + r * rb, f.data() + r * cols, cols);
  return f;
}

Weight load(Backend& be, uint32_t type, std::vector<uint8_t>& bytes, int64_t rows, int64_t cols) {
  Weight w;
  w.type = type, w.rows = rows, w.cols = cols, w.row_bytes = (size_t)type_nbytes(type, cols);
  w.host = bytes.data();
  be.load_weight(w);
  return w;
}

void check_matmul(Backend& be) {
  Dev d{be};
  const uint32_t types[] = {0, 1, 30, 8, 2, 3, 6, 7, 12, 13, 14};
  for (uint32_t type : types) {
    const int64_t qk = type_traits(type)->block_size;
    // (rows, cols, max n): 1 row, odd rows, rows not a multiple of the 64-row tile.
    struct S { int64_t rows, cols; int64_t nmax; };
    std::vector<S> shapes;
    if (qk == 1) shapes = {{1, 7, 300}, {67, 33, 300}, {130, 1000, 64}, {3, 4096, 17}};
    else if (qk == 32) shapes = {{1, 32, 300}, {67, 96, 300}, {130, 2048, 64}, {3, 4096, 17}};
    else shapes = {{1, 256, 300}, {67, 512, 300}, {130, 2048, 64}, {3, 4096, 17}};
    double worst = 0;
    for (const S& s : shapes) {
      std::vector<uint8_t> wb = make_weight(type, s.rows, s.cols);
      const std::vector<float> wf = dequant(type, wb, s.rows, s.cols);
      Weight w = load(be, type, wb, s.rows, s.cols);
      for (int64_t n : {1, 3, 8, 17, 64, 300}) {
        if (n > s.nmax) continue;
        const std::vector<float> x = rand_vec((size_t)(n * s.cols));
        std::vector<double> ref((size_t)(n * s.rows));
        for (int64_t t = 0; t < n; ++t)
          for (int64_t r = 0; r < s.rows; ++r) {
            double acc = 0;
            const float* wr = &wf[r * s.cols];
            const float* xr = &x[t * s.cols];
            for (int64_t k = 0; k < s.cols; ++k) acc += (double)wr[k] * xr[k];
            ref[t * s.rows + r] = acc;
          }
        BufferPtr xd = d.up(x), yd = d.nan(ref.size());
        be.matmul(w, (const float*)xd->data(), n, (float*)yd->data());
        const double e = nerr(d.down(yd, ref.size()), ref);
        worst = std::max(worst, e);
        if (e > 1e-5)
          report("matmul", std::string(tname(type)) + " rows " + std::to_string(s.rows) + " cols " +
                               std::to_string(s.cols) + " n " + std::to_string(n), e, 1e-5);
      }
    }
    report("matmul", std::string(tname(type)) + " (worst of all shapes, n 1..300)", worst, 1e-5);
  }
  // matmul_multi: three types over one x.
  {
    const int64_t cols = 512, n = 5;
    const uint32_t ts[3] = {8, 12, 1};
    const int64_t rs[3] = {33, 64, 7};
    std::vector<uint8_t> wb[3];
    Weight ws[3];
    std::vector<float> wf[3];
    for (int i = 0; i < 3; ++i) {
      wb[i] = make_weight(ts[i], rs[i], cols);
      wf[i] = dequant(ts[i], wb[i], rs[i], cols);
      ws[i] = load(be, ts[i], wb[i], rs[i], cols);
    }
    const std::vector<float> x = rand_vec((size_t)(n * cols));
    BufferPtr xd = d.up(x), yd[3];
    float* ys[3];
    const Weight* wp[3];
    for (int i = 0; i < 3; ++i) yd[i] = d.nan((size_t)(n * rs[i])), ys[i] = (float*)yd[i]->data(), wp[i] = &ws[i];
    be.matmul_multi(wp, ys, 3, (const float*)xd->data(), n);
    double worst = 0;
    for (int i = 0; i < 3; ++i) {
      std::vector<double> ref((size_t)(n * rs[i]));
      for (int64_t t = 0; t < n; ++t)
        for (int64_t r = 0; r < rs[i]; ++r) {
          double acc = 0;
          for (int64_t k = 0; k < cols; ++k) acc += (double)wf[i][r * cols + k] * x[t * cols + k];
          ref[t * rs[i] + r] = acc;
        }
      worst = std::max(worst, nerr(d.down(yd[i], ref.size()), ref));
    }
    report("matmul_multi", "q8_0 + q4_K + f16, cols 512, n 5", worst, 1e-5);
  }
}

void check_get_rows(Backend& be) {
  Dev d{be};
  for (uint32_t type : {0u, 1u, 30u, 8u, 2u, 3u, 6u, 7u, 12u, 13u, 14u}) {
    const int64_t qk = type_traits(type)->block_size;
    const int64_t cols = qk == 1 ? 13 : qk == 32 ? 96 : 512, rows = 50;
    std::vector<uint8_t> wb = make_weight(type, rows, cols);
    const std::vector<float> wf = dequant(type, wb, rows, cols);
    Weight w = load(be, type, wb, rows, cols);
    const std::vector<int32_t> ids = {0, 49, 7, 7, 23};
    BufferPtr idd = d.up(ids), out = d.nan(ids.size() * cols);
    be.get_rows(w, (const int32_t*)idd->data(), (int64_t)ids.size(), (float*)out->data());
    const std::vector<float> got = d.down(out, ids.size() * cols);
    double md = 0;
    for (size_t i = 0; i < ids.size(); ++i)
      for (int64_t c = 0; c < cols; ++c) {
        const double e = std::fabs((double)got[i * cols + c] - wf[ids[i] * cols + c]);
        md = std::isnan(e) ? INFINITY : std::max(md, e);
      }
    report("get_rows", std::string(tname(type)) + " cols " + std::to_string(cols) + " (max abs diff, bit-exact)", md,
           0);
  }
}

void check_norms(Backend& be) {
  Dev d{be};
  for (int64_t dim : {1, 7, 4096, 5000}) {
    const int64_t rows = 5;
    std::vector<float> x = rand_vec((size_t)(rows * dim), -3, 3), w = rand_vec((size_t)dim), b = rand_vec((size_t)dim);
    for (auto& v : x) v += 10.f;  // an offset: layer_norm must not cancel
    std::vector<double> rr((size_t)(rows * dim)), lr(rr.size());
    for (int64_t r = 0; r < rows; ++r) {
      double ss = 0, mean = 0, var = 0;
      for (int64_t i = 0; i < dim; ++i) ss += (double)x[r * dim + i] * x[r * dim + i], mean += x[r * dim + i];
      mean /= dim;
      for (int64_t i = 0; i < dim; ++i) var += (x[r * dim + i] - mean) * (x[r * dim + i] - mean);
      const double s = 1.0 / std::sqrt(ss / dim + 1e-6), inv = 1.0 / std::sqrt(var / dim + 1e-5);
      for (int64_t i = 0; i < dim; ++i) {
        rr[r * dim + i] = x[r * dim + i] * s * w[i];
        lr[r * dim + i] = (x[r * dim + i] - mean) * inv * w[i] + b[i];
      }
    }
    BufferPtr xd = d.up(x), wd = d.up(w), bd = d.up(b), y = d.nan(x.size());
    be.rms_norm((const float*)xd->data(), (const float*)wd->data(), (float*)y->data(), rows, dim, 1e-6f);
    report("rms_norm", "dim " + std::to_string(dim), nerr(d.down(y, x.size()), rr), 1e-6);
    BufferPtr xa = d.up(x);  // in place
    be.layer_norm((const float*)xa->data(), (const float*)wd->data(), (const float*)bd->data(), (float*)xa->data(),
                  rows, dim, 1e-5f);
    report("layer_norm", "dim " + std::to_string(dim) + " in place, x ~ 10 +- 3", nerr(d.down(xa, x.size()), lr), 1e-6);
  }
}

void check_rope(Backend& be) {
  Dev d{be};
  struct C { bool neox; int hd, n_rot; float fs, ms; bool ff, inv; };
  for (const C& c : {C{true, 128, 128, 1.f, 1.f, false, false}, C{false, 64, 32, 0.25f, 1.f, false, false},
                     C{true, 128, 64, 1.f, 1.2f, true, false}, C{true, 256, 256, 1.f, 0.9f, false, true},
                     C{false, 80, 80, 1.f, 1.f, true, false}}) {
    const int64_t n_tok = 6, heads = 3, stride = heads * c.hd + 5;
    const std::vector<int32_t> pos = {0, 1, 17, 4095, 65535, 131071};
    std::vector<float> x = rand_vec((size_t)(n_tok * stride));
    std::vector<float> ff = rand_vec((size_t)c.n_rot / 2, 1.f, 8.f);
    std::vector<double> invf((size_t)c.n_rot / 2);
    for (auto& v : invf) v = std::pow(10.0, urand(-6.f, 0.f));
    RopeParams p;
    p.neox = c.neox, p.n_rot = c.n_rot, p.base = 500000.f, p.freq_scale = c.fs, p.mscale = c.ms;
    BufferPtr ffd = d.up(ff), invd = d.up(invf), posd = d.up(pos), xd = d.up(x);
    if (c.ff) p.freq_factors = (const float*)ffd->data();
    if (c.inv) p.inv_freq = (const double*)invd->data();
    std::vector<double> ref(x.begin(), x.end());
    const int half = c.n_rot / 2;
    for (int64_t t = 0; t < n_tok; ++t)
      for (int h = 0; h < heads; ++h)
        for (int i = 0; i < half; ++i) {
          double inv = c.inv ? invf[i] : std::pow((double)p.base, -2.0 * i / c.n_rot);
          if (c.ff) inv /= ff[i];
          const double th = (double)pos[t] * c.fs * inv;
          const float cs = (float)std::cos(th) * c.ms, sn = (float)std::sin(th) * c.ms;
          const int i0 = c.neox ? i : 2 * i, i1 = c.neox ? i + half : 2 * i + 1;
          const size_t o = (size_t)(t * stride + h * c.hd);
          const double a = x[o + i0], b = x[o + i1];
          ref[o + i0] = a * cs - b * sn;
          ref[o + i1] = a * sn + b * cs;
        }
    be.rope((float*)xd->data(), n_tok, stride, (int)heads, c.hd, (const int32_t*)posd->data(), p);
    char what[128];
    std::snprintf(what, sizeof what, "%s hd %d n_rot %d fs %.2f ms %.1f%s%s pos<=131071", c.neox ? "neox" : "adjacent",
                  c.hd, c.n_rot, c.fs, c.ms, c.ff ? " factors" : "", c.inv ? " inv_freq" : "");
    report("rope", what, nerr(d.down(xd, x.size()), ref), 1e-6);
  }
}

size_t row_bytes_of(KVType t, int64_t dim) {
  return t == KVType::f32 ? dim * 4 : t == KVType::f16 ? dim * 2 : (size_t)dim / 32 * 34;
}
const char* kvname(KVType t) { return t == KVType::f32 ? "f32" : t == KVType::f16 ? "f16" : "q8_0"; }

// Encodes one cache row on the host as the cache holds it, and decodes it back.
void host_row(KVType t, const float* x, int64_t dim, uint8_t* out, float* dec) {
  if (t == KVType::f32) std::memcpy(out, x, dim * 4);
  else if (t == KVType::f16) quantize_row((uint32_t)GGMLType::F16, x, out, dim);
  else quantize_row((uint32_t)GGMLType::Q8_0, x, out, dim);
  dequantize_row(t == KVType::f32 ? 0 : t == KVType::f16 ? 1 : 8, out, dec, dim);
}

struct AttnCase {
  KVType type;
  int64_t n_kv, n_tok;
  int heads, kvh, hd, page_rows, window;
  float softcap;
  bool encoder;
};

// kv_store through a shuffled block table, then attention, both against the host.
// Returns the attention output error; stores report themselves.
void check_attention_case(Backend& be, const AttnCase& c, bool bench = false) {
  Dev d{be};
  const int64_t kv_dim = (int64_t)c.kvh * c.hd;
  const size_t rb = row_bytes_of(c.type, kv_dim);
  const int P = c.page_rows, shift = __builtin_ctz((unsigned)P);
  const int64_t n_pages = (c.n_kv + P - 1) / P, pool_pages = n_pages + 7;
  const size_t k_off = 32, v_off = 32 + P * rb, page_bytes = 32 + 2 * P * rb + 48;
  std::vector<int32_t> perm((size_t)pool_pages);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  perm.resize((size_t)n_pages);
  BufferPtr pool = be.alloc(pool_pages * page_bytes, "kv pool");
  be.zero(pool->data(), pool_pages * page_bytes);
  BufferPtr pages = d.up(perm);
  KVView kv;
  kv.base = (uint8_t*)pool->data(), kv.pages = (const int32_t*)pages->data(), kv.n_pages = n_pages;
  kv.page_shift = shift, kv.page_bytes = page_bytes, kv.k_off = k_off, kv.v_off = v_off, kv.row_bytes = rb,
  kv.type = c.type;
  // K and V interleaved in one source buffer (the QKV layout): stride 2 kv_dim + 3.
  const int64_t ss = 2 * kv_dim + 3;
  const std::vector<float> src = rand_vec((size_t)(c.n_kv * ss), -2, 2);
  BufferPtr srcd = d.up(src);
  const float* s0 = (const float*)srcd->data();
  const int64_t cuts[4] = {0, std::min<int64_t>(37, c.n_kv), std::max<int64_t>(std::min<int64_t>(37, c.n_kv), c.n_kv - 1), c.n_kv};
  for (int i = 0; i < 3; ++i)
    if (cuts[i + 1] > cuts[i])
      be.kv_store(kv, cuts[i], s0 + cuts[i] * ss, s0 + cuts[i] * ss + kv_dim, cuts[i + 1] - cuts[i], ss, kv_dim);
  // The host's encoding of the same rows, and their decoded values.
  std::vector<float> K((size_t)(c.n_kv * kv_dim)), V(K.size());
  const std::vector<uint8_t> got = d.down<uint8_t>(pool, pool_pages * page_bytes);
  size_t bad = 0;
  std::vector<uint8_t> enc(rb);
  for (int64_t j = 0; j < c.n_kv; ++j)
    for (int kvsel = 0; kvsel < 2; ++kvsel) {
      host_row(c.type, &src[j * ss + kvsel * kv_dim], kv_dim, enc.data(), (kvsel ? V : K).data() + j * kv_dim);
      const uint8_t* g = got.data() + perm[j >> shift] * page_bytes + (kvsel ? v_off : k_off) + (j & (P - 1)) * rb;
      for (size_t b = 0; b < rb; ++b) bad += g[b] != enc[b];
    }
  char what[160];
  if (!bench) {
    std::snprintf(what, sizeof what, "%s dim %lld rows %lld page_rows %d (mismatched bytes)", kvname(c.type),
                  (long long)kv_dim, (long long)c.n_kv, P);
    report("kv_store", what, (double)bad, 0);
  }
  // Queries.
  const int64_t qs = (int64_t)c.heads * c.hd + 16, os = (int64_t)c.heads * c.hd + 8;
  const std::vector<float> q = rand_vec((size_t)(c.n_tok * qs));
  std::vector<int32_t> qpos((size_t)c.n_tok);
  for (int64_t t = 0; t < c.n_tok; ++t) qpos[t] = (int32_t)(c.encoder ? c.n_kv - 1 : c.n_kv - c.n_tok + t);
  BufferPtr qd = d.up(q), posd = d.up(qpos), out = d.nan((size_t)(c.n_tok * os));
  AttnArgs a;
  a.q = (const float*)qd->data(), a.q_stride = qs, a.kv = kv, a.n_tok = c.n_tok, a.n_kv = c.n_kv;
  a.n_heads = c.heads, a.n_kv_heads = c.kvh, a.head_dim = c.hd, a.q_pos = (const int32_t*)posd->data();
  a.window = c.window, a.scale = 1.f / std::sqrt((float)c.hd), a.softcap = c.softcap, a.out = (float*)out->data();
  a.out_stride = os;
  if (bench) {
    be.attention(a);
    be.sync();
    const int iters = 200;
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < iters; ++i) be.attention(a);
    be.sync();
    const double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / iters;
    const double bytes = 2.0 * c.n_kv * rb;
    std::printf("bench attention decode %s n_kv %lld heads %d/%d hd %d: %.1f us/call, KV %.1f MB -> %.0f GB/s\n",
                kvname(c.type), (long long)c.n_kv, c.heads, c.kvh, c.hd, us, bytes / 1e6, bytes / us / 1e3);
    return;
  }
  be.attention(a);
  std::vector<double> ref((size_t)(c.n_tok * os), 0.0);
  const int group = c.heads / c.kvh;
  std::vector<double> sc((size_t)c.n_kv);
  for (int64_t t = 0; t < c.n_tok; ++t)
    for (int h = 0; h < c.heads; ++h) {
      const int kh = h / group;
      const int64_t p = qpos[t];
      const int64_t lo = c.window > 0 ? std::max<int64_t>(0, p - c.window + 1) : 0, hi = std::min(c.n_kv, p + 1);
      double mx = -INFINITY;
      for (int64_t j = lo; j < hi; ++j) {
        double s = 0;
        for (int e = 0; e < c.hd; ++e) s += (double)q[t * qs + h * c.hd + e] * K[j * kv_dim + kh * c.hd + e];
        s *= a.scale;
        if (c.softcap > 0) s = c.softcap * std::tanh(s / c.softcap);
        sc[j] = s;
        mx = std::max(mx, s);
      }
      double sum = 0;
      for (int64_t j = lo; j < hi; ++j) sum += sc[j] = std::exp(sc[j] - mx);
      for (int64_t j = lo; j < hi; ++j)
        for (int e = 0; e < c.hd; ++e) ref[t * os + h * c.hd + e] += sc[j] / sum * V[j * kv_dim + kh * c.hd + e];
    }
  const std::vector<float> o = d.down(out, (size_t)(c.n_tok * os));
  // Only the heads' columns (the stride's tail is not the op's).
  std::vector<float> og;
  std::vector<double> rg;
  for (int64_t t = 0; t < c.n_tok; ++t)
    for (int64_t e = 0; e < (int64_t)c.heads * c.hd; ++e) og.push_back(o[t * os + e]), rg.push_back(ref[t * os + e]);
  std::snprintf(what, sizeof what, "%s n_kv %lld n_tok %lld heads %d/%d hd %d pg %d win %d cap %.0f%s", kvname(c.type),
                (long long)c.n_kv, (long long)c.n_tok, c.heads, c.kvh, c.hd, P, c.window, c.softcap,
                c.encoder ? " enc" : "");
  report("attention", what, nerr(og, rg), 1e-5);
}

void check_attention(Backend& be) {
  for (KVType t : {KVType::f32, KVType::f16, KVType::q8_0}) {
    check_attention_case(be, {t, 5000, 1, 8, 2, 128, 16, 0, 0.f, false});
    check_attention_case(be, {t, 3001, 1, 4, 4, 64, 64, 1000, 30.f, false});
    check_attention_case(be, {t, 300, 17, 4, 1, 256, 16, 0, 0.f, false});
    check_attention_case(be, {t, 64, 64, 6, 2, 64, 64, 0, 0.f, true});
    check_attention_case(be, {t, 1000, 3, 8, 8, 128, 64, 100, 50.f, false});
    check_attention_case(be, {t, 1, 1, 2, 1, 32, 16, 0, 0.f, false});
  }
  for (KVType t : {KVType::f32, KVType::f16}) check_attention_case(be, {t, 777, 5, 4, 2, 80, 16, 0, 0.f, false});
}

void check_elementwise(Backend& be) {
  Dev d{be};
  const int64_t rows = 7, dim = 1001, gs = 2 * dim + 1, us = dim + 9;
  const std::vector<float> g = rand_vec((size_t)(rows * gs), -6, 6), u = rand_vec((size_t)(rows * us));
  BufferPtr gd = d.up(g), ud = d.up(u);
  for (int act = 0; act < 2; ++act) {
    BufferPtr o = d.nan((size_t)(rows * dim));
    be.glu((const float*)gd->data(), gs, (const float*)ud->data(), us, (float*)o->data(), rows, dim,
           act ? Act::gelu_tanh : Act::silu);
    std::vector<double> ref((size_t)(rows * dim));
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t i = 0; i < dim; ++i) {
        const double x = g[r * gs + i];
        const double a = act ? 0.5 * x * (1 + std::tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)))
                              : x / (1 + std::exp(-x));
        ref[r * dim + i] = a * u[r * us + i];
      }
    report("glu", act ? "gelu_tanh, strided" : "silu, strided", nerr(d.down(o, ref.size()), ref), 1e-6);
  }
  const int64_t n = 100003;
  const std::vector<float> x = rand_vec(n, -5, 5), y = rand_vec(n, -5, 5), b = rand_vec(dim);
  auto run1 = [&](const char* op, auto f, auto reff) {
    BufferPtr yd = d.up(y), xd = d.up(x), bd = d.up(b);
    f((float*)yd->data(), (const float*)xd->data(), (const float*)bd->data());
    std::vector<double> ref(n);
    for (int64_t i = 0; i < n; ++i) ref[i] = reff(i);
    report(op, "n 100003", nerr(d.down(yd, n), ref), 1e-6);
  };
  run1("add", [&](float* yy, const float* xx, const float*) { be.add(yy, xx, n); },
       [&](int64_t i) { return (double)y[i] + x[i]; });
  run1("add_bias", [&](float* yy, const float*, const float* bb) { be.add_bias(yy, bb, n / dim, dim); },
       [&](int64_t i) { return i < n / dim * dim ? (double)y[i] + b[i % dim] : (double)y[i]; });
  run1("scale", [&](float* yy, const float*, const float*) { be.scale(yy, 0.37f, n); },
       [&](int64_t i) { return (double)y[i] * 0.37f; });
  run1("softcap", [&](float* yy, const float*, const float*) { be.softcap(yy, 3.f, n); },
       [&](int64_t i) { return 3.0 * std::tanh(y[i] / 3.0); });
  run1("gelu_erf", [&](float* yy, const float*, const float*) { be.gelu_erf(yy, n); },
       [&](int64_t i) { return 0.5 * y[i] * (1 + std::erf(y[i] / std::sqrt(2.0))); });
  {  // copy_rows: a column block of a wider matrix into another stride
    const int64_t r = 9, w = 70, ss = 200, ds = 77;
    BufferPtr src = d.up(x), dst = d.nan((size_t)(r * ds));
    be.copy_rows((float*)dst->data(), ds, (const float*)src->data() + 11, ss, r, w);
    const std::vector<float> o = d.down(dst, (size_t)(r * ds));
    std::vector<float> og;
    std::vector<double> rg;
    for (int64_t i = 0; i < r; ++i)
      for (int64_t j = 0; j < w; ++j) og.push_back(o[i * ds + j]), rg.push_back(x[11 + i * ss + j]);
    report("copy_rows", "9 x 70, strides 200 -> 77", nerr(og, rg), 0);
  }
  {  // im2col_1d / im2col_rows
    const int64_t C = 5, T = 23, xs = 30;
    const int k = 3, stride = 2, pad = 1;
    const int64_t T_out = (T + 2 * pad - k) / stride + 1;
    BufferPtr xd = d.up(x), o1 = d.nan((size_t)(T_out * C * k)), o2 = d.nan((size_t)(T_out * C * k));
    be.im2col_1d((const float*)xd->data(), xs, C, T, k, stride, pad, (float*)o1->data(), T_out);
    be.im2col_rows((const float*)xd->data(), C, T, k, stride, pad, (float*)o2->data(), T_out);
    std::vector<double> r1((size_t)(T_out * C * k)), r2(r1.size());
    for (int64_t t = 0; t < T_out; ++t)
      for (int64_t c = 0; c < C; ++c)
        for (int j = 0; j < k; ++j) {
          const int64_t s = t * stride + j - pad;
          r1[t * C * k + c * k + j] = s < 0 || s >= T ? 0 : x[c * xs + s];
          r2[t * C * k + c * k + j] = s < 0 || s >= T ? 0 : x[s * C + c];
        }
    report("im2col_1d", "C 5 T 23 k 3 s 2 p 1", nerr(d.down(o1, r1.size()), r1), 0);
    report("im2col_rows", "C 5 T 23 k 3 s 2 p 1", nerr(d.down(o2, r2.size()), r2), 0);
  }
  {  // avg_pool_rows with a trailing partial group
    const int64_t nr = 11, dm = 37;
    const int k = 4;
    BufferPtr xd = d.up(x), o = d.nan((size_t)(3 * dm));
    be.avg_pool_rows((const float*)xd->data(), nr, dm, k, (float*)o->data());
    std::vector<double> ref((size_t)(3 * dm), 0.0);
    for (int64_t r = 0; r < 3; ++r)
      for (int64_t i = 0; i < dm; ++i) {
        const int64_t r0 = r * k, r1 = std::min(nr, r0 + k);
        for (int64_t j = r0; j < r1; ++j) ref[r * dm + i] += x[j * dm + i];
        ref[r * dm + i] /= (double)(r1 - r0);
      }
    report("avg_pool_rows", "11 rows, k 4", nerr(d.down(o, ref.size()), ref), 1e-6);
  }
  {  // copy / zero / upload / download
    BufferPtr a = d.up(x), b = be.alloc(n * 4, "copy");
    be.copy(b->data(), a->data(), n * 4);
    be.zero(a->data(), 40);
    std::vector<float> bb = d.down(b, n), aa = d.down(a, 10);
    double e = 0;
    for (int64_t i = 0; i < n; ++i) e = std::max(e, (double)std::fabs(bb[i] - x[i]));
    for (int i = 0; i < 10; ++i) e = std::max(e, (double)std::fabs(aa[i]));
    report("copy/zero", "n 100003", e, 0);
  }
}

void check_errors(Backend& be) {
  try {
    be.alloc(size_t(1) << 50, "an absurd test buffer");
    report("alloc", "1 PiB must throw DeviceError", 1, 0);
  } catch (const DeviceError& e) {
    std::printf("  alloc error reads: %s\n", e.what());
    report("alloc", "1 PiB throws DeviceError", 0, 0);
  }
  try {
    be.check_fits(size_t(1) << 50, "weights");
    report("check_fits", "1 PiB must throw DeviceError", 1, 0);
  } catch (const DeviceError& e) {
    report("check_fits", "1 PiB throws DeviceError", 0, 0);
  }
  try {
    make_cuda_backend(99);
    report("make", "cuda:99 must throw", 1, 0);
  } catch (const DeviceError& e) {
    std::printf("  make_cuda_backend(99) error reads: %s\n", e.what());
    report("make", "cuda:99 throws DeviceError", 0, 0);
  }
  const bool ok = be.supports(Op::matmul, 12) && !be.supports(Op::matmul, 10) && be.supports(Op::kv_store, 8) &&
                  be.weight_type(14, 4096, QuantMode::q4_0) == 14 && be.weight_type(10, 4096, QuantMode::q8) == 8;
  report("supports", "q4_K yes, q2_K no -> weight_type q8_0", ok ? 0 : 1, 0);
}

void bench_gemv(Backend& be) {
  Dev d{be};
  for (uint32_t type : {8u, 2u, 1u, 12u, 14u}) {
    for (int shape = 0; shape < 2; ++shape) {
      const int64_t rows = shape ? 8192 : 2048, cols = shape ? 2048 : 8192;
      // 8 copies (> L2) cycled, so the bandwidth is HBM's.
      const int copies = 8;
      std::vector<uint8_t> wb = make_weight(type, rows, cols);
      std::vector<Weight> ws;
      for (int i = 0; i < copies; ++i) ws.push_back(load(be, type, wb, rows, cols));
      for (int64_t n : {1, 300}) {
        BufferPtr x = d.up(rand_vec((size_t)(cols * n))), y = be.alloc((size_t)(rows * n) * 4, "y");
        const int iters = n == 1 ? 400 : 40;
        for (int i = 0; i < copies; ++i) be.matmul(ws[i], (const float*)x->data(), n, (float*)y->data());
        be.sync();
        const auto t0 = std::chrono::steady_clock::now();
        for (int i = 0; i < iters; ++i) be.matmul(ws[i % copies], (const float*)x->data(), n, (float*)y->data());
        be.sync();
        const double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / iters;
        const double bytes = (double)wb.size();
        if (n == 1)
          std::printf("bench gemv %-5s %5lld x %5lld n 1: %7.1f us, %6.0f GB/s\n", tname(type), (long long)rows,
                      (long long)cols, us, bytes / us / 1e3);
        else
          std::printf("bench gemm %-5s %5lld x %5lld n %lld: %7.1f us, %6.1f TFLOP/s\n", tname(type), (long long)rows,
                      (long long)cols, (long long)n, us, 2.0 * rows * cols * n / us / 1e6);
      }
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  const bool bench = !(argc > 1 && std::string(argv[1]) == "--no-bench");
  const BackendProbe p = probe_cuda();
  std::printf("probe: built %d, %zu device(s)%s%s\n", (int)p.built, p.devices.size(), p.error.empty() ? "" : ", error: ",
              p.error.c_str());
  for (const DeviceInfo& di : p.devices)
    std::printf("  cuda:%d %s cc %d.%d, %.1f / %.1f GiB free, %s\n", di.index, di.name.c_str(), di.cc_major,
                di.cc_minor, di.free_bytes / 1073741824.0, di.total_bytes / 1073741824.0, di.driver.c_str());
  if (p.devices.empty()) return 2;
  std::shared_ptr<Backend> be = make_cuda_backend(0);
  std::printf("backend %s on %s\n", be->name(), be->info().name.c_str());
  try {
    check_errors(*be);
    check_get_rows(*be);
    check_matmul(*be);
    check_norms(*be);
    check_rope(*be);
    check_elementwise(*be);
    check_attention(*be);
    be->sync();
    if (bench) {
      bench_gemv(*be);
      for (KVType t : {KVType::f16, KVType::q8_0, KVType::f32})
        check_attention_case(*be, {t, 4096, 1, 32, 8, 128, 16, 0, 0.f, false}, true);
    }
  } catch (const std::exception& e) {
    std::printf("EXCEPTION: %s\n", e.what());
    return 3;
  }
  std::printf("%d passed, %d failed\n", n_pass, n_fail);
  return n_fail ? 1 : 0;
}
