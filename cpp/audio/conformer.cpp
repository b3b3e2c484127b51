// The FastConformer CTC encoder on the Backend ops (see conformer.h).
#include "audio/conformer.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "core/errors.h"
#include "encoder/blocks.h"
#include "encoder/tensors.h"
#include "quant/types.h"

namespace dl::audio {

namespace {

constexpr const char* kWhat = "conformer";
constexpr const char* kArch = "fastconformer_ctc";

std::string key(const char* k) { return std::string(kArch) + "." + k; }
std::string blk(int il, const char* s) { return "blk." + std::to_string(il) + "." + s; }
int64_t post1(int64_t l) { return l > 0 ? (l - 1) / 2 + 1 : 0; }  // a k3 s2 p1 conv's length

int need_int(const gguf::File& f, const char* k, int lo, int hi) {
  const int v = encoder::meta_int(f, key(k), -1);
  if (v < lo || v > hi)
    throw UnsupportedModelError(std::string(kWhat) + ": metadata " + key(k) + " is " +
                                (v < 0 ? std::string("missing") : std::to_string(v)) + ", expected " +
                                std::to_string(lo) + ".." + std::to_string(hi));
  return v;
}

}  // namespace

bool ConformerCTC::probe(const gguf::File& f) {
  const gguf::Value* a = f.find("general.architecture");
  return a && a->type == gguf::ValueType::STRING && a->as_string() == kArch;
}

std::shared_ptr<ConformerCTC> ConformerCTC::load(const std::string& path, const std::string& device, int n_threads) {
  std::shared_ptr<ConformerCTC> e(new ConformerCTC());
  e->file_ = gguf::File::open(path);
  if (!probe(*e->file_))
    throw UnsupportedModelError(path + ": not a FastConformer CTC file (general.architecture is not '" +
                                std::string(kArch) + "')");
  e->backend_ = make_backend(device, n_threads);
  e->fbank_backend_ = std::string(e->backend_->name()) == "cpu" ? e->backend_ : make_cpu_backend(n_threads);
  e->load_weights();
  Backend& be = *e->backend_;
  std::vector<Weight*> mats;
  for (Weight& w : e->sub_w_) mats.push_back(&w);
  mats.push_back(&e->sub_out_);
  mats.push_back(&e->ctc_);
  for (ConformerLayer& L : e->layers_) {
    for (Weight* w : {&L.ff1_up, &L.ff1_down, &L.ff2_up, &L.ff2_down, &L.wq, &L.wk, &L.wv, &L.wo, &L.pw1, &L.pw2})
      mats.push_back(w);
    for (Weight& w : L.wpos) mats.push_back(&w);
  }
  size_t total = 0;
  for (Weight* w : mats) {
    if (!be.supports(Op::matmul, w->type)) {
      const TypeTraits* tt = type_traits(w->type);
      throw UnsupportedModelError(std::string(kWhat) + ": the " + be.name() + " backend has no matmul for " +
                                  (tt ? tt->name : "?"));
    }
    total += (size_t)w->rows * w->row_bytes;
  }
  be.check_fits(total, "conformer weights");
  for (Weight* w : mats) be.load_weight(*w, WeightUse::matmul);
  e->fbank_ = std::make_unique<FbankBank>(e->cfg_.n_mel);
  return e;
}

void ConformerCTC::load_weights() {
  const gguf::File& f = *file_;
  ConformerConfig& c = cfg_;
  Backend& be = *backend_;
  c.dim = need_int(f, "embedding_length", 1, 16384);
  c.n_layers = need_int(f, "block_count", 1, 1024);
  c.n_heads = need_int(f, "attention.head_count", 1, 1024);
  c.conv_kernel = need_int(f, "conv_kernel_size", 1, 65);
  c.sub_channels = need_int(f, "subsampling.channels", 1, 4096);
  c.sub_convs = need_int(f, "subsampling.conv_count", 1, 8);
  c.n_mel = need_int(f, "num_mel_bins", 1, 512);
  c.blank = need_int(f, "blank_id", 0, 1 << 20);
  const int64_t d = c.dim, C = c.sub_channels, H = c.n_heads;
  if (d % H != 0)
    throw UnsupportedModelError(std::string(kWhat) + ": " + std::to_string(H) + " heads do not divide the width " +
                                std::to_string(d));
  if (d % 2 != 0) throw UnsupportedModelError(std::string(kWhat) + ": the width must be even (sinusoid pairs)");
  if (c.conv_kernel % 2 != 1) throw UnsupportedModelError(std::string(kWhat) + ": conv_kernel_size must be odd");
  if (auto eps = f.get_float(key("layer_norm_epsilon"))) {
    if (!(*eps > 0 && *eps < 1)) throw GGUFError("metadata " + key("layer_norm_epsilon") + " out of range");
    c.eps = (float)*eps;
  }
  if (auto s = f.get_float(key("input_scale"))) {
    if (!(*s > 0 && *s < 1e6)) throw GGUFError("metadata " + key("input_scale") + " out of range");
    c.input_scale = (float)*s;
  }
  c.act_name = f.get_string(key("activation")).value_or("silu");
  if (c.act_name == "silu" || c.act_name == "swish") c.act = ConfAct::silu;
  else if (c.act_name == "relu") c.act = ConfAct::relu;
  else if (c.act_name == "gelu") c.act = ConfAct::gelu_erf;
  else if (c.act_name == "gelu_new" || c.act_name == "gelu_pytorch_tanh") c.act = ConfAct::gelu_tanh;
  else throw UnsupportedModelError(std::string(kWhat) + ": activation '" + c.act_name + "' (supported: silu, relu, gelu, gelu_pytorch_tanh)");

  auto up = [&](const std::string& name, int64_t n, bool required = true) {
    return upload_vec(be, encoder::vec(f, name, n, kWhat, required), kWhat);
  };
  auto m = [&](const std::string& name, int64_t rows, int64_t cols) { return encoder::mat(f, name, rows, cols, kWhat); };

  // The stem: conv 0 from one channel, then dense convs of C channels (folded pairs).
  int64_t bins = c.n_mel;
  for (int k = 0; k < c.sub_convs; ++k) {
    const std::string p = "sub.conv." + std::to_string(k) + ".";
    sub_w_.push_back(m(p + "weight", C, 9 * (k == 0 ? 1 : C)));
    sub_b_.push_back(up(p + "bias", C));
    bins = post1(bins);
  }
  if (encoder::mat(f, "sub.conv." + std::to_string(c.sub_convs) + ".weight", -1, -1, kWhat, false).host)
    throw UnsupportedModelError(std::string(kWhat) + ": more stem convs than subsampling.conv_count");
  c.sub_bins = (int)bins;
  sub_out_ = m("sub.out.weight", d, C * bins);
  sub_out_b_ = up("sub.out.bias", d);

  const int64_t hd = d / H;
  int64_t F = -1;
  layers_.resize(c.n_layers);
  for (int il = 0; il < c.n_layers; ++il) {
    ConformerLayer& L = layers_[il];
    auto b = [&](const char* s) { return blk(il, s); };
    for (int second = 0; second < 2; ++second) {
      const std::string p = second ? "ffn2_" : "ffn1_";
      Vec& nw = second ? L.ff2_nw : L.ff1_nw;
      Vec& nb = second ? L.ff2_nb : L.ff1_nb;
      nw = up(b((p + "norm.weight").c_str()), d);
      nb = up(b((p + "norm.bias").c_str()), d);
      Weight& wu = second ? L.ff2_up : L.ff1_up;
      Weight& wd = second ? L.ff2_down : L.ff1_down;
      wu = m(b((p + "up.weight").c_str()), F, d);
      if (wu.rows > 1 << 18) throw UnsupportedModelError(std::string(kWhat) + ": ffn width out of range");
      F = wu.rows;
      wd = m(b((p + "down.weight").c_str()), d, F);
      (second ? L.ff2_bu : L.ff1_bu) = up(b((p + "up.bias").c_str()), F, false);
      (second ? L.ff2_bd : L.ff1_bd) = up(b((p + "down.bias").c_str()), d, false);
    }
    L.att_nw = up(b("attn_norm.weight"), d), L.att_nb = up(b("attn_norm.bias"), d);
    L.wq = m(b("attn_q.weight"), d, d), L.wk = m(b("attn_k.weight"), d, d);
    L.wv = m(b("attn_v.weight"), d, d), L.wo = m(b("attn_out.weight"), d, d);
    L.bq = up(b("attn_q.bias"), d, false), L.bk = up(b("attn_k.bias"), d, false);
    L.bv = up(b("attn_v.bias"), d, false), L.bo = up(b("attn_out.bias"), d, false);
    L.bias_u = up(b("attn_bias_u"), d), L.bias_v = up(b("attn_bias_v"), d);
    // One matrix of H * d rows of head_dim: head h's rows [h * d, (h + 1) * d) as its own view.
    const Weight pos = m(b("attn_pos.weight"), H * d, hd);
    for (int64_t h = 0; h < H; ++h) {
      Weight w = pos;
      w.rows = d;
      w.host = pos.host + (size_t)(h * d) * pos.row_bytes;
      L.wpos.push_back(w);
    }
    L.conv_nw = up(b("conv_norm.weight"), d), L.conv_nb = up(b("conv_norm.bias"), d);
    L.pw1 = m(b("conv_pw1.weight"), 2 * d, d);
    L.pw1_b = up(b("conv_pw1.bias"), 2 * d, false);
    L.dw_w = up(b("conv_dw.weight"), d * c.conv_kernel);
    L.dw_b = up(b("conv_dw.bias"), d, false);
    L.pw2 = m(b("conv_pw2.weight"), d, d);
    L.pw2_b = up(b("conv_pw2.bias"), d, false);
    L.out_nw = up(b("out_norm.weight"), d), L.out_nb = up(b("out_norm.bias"), d);
  }
  if (f.find_tensor(blk(c.n_layers, "attn_q.weight")))
    throw UnsupportedModelError(std::string(kWhat) + ": more blocks than block_count");
  c.ffn_dim = (int)F;
  ctc_ = m("ctc.weight", -1, d);
  c.vocab = (int)ctc_.rows;
  ctc_b_ = up("ctc.bias", c.vocab, false);
  if (c.blank >= c.vocab)
    throw UnsupportedModelError(std::string(kWhat) + ": blank_id " + std::to_string(c.blank) + " past the " +
                                std::to_string(c.vocab) + " CTC classes");
  const int64_t n1 = std::max<int64_t>({F, d, C});
  ones_ = upload_vec(be, std::vector<float>((size_t)n1, 1.f), kWhat);
}

int64_t ConformerCTC::n_rows(int64_t frames) const {
  int64_t l = frames;
  for (int k = 0; k < cfg_.sub_convs; ++k) l = post1(l);
  return l;
}

float* ConformerCTC::buf(int i, int64_t floats) {
  const size_t bytes = (size_t)std::max<int64_t>(floats, 1) * sizeof(float);
  if (!bufs_[i] || bufs_[i]->size() < bytes) bufs_[i] = backend_->alloc(bytes, "conformer scratch");
  return static_cast<float*>(bufs_[i]->data());
}

// The config's activation in place; the plain ones run as the GLU op against a row of ones.
void ConformerCTC::act(float* y, int64_t rows, int64_t dim) {
  Backend& be = *backend_;
  switch (cfg_.act) {
    case ConfAct::gelu_erf: be.gelu_erf(y, rows * dim); return;
    case ConfAct::silu: be.glu(y, dim, ones_.data(), 0, y, rows, dim, Act::silu); return;
    case ConfAct::relu: be.glu(y, dim, ones_.data(), 0, y, rows, dim, Act::relu); return;
    case ConfAct::gelu_tanh: be.glu(y, dim, ones_.data(), 0, y, rows, dim, Act::gelu_tanh); return;
  }
}

// Output rows [r0, r0 + n) of a 3x3 stride-2 pad-1 conv (weight w, bias b, then ReLU) into dst
// (rows of W_out positions of w.rows channels). The input is element (c, h, w) at
// x[c * sc + (h - x_row0) * sh + w * sw] for its rows h in [x_row0, H): a caller may hold only the
// rows the outputs read. im2col runs from output row r0 - 1 when r0 > 0 (so that its window's
// first input row is real, not padding) into scratch, and that row is dropped.
void ConformerCTC::conv_rows(const float* x, int64_t x_row0, int64_t C_in, int64_t H, int64_t W, int64_t sc,
                             int64_t sh, int64_t sw, const Weight& w, const Vec& b, int64_t r0, int64_t n, float* dst) {
  Backend& be = *backend_;
  const int64_t Wo = post1(W), Co = w.rows;
  const int64_t base = r0 == 0 ? 0 : 2 * r0 - 2, lead = r0 == 0 ? 0 : 1;
  float* xc = buf(B_X, (n + lead) * Wo * 9 * C_in);
  be.im2col_2d(x + (base - x_row0) * sh, C_in, H - base, W, sc, sh, sw, 3, 3, 2, 1, xc, n + lead, Wo);
  if (lead) {
    float* y = buf(B_FLAT, (n + 1) * Wo * Co);
    be.matmul(w, xc, (n + 1) * Wo, y);
    be.copy(dst, y + Wo * Co, (size_t)(n * Wo * Co) * 4);
  } else {
    be.matmul(w, xc, n * Wo, dst);
  }
  be.add_bias(dst, b.data(), n * Wo, Co);
  be.glu(dst, Co, ones_.data(), 0, dst, n * Wo, Co, Act::relu);
}

void ConformerCTC::stem(const float* feat, int64_t frames, float* h) {
  Backend& be = *backend_;
  const ConformerConfig& c = cfg_;
  const int64_t C = c.sub_channels, d = c.dim, nm = c.n_mel;
  // Positions are [time][bin] rows of channels; the first conv reads the features [bin][frame].
  // Each conv runs in tiles of output rows: a 9C-wide im2col row per position would be 9x the
  // activations. The first conv's rows (the widest: half the frames x half the bins x C) are
  // made per tile of the second's, never all at once.
  const int64_t H0 = post1(frames), W0 = post1(nm);
  int64_t Ht = H0, Wb = W0;
  int cur = B_G0;
  if (c.sub_convs == 1) {
    conv_rows(feat, 0, 1, frames, nm, 0, 1, frames, sub_w_[0], sub_b_[0], 0, H0, buf(B_G0, H0 * W0 * C));
  } else {
    const int64_t H1 = post1(H0), W1 = post1(W0);
    const int64_t tile = std::max<int64_t>(1, (int64_t)(4 << 20) / (W1 * 9 * C));
    float* g1 = buf(B_G1, H1 * W1 * C);
    for (int64_t r0 = 0; r0 < H1; r0 += tile) {
      const int64_t n = std::min(tile, H1 - r0);
      const int64_t s0 = r0 == 0 ? 0 : 2 * r0 - 2, e0 = std::min(H0, 2 * (r0 + n));  // conv0 rows read
      float* g0 = buf(B_G0, (e0 - s0) * W0 * C);
      conv_rows(feat, 0, 1, frames, nm, 0, 1, frames, sub_w_[0], sub_b_[0], s0, e0 - s0, g0);
      conv_rows(g0, s0, C, H0, W0, 1, W0 * C, C, sub_w_[1], sub_b_[1], r0, n, g1 + r0 * W1 * C);
    }
    Ht = H1, Wb = W1, cur = B_G1;
  }
  for (int k = 2; k < c.sub_convs; ++k) {
    const int64_t Hn = post1(Ht), Wn = post1(Wb);
    const int nxt = cur == B_G0 ? B_G1 : B_G0;
    float* gn = buf(nxt, Hn * Wn * C);
    const float* g = static_cast<float*>(bufs_[cur]->data());
    const int64_t tile = std::max<int64_t>(1, (int64_t)(4 << 20) / (Wn * 9 * C));
    for (int64_t r0 = 0; r0 < Hn; r0 += tile)
      conv_rows(g, 0, C, Ht, Wb, 1, Wb * C, C, sub_w_[k], sub_b_[k], r0, std::min(tile, Hn - r0), gn + r0 * Wn * C);
    Ht = Hn, Wb = Wn, cur = nxt;
  }
  const float* g = static_cast<float*>(bufs_[cur]->data());
  // Each time step's [channel][bin] row (torch's transpose(1, 2).reshape), then the linear.
  float* flat = buf(B_FLAT, Ht * C * Wb);
  be.im2col_2d(g, C, Wb, Ht, 1, C, Wb * C, (int)Wb, 1, 1, 0, flat, 1, Ht);
  be.matmul(sub_out_, flat, Ht, h);
  be.add_bias(h, sub_out_b_.data(), Ht, d);
  if (c.input_scale != 1.f) be.scale(h, c.input_scale, Ht * d);
}

void ConformerCTC::ffn(const ConformerLayer& Ly, bool second, float* h, int64_t L) {
  Backend& be = *backend_;
  const int64_t d = cfg_.dim, F = cfg_.ffn_dim;
  float* xn = buf(B_XN, L * d);
  float* u = buf(B_U, L * F);
  float* o = buf(B_O, L * d);
  be.layer_norm(h, (second ? Ly.ff2_nw : Ly.ff1_nw).data(), (second ? Ly.ff2_nb : Ly.ff1_nb).data(), xn, L, d,
                cfg_.eps);
  be.matmul(second ? Ly.ff2_up : Ly.ff1_up, xn, L, u);
  const Vec& bu = second ? Ly.ff2_bu : Ly.ff1_bu;
  if (!bu.empty()) be.add_bias(u, bu.data(), L, F);
  act(u, L, F);
  be.matmul(second ? Ly.ff2_down : Ly.ff1_down, u, L, o);
  const Vec& bd = second ? Ly.ff2_bd : Ly.ff1_bd;
  if (!bd.empty()) be.add_bias(o, bd.data(), L, d);
  be.scale(o, 0.5f, L * d);  // the macaron halves
  be.add(h, o, L * d);
}

void ConformerCTC::attention(const ConformerLayer& Ly, float* h, int64_t L) {
  Backend& be = *backend_;
  const int64_t d = cfg_.dim, H = cfg_.n_heads, hd = d / H, E = d + hd, W = H * E;
  float* xn = buf(B_XN, L * d);
  float* q = buf(B_Q, L * d);
  float* qv = buf(B_QV, L * d);
  float* t = buf(B_T, L * hd);
  float* pb = buf(B_PB, L * d);
  float* qx = buf(B_QX, L * W);
  float* kv = static_cast<float*>(bufs_[B_KV]->data());  // K's pos parts and V's zeros set per encode
  float* att = buf(B_ATT, L * W);
  float* o = buf(B_O, L * d);
  be.layer_norm(h, Ly.att_nw.data(), Ly.att_nb.data(), xn, L, d, cfg_.eps);
  be.matmul(Ly.wq, xn, L, q);
  if (!Ly.bq.empty()) be.add_bias(q, Ly.bq.data(), L, d);
  be.copy(qv, q, (size_t)(L * d) * 4);
  be.add_bias(qv, Ly.bias_v.data(), L, d);
  be.add_bias(q, Ly.bias_u.data(), L, d);
  // Each head's row of qx: [W_pos^T (q + v) (d, rotated by i below) | q + u (hd)].
  be.copy_rows(qx + d, E, q, hd, L * H, hd);
  for (int64_t hh = 0; hh < H; ++hh) {
    be.copy_rows(t, hd, qv + hh * hd, d, L, hd);
    be.matmul(Ly.wpos[hh], t, L, pb);
    be.copy_rows(qx + hh * E, W, pb, d, L, d);
  }
  RopeParams rp;
  rp.neox = false;
  rp.n_rot = (int)d;
  rp.base = 10000.f;
  const int32_t* pos = static_cast<const int32_t*>(bufs_[B_POS]->data());
  be.rope(qx, L, W, (int)H, (int)E, pos, rp);
  float* kvt = qv;  // q + v is spent
  be.matmul(Ly.wk, xn, L, kvt);
  if (!Ly.bk.empty()) be.add_bias(kvt, Ly.bk.data(), L, d);
  be.copy_rows(kv + d, E, kvt, hd, L * H, hd);
  be.matmul(Ly.wv, xn, L, kvt);
  if (!Ly.bv.empty()) be.add_bias(kvt, Ly.bv.data(), L, d);
  be.copy_rows(kv + L * W + d, E, kvt, hd, L * H, hd);
  AttnArgs a;
  a.q = qx;
  a.q_stride = W;
  a.kv = encoder::flat_kv(kv, L, W, static_cast<const int32_t*>(bufs_[B_PAGE]->data()));
  a.n_tok = L;
  a.n_kv = L;
  a.n_heads = a.n_kv_heads = (int)H;
  a.head_dim = (int)E;
  a.q_pos = static_cast<const int32_t*>(bufs_[B_QPOS]->data());
  a.scale = 1.f / std::sqrt((float)hd);
  a.out = att;
  a.out_stride = W;
  try {
    be.attention(a);
  } catch (const UnsupportedModelError& e) {  // a device's head width limit: say why the heads are this wide
    throw UnsupportedModelError(std::string(kWhat) + ": the relative-position attention runs as heads of d_model + "
                                "head_dim = " + std::to_string(E) + " floats (see conformer.h); " + e.what() +
                                ": run this model on the CPU");
  }
  be.copy_rows(q, hd, att + d, E, L * H, hd);  // each head's value part
  be.matmul(Ly.wo, q, L, o);
  if (!Ly.bo.empty()) be.add_bias(o, Ly.bo.data(), L, d);
  be.add(h, o, L * d);
}

void ConformerCTC::conv_module(const ConformerLayer& Ly, float* h, int64_t L) {
  Backend& be = *backend_;
  const int64_t d = cfg_.dim, k = cfg_.conv_kernel, p = (k - 1) / 2;
  float* xn = buf(B_XN, L * d);
  float* y2 = buf(B_Y2, L * 2 * d);
  float* gl = buf(B_GL, (L + p) * d);
  float* dw = buf(B_DW, (L + p) * d);
  float* st = buf(B_ST, std::max<int64_t>(k - 1, 1) * d);
  float* o = buf(B_O, L * d);
  be.layer_norm(h, Ly.conv_nw.data(), Ly.conv_nb.data(), xn, L, d, cfg_.eps);
  be.matmul(Ly.pw1, xn, L, y2);
  if (!Ly.pw1_b.empty()) be.add_bias(y2, Ly.pw1_b.data(), L, 2 * d);
  be.glu(y2 + d, 2 * d, y2, 2 * d, gl, L, d, Act::sigmoid);  // torch's glu: first half * sigmoid(second)
  // 'same' padding: zeros before (the state) and p zero rows after; outputs p.. are the conv's.
  be.zero(gl + L * d, (size_t)(p * d) * 4);
  be.zero(st, (size_t)(std::max<int64_t>(k - 1, 1) * d) * 4);
  be.conv1d_causal(st, gl, d, L + p, d, Ly.dw_w.data(), (int)k, false, dw);
  float* r = dw + p * d;
  if (!Ly.dw_b.empty()) be.add_bias(r, Ly.dw_b.data(), L, d);
  act(r, L, d);
  be.matmul(Ly.pw2, r, L, o);
  if (!Ly.pw2_b.empty()) be.add_bias(o, Ly.pw2_b.data(), L, d);
  be.add(h, o, L * d);
}

int64_t ConformerCTC::encode_features(const float* feat_host, int64_t stride, int64_t frames, float* hidden,
                                      float* logits) {
  const ConformerConfig& c = cfg_;
  if (frames < 0 || frames > stride) throw std::invalid_argument("conformer: frames outside the features");
  const int64_t L = n_rows(frames);
  if (L == 0) return 0;
  std::lock_guard<std::mutex> lock(mu_);
  Backend& be = *backend_;
  const int64_t d = c.dim, H = c.n_heads, hd = d / H, E = d + hd, W = H * E;
  float* feat = buf(B_FEAT, c.n_mel * frames);
  {
    std::vector<float> f((size_t)(c.n_mel * frames));
    for (int64_t m = 0; m < c.n_mel; ++m) std::copy(feat_host + m * stride, feat_host + m * stride + frames, f.begin() + m * frames);
    be.upload(feat, f.data(), f.size() * 4);
  }
  // Per encode: rope positions 0..L-1, every query at L - 1 (all see all), the one-page table,
  // K's pos parts rope_j(1, 0, 1, 0, ...) and V's zero pos parts (the layers write the rest).
  {
    std::vector<int32_t> pos((size_t)L), qpos((size_t)L, (int32_t)(L - 1));
    for (int64_t i = 0; i < L; ++i) pos[i] = (int32_t)i;
    int32_t* pd = reinterpret_cast<int32_t*>(buf(B_POS, L));
    int32_t* qd = reinterpret_cast<int32_t*>(buf(B_QPOS, L));
    be.upload(pd, pos.data(), (size_t)L * 4);
    be.upload(qd, qpos.data(), (size_t)L * 4);
    float* page = buf(B_PAGE, 1);
    be.zero(page, 4);
    float* kv = buf(B_KV, 2 * L * W);
    std::vector<float> k((size_t)(L * W), 0.f);
    for (int64_t r = 0; r < L * H; ++r)
      for (int64_t i = 0; i < d; i += 2) k[(size_t)(r * E + i)] = 1.f;
    be.upload(kv, k.data(), k.size() * 4);
    be.zero(kv + L * W, (size_t)(L * W) * 4);
    RopeParams rp;
    rp.neox = false;
    rp.n_rot = (int)d;
    rp.base = 10000.f;
    be.rope(kv, L, W, (int)H, (int)E, pd, rp);
  }
  float* h = buf(B_H, L * d);
  stem(feat, frames, h);
  for (const ConformerLayer& Ly : layers_) {
    ffn(Ly, false, h, L);
    attention(Ly, h, L);
    conv_module(Ly, h, L);
    ffn(Ly, true, h, L);
    be.layer_norm(h, Ly.out_nw.data(), Ly.out_nb.data(), h, L, d, c.eps);
  }
  if (hidden) be.download(hidden, h, (size_t)(L * d) * 4);
  if (logits) {
    float* lg = buf(B_LOG, L * c.vocab);
    be.matmul(ctc_, h, L, lg);
    if (!ctc_b_.empty()) be.add_bias(lg, ctc_b_.data(), L, c.vocab);
    be.download(logits, lg, (size_t)(L * c.vocab) * 4);
  }
  be.sync();
  return L;
}

int64_t ConformerCTC::encode(const float* x, int64_t n, float* hidden, float* logits) {
  if (n < 2 * kHop) return 0;
  const int64_t frames = fbank_frames(n);
  MelScratch s;
  std::vector<float> feat((size_t)(cfg_.n_mel * frames));
  {
    std::lock_guard<std::mutex> lock(mu_);  // the front end's backend may be the encoder's
    nemo_fbank(*fbank_backend_, *fbank_, x, n, s, feat.data());
  }
  return encode_features(feat.data(), frames, clip_frames(n), hidden, logits);
}

}  // namespace dl::audio
