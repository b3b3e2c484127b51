// The shared encoder blocks on the Backend ops (see blocks.h).
#include "encoder/blocks.h"

#include <algorithm>
#include <cmath>

namespace dl::encoder {

float* Blocks::buf(Backend& be, int i, int64_t floats) {
  const size_t bytes = (size_t)std::max<int64_t>(floats, 1) * sizeof(float);
  if (!bufs_[i] || bufs_[i]->size() < bytes) bufs_[i] = be.alloc(bytes, "encoder scratch");
  return static_cast<float*>(bufs_[i]->data());
}

void Blocks::run(Backend& be, const std::vector<Layer>& layers, float* h, int64_t L, int64_t d, int n_heads,
                 int64_t F, float eps, Gelu gelu) {
  if (!page0_) {
    page0_ = be.alloc(sizeof(int32_t), "encoder");
    be.zero(page0_->data(), sizeof(int32_t));
  }
  // Every position sees every position: q_pos = L - 1 for all (the attention op masks keys
  // past a query's position). K rows then V rows sit in one page of a one-page cache.
  if (pos_rows_ != L) {
    if (!pos_ || pos_->size() < (size_t)L * 4) pos_ = be.alloc((size_t)L * 4, "encoder scratch");
    std::vector<int32_t> pos((size_t)L, (int32_t)(L - 1));
    be.upload(pos_->data(), pos.data(), (size_t)L * 4);
    pos_rows_ = L;
  }
  // GELU(tanh) runs as the GLU op against a row of ones (stride 0): no op of its own.
  if (gelu == Gelu::tanh && (!ones_ || ones_->size() < (size_t)F * 4)) {
    ones_ = be.alloc((size_t)F * 4, "encoder");
    std::vector<float> one((size_t)F, 1.f);
    be.upload(ones_->data(), one.data(), (size_t)F * 4);
  }
  const int hd = (int)(d / n_heads);
  float* xn = buf(be, B_XN, L * d);
  float* kv = buf(be, B_KV, 2 * L * d);
  float* q = buf(be, B_Q, L * d);
  float* att = buf(be, B_A, L * d);
  float* o = buf(be, B_O, L * d);
  float* u = buf(be, B_U, L * F);
  // One matmul with its bias (and the exact GELU) applied as the outputs are stored.
  auto linear = [&](const Weight& w, const float* x, float* y, const Vec& b, bool gelu) {
    const Weight* ws[1] = {&w};
    float* ys[1] = {y};
    MatmulEpilogue e;
    e.bias = b.data();
    e.gelu_erf = gelu;
    be.matmul_multi_ex(ws, ys, 1, x, L, &e);
  };
  for (const Layer& Ly : layers) {
    be.layer_norm(h, Ly.ln1_w.data(), Ly.ln1_b.data(), xn, L, d, eps);
    const Weight* ws[3] = {&Ly.wq, &Ly.wk, &Ly.wv};
    float* ys[3] = {q, kv, kv + L * d};
    MatmulEpilogue qkv[3];
    qkv[0].bias = Ly.bq.data();
    qkv[1].bias = Ly.bk.data();  // null where the family has no K bias (whisper)
    qkv[2].bias = Ly.bv.data();
    be.matmul_multi_ex(ws, ys, 3, xn, L, qkv);
    AttnArgs a;
    a.q = q;
    a.q_stride = d;
    a.kv = flat_kv(kv, L, d, static_cast<const int32_t*>(page0_->data()));
    a.n_tok = L;
    a.n_kv = L;
    a.n_heads = a.n_kv_heads = n_heads;
    a.head_dim = hd;
    a.q_pos = static_cast<const int32_t*>(pos_->data());
    a.scale = 1.f / std::sqrt((float)hd);
    a.out = att;
    a.out_stride = d;
    a.any_order = true;
    be.attention(a);
    linear(Ly.wo, att, o, Ly.bo, false);
    be.add(h, o, L * d);
    be.layer_norm(h, Ly.ln2_w.data(), Ly.ln2_b.data(), xn, L, d, eps);
    linear(Ly.w_up, xn, u, Ly.b_up, gelu == Gelu::erf);
    if (gelu == Gelu::tanh) be.glu(u, F, static_cast<const float*>(ones_->data()), 0, u, L, F, Act::gelu_tanh);
    linear(Ly.w_down, u, o, Ly.b_down, false);
    be.add(h, o, L * d);
  }
}

}  // namespace dl::encoder
