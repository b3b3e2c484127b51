// The whisper text decoder on the Backend ops (see whisper_decoder.h), and greedy decoding
// with whisper's token suppression and timestamp rules.
#include "audio/whisper_decoder.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <stdexcept>

#include "core/errors.h"
#include "encoder/tensors.h"
#include "quant/quant.h"
#include "quant/types.h"

namespace dl::audio {

namespace {

const char* kWhat = "whisper decoder";
using encoder::shape_str;
std::vector<float> vec(const gguf::File& f, const std::string& name, int64_t n, bool required = true) {
  return encoder::vec(f, name, n, kWhat, required);
}
// A matrix of `rows` rows (-1: any) of `cols`, computed with f32 activations: the references
// run in float32.
Weight mat(const gguf::File& f, const std::string& name, int64_t rows, int64_t cols) {
  Weight w = encoder::mat(f, name, rows, cols, kWhat);
  w.exact = true;
  return w;
}

std::string blk(int il, const char* s) { return "d.blk." + std::to_string(il) + "." + s; }

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

}  // namespace

bool WhisperDecoder::probe(const gguf::File& f) { return f.find_tensor("d.token_embd.weight") != nullptr; }

std::shared_ptr<WhisperDecoder> WhisperDecoder::load(const std::string& path, const std::string& device,
                                                     int n_threads) {
  std::shared_ptr<WhisperDecoder> d(new WhisperDecoder());
  d->file_ = gguf::File::open(path);
  if (!probe(*d->file_))
    throw UnsupportedModelError(path + ": no whisper decoder in this file (no d.token_embd.weight); convert the "
                                "whole model with `dasllama convert`, not only its encoder");
  d->backend_ = make_backend(device, n_threads);
  d->load_weights();
  return d;
}

void WhisperDecoder::load_weights() {
  const gguf::File& f = *file_;
  WhisperDecoderConfig& c = cfg_;
  Backend& be = *backend_;
  const gguf::TensorInfo& te = *f.find_tensor("d.token_embd.weight");
  if (te.ne.size() != 2 || te.ne[0] <= 0 || te.ne[0] > 16384 || te.ne[1] <= 0 || te.ne[1] > (1 << 20))
    throw UnsupportedModelError("whisper decoder: d.token_embd.weight has shape " + shape_str(te));
  c.dim = (int)te.ne[0];
  c.vocab = (int)te.ne[1];
  const int64_t d = c.dim;
  tok_rows_ = mat(f, "d.token_embd.weight", c.vocab, d);
  tok_out_ = tok_rows_;
  if (!be.supports(Op::get_rows, tok_rows_.type))
    throw UnsupportedModelError(std::string("whisper decoder: the ") + be.name() + " backend cannot read rows of "
                                "the embedding table's type");
  const gguf::TensorInfo* tp = f.find_tensor("d.position_embd.weight");
  if (!tp || tp->ne.size() != 2 || tp->ne[0] != d || tp->ne[1] < 4 || tp->ne[1] > 65536)
    throw UnsupportedModelError("whisper decoder: d.position_embd.weight missing or not " + std::to_string(d) + "x(n_ctx)");
  c.n_ctx = (int)tp->ne[1];
  pos_emb_ = upload_vec(be, vec(f, "d.position_embd.weight", (int64_t)c.n_ctx * d), kWhat);
  out_w_ = upload_vec(be, vec(f, "d.output_norm.weight", d), kWhat);
  out_b_ = upload_vec(be, vec(f, "d.output_norm.bias", d), kWhat);
  const std::optional<int64_t> heads = f.get_int("whisper.decoder.attention.head_count");
  if (!heads || *heads <= 0 || d % *heads != 0)
    throw UnsupportedModelError("whisper decoder: whisper.decoder.attention.head_count missing or does not divide " +
                                std::to_string(d));
  c.n_heads = (int)*heads;
  if (auto eps = f.get_float("whisper.decoder.attention.layer_norm_epsilon")) {
    if (!(*eps > 0 && *eps < 1)) throw GGUFError("metadata whisper.decoder.attention.layer_norm_epsilon out of range");
    c.eps = (float)*eps;
  }
  int n_layers = 0;
  while (f.find_tensor(blk(n_layers, "attn_q.weight"))) ++n_layers;
  if (n_layers == 0) throw UnsupportedModelError("whisper decoder: no blocks (d.blk.0.attn_q.weight)");
  c.n_layers = n_layers;
  layers_.resize(n_layers);
  auto up = [&](const std::vector<float>& v) { return upload_vec(be, v, kWhat); };
  int64_t ffn = -1;  // the first block's width, then every block's
  for (int il = 0; il < n_layers; ++il) {
    Layer& L = layers_[il];
    static_cast<encoder::Layer&>(L) = encoder::load_layer(be, f, blk(il, ""), d, ffn, kWhat);
    for (Weight* w : {&L.wq, &L.wk, &L.wv, &L.wo, &L.w_up, &L.w_down}) w->exact = true;  // as mat() below
    L.lnx_w = up(vec(f, blk(il, "ln_cross.weight"), d));
    L.lnx_b = up(vec(f, blk(il, "ln_cross.bias"), d));
    L.xq = mat(f, blk(il, "cross_q.weight"), d, d);
    L.xk = mat(f, blk(il, "cross_k.weight"), d, d);
    L.xv = mat(f, blk(il, "cross_v.weight"), d, d);
    L.xo = mat(f, blk(il, "cross_out.weight"), d, d);
    L.xbq = up(vec(f, blk(il, "cross_q.bias"), d));
    L.xbk = up(vec(f, blk(il, "cross_k.bias"), d, false));
    L.xbv = up(vec(f, blk(il, "cross_v.bias"), d));
    L.xbo = up(vec(f, blk(il, "cross_out.bias"), d));
  }
  c.ffn_dim = (int)ffn;
  std::vector<Weight*> mats = {&tok_out_};
  for (Layer& L : layers_)
    for (Weight* w : {&L.wq, &L.wk, &L.wv, &L.wo, &L.xq, &L.xk, &L.xv, &L.xo, &L.w_up, &L.w_down}) mats.push_back(w);
  size_t total = (size_t)tok_rows_.rows * tok_rows_.row_bytes;
  for (Weight* w : mats) {
    if (!be.supports(Op::matmul, w->type)) {
      const TypeTraits* tt = type_traits(w->type);
      throw UnsupportedModelError(std::string("whisper decoder: the ") + be.name() + " backend has no matmul for " +
                                  (tt ? tt->name : "?"));
    }
    total += (size_t)w->rows * w->row_bytes;
  }
  total += (size_t)n_layers * 2 * (size_t)c.n_ctx * (size_t)d * 4;  // the self-attention caches
  be.check_fits(total, "whisper decoder weights");
  be.load_weight(tok_rows_, WeightUse::rows);
  for (Weight* w : mats) be.load_weight(*w, WeightUse::matmul);
  for (int il = 0; il < n_layers; ++il)
    self_kv_.push_back(be.alloc((size_t)2 * c.n_ctx * d * 4, "whisper decoder KV cache"));
  cross_kv_.resize(n_layers);
  page0_ = be.alloc(sizeof(int32_t), kWhat);
  be.zero(page0_->data(), sizeof(int32_t));
}

float* WhisperDecoder::buf(int i, int64_t floats) {
  const size_t bytes = (size_t)std::max<int64_t>(floats, 1) * sizeof(float);
  if (!bufs_[i] || bufs_[i]->size() < bytes) bufs_[i] = backend_->alloc(bytes, "whisper decoder scratch");
  return static_cast<float*>(bufs_[i]->data());
}

void WhisperDecoder::set_encoder(const float* rows, int64_t n_enc) {
  if (n_enc <= 0 || n_enc > (1 << 16)) throw std::invalid_argument("whisper decoder: encoder rows out of range");
  std::lock_guard<std::recursive_mutex> lock(mu_);
  Backend& be = *backend_;
  const int64_t d = cfg_.dim;
  float* enc = buf(B_ENC, n_enc * d);
  be.upload(enc, rows, (size_t)(n_enc * d) * 4);
  for (int il = 0; il < cfg_.n_layers; ++il) {
    Layer& L = layers_[il];
    BufferPtr& kv = cross_kv_[il];
    if (!kv || kv->size() < (size_t)(2 * n_enc * d) * 4) kv = be.alloc((size_t)(2 * n_enc * d) * 4, "whisper cross KV");
    float* k = static_cast<float*>(kv->data());
    float* v = k + n_enc * d;
    const Weight* ws[2] = {&L.xk, &L.xv};
    float* ys[2] = {k, v};
    be.matmul_multi(ws, ys, 2, enc, n_enc);
    if (!L.xbk.empty()) be.add_bias(k, L.xbk.data(), n_enc, d);
    be.add_bias(v, L.xbv.data(), n_enc, d);
  }
  n_enc_ = n_enc;
}

void WhisperDecoder::forward(const int32_t* ids, int64_t n, int64_t pos0, bool all_logits, float* out) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  const WhisperDecoderConfig& c = cfg_;
  if (n_enc_ == 0) throw std::logic_error("whisper decoder: set_encoder first");
  if (n <= 0 || pos0 < 0 || pos0 + n > c.n_ctx)
    throw std::invalid_argument("whisper decoder: positions " + std::to_string(pos0) + ".." +
                                std::to_string(pos0 + n) + " exceed the context of " + std::to_string(c.n_ctx));
  for (int64_t i = 0; i < n; ++i)
    if (ids[i] < 0 || ids[i] >= c.vocab)
      throw std::invalid_argument("whisper decoder: token id " + std::to_string(ids[i]) + " out of range");
  Backend& be = *backend_;
  const int64_t d = c.dim;
  const int hd = c.dim / c.n_heads;
  // Host data first: ids, causal positions, and the cross-attention positions (every
  // query sees every encoder row).
  if (!bufs_[B_IDS] || bufs_[B_IDS]->size() < (size_t)n * 4) bufs_[B_IDS] = be.alloc((size_t)n * 4, kWhat);
  if (!bufs_[B_POS] || bufs_[B_POS]->size() < (size_t)n * 4) bufs_[B_POS] = be.alloc((size_t)n * 4, kWhat);
  if (!bufs_[B_XPOS] || bufs_[B_XPOS]->size() < (size_t)n * 4) bufs_[B_XPOS] = be.alloc((size_t)n * 4, kWhat);
  be.upload(bufs_[B_IDS]->data(), ids, (size_t)n * 4);
  {
    std::vector<int32_t> p((size_t)n), xp((size_t)n, (int32_t)(n_enc_ - 1));
    for (int64_t i = 0; i < n; ++i) p[(size_t)i] = (int32_t)(pos0 + i);
    be.upload(bufs_[B_POS]->data(), p.data(), (size_t)n * 4);
    be.upload(bufs_[B_XPOS]->data(), xp.data(), (size_t)n * 4);
  }
  float* h = buf(B_H, n * d);
  float* xn = buf(B_XN, n * d);
  float* q = buf(B_Q, n * d);
  float* att = buf(B_A, n * d);
  float* o = buf(B_O, n * d);
  float* u = buf(B_U, n * c.ffn_dim);
  be.get_rows(tok_rows_, static_cast<const int32_t*>(bufs_[B_IDS]->data()), n, h);
  be.add(h, pos_emb_.data() + pos0 * d, n * d);

  auto attend = [&](uint8_t* base, int64_t rows_cap, int64_t n_kv, const void* qpos) {
    AttnArgs a;
    a.q = q;
    a.q_stride = d;
    a.kv = encoder::flat_kv(base, rows_cap, d, static_cast<const int32_t*>(page0_->data()));
    a.n_tok = n;
    a.n_kv = n_kv;
    a.n_heads = a.n_kv_heads = c.n_heads;
    a.head_dim = hd;
    a.q_pos = static_cast<const int32_t*>(qpos);
    a.scale = 1.f / std::sqrt((float)hd);
    a.out = att;
    a.out_stride = d;
    be.attention(a);
  };

  for (int il = 0; il < c.n_layers; ++il) {
    Layer& L = layers_[il];
    // Causal self-attention: this call's K and V rows go straight into the cache.
    float* kc = static_cast<float*>(self_kv_[il]->data());
    float* vc = kc + (int64_t)c.n_ctx * d;
    be.layer_norm(h, L.ln1_w.data(), L.ln1_b.data(), xn, n, d, c.eps);
    const Weight* ws[3] = {&L.wq, &L.wk, &L.wv};
    float* ys[3] = {q, kc + pos0 * d, vc + pos0 * d};
    be.matmul_multi(ws, ys, 3, xn, n);
    be.add_bias(q, L.bq.data(), n, d);
    if (!L.bk.empty()) be.add_bias(kc + pos0 * d, L.bk.data(), n, d);
    be.add_bias(vc + pos0 * d, L.bv.data(), n, d);
    attend(reinterpret_cast<uint8_t*>(kc), c.n_ctx, pos0 + n, bufs_[B_POS]->data());
    be.matmul(L.wo, att, n, o);
    be.add_bias(o, L.bo.data(), n, d);
    be.add(h, o, n * d);
    // Cross-attention over the window's encoder rows.
    be.layer_norm(h, L.lnx_w.data(), L.lnx_b.data(), xn, n, d, c.eps);
    be.matmul(L.xq, xn, n, q);
    be.add_bias(q, L.xbq.data(), n, d);
    attend(static_cast<uint8_t*>(cross_kv_[il]->data()), n_enc_, n_enc_, bufs_[B_XPOS]->data());
    be.matmul(L.xo, att, n, o);
    be.add_bias(o, L.xbo.data(), n, d);
    be.add(h, o, n * d);
    // MLP.
    be.layer_norm(h, L.ln2_w.data(), L.ln2_b.data(), xn, n, d, c.eps);
    be.matmul(L.w_up, xn, n, u);
    be.add_bias(u, L.b_up.data(), n, c.ffn_dim);
    be.gelu_erf(u, n * c.ffn_dim);
    be.matmul(L.w_down, u, n, o);
    be.add_bias(o, L.b_down.data(), n, d);
    be.add(h, o, n * d);
  }
  const int64_t first = all_logits ? 0 : n - 1, m = n - first;
  be.layer_norm(h + first * d, out_w_.data(), out_b_.data(), xn, m, d, c.eps);
  float* lg = buf(B_LOGITS, m * c.vocab);
  be.matmul(tok_out_, xn, m, lg);
  be.download(out, lg, (size_t)(m * c.vocab) * 4);
}

// Whisper's timestamp rules (OpenAI's ApplyTimestampRules, as transformers'
// WhisperTimeStampLogitsProcessor applies them) on one step's logits; gen holds the tokens
// generated so far (no prompt).
void WhisperDecoder::step_logits_rules(float* lg, const GreedyOptions& o, const std::vector<int32_t>& gen) const {
  const int V = cfg_.vocab, tb = o.timestamp_begin;
  if (o.no_timestamps >= 0 && o.no_timestamps < V) lg[o.no_timestamps] = kNegInf;
  const size_t k = gen.size();
  const bool last_ts = k >= 1 && gen[k - 1] >= tb;
  const bool penult_ts = k < 2 || gen[k - 2] >= tb;
  if (last_ts) {
    if (penult_ts) std::fill(lg + tb, lg + V, kNegInf);  // a pair closed: text (or the end) next
    else std::fill(lg, lg + std::min<int>(o.eot, V), kNegInf);  // a timestamp must close it
  }
  int32_t ts_last = -1;
  for (size_t i = k; i-- > 0;)
    if (gen[i] >= tb) {
      ts_last = (last_ts && !penult_ts) ? gen[i] : gen[i] + 1;
      break;
    }
  if (ts_last > tb) std::fill(lg + tb, lg + std::min<int>(ts_last, V), kNegInf);  // timestamps never go back
  if (k == 0) {
    std::fill(lg, lg + tb, kNegInf);  // the first token is a timestamp
    if (o.max_initial_timestamp >= 0 && tb + o.max_initial_timestamp + 1 < V)
      std::fill(lg + tb + o.max_initial_timestamp + 1, lg + V, kNegInf);
  }
  // When the timestamps together are likelier than any one text token, take a timestamp.
  float mx = kNegInf;
  for (int i = 0; i < V; ++i) mx = std::max(mx, lg[i]);
  if (mx == kNegInf) return;
  double z = 0, zt = 0;
  float mtext = kNegInf;
  for (int i = 0; i < V; ++i) {
    const double e = std::exp((double)lg[i] - mx);
    z += e;
    if (i >= tb) zt += e;
    else mtext = std::max(mtext, lg[i]);
  }
  const double ts_logprob = zt > 0 ? std::log(zt) - std::log(z) : -INFINITY;
  const double text_logprob = mtext == kNegInf ? -INFINITY : (double)mtext - mx - std::log(z);
  if (ts_logprob > text_logprob) std::fill(lg, lg + tb, kNegInf);
}

GreedyResult WhisperDecoder::greedy(const GreedyOptions& o, int32_t no_speech_id, int sot_index) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  const WhisperDecoderConfig& c = cfg_;
  if (o.prompt.empty()) throw std::invalid_argument("whisper decoder: empty prompt");
  if ((int64_t)o.prompt.size() + o.max_new > c.n_ctx)
    throw std::invalid_argument("whisper decoder: prompt + max_new exceeds the context of " + std::to_string(c.n_ctx));
  if (sot_index < 0 || sot_index >= (int)o.prompt.size())
    throw std::invalid_argument("whisper decoder: sot_index outside the prompt");
  if (!(o.temperature >= 0) || !std::isfinite(o.temperature))
    throw std::invalid_argument("whisper decoder: temperature must be finite and >= 0");
  if (o.timestamp_begin > 0 && (o.timestamp_begin >= c.vocab || o.eot < 0 || o.eot >= o.timestamp_begin))
    throw std::invalid_argument("whisper decoder: timestamp_begin out of range");
  GreedyResult r;
  std::vector<float> lg((size_t)c.vocab);
  const int64_t np_ = (int64_t)o.prompt.size();
  if (no_speech_id >= 0 && no_speech_id < c.vocab) {
    // The no-speech probability is read where whisper reads it: the distribution after
    // <|startoftranscript|>, before any suppression.
    std::vector<float> all((size_t)(np_ * c.vocab));
    forward(o.prompt.data(), np_, 0, true, all.data());
    const float* l0 = all.data() + (size_t)sot_index * c.vocab;
    const float mx = *std::max_element(l0, l0 + c.vocab);
    double z = 0;
    for (int i = 0; i < c.vocab; ++i) z += std::exp((double)l0[i] - mx);
    r.no_speech_prob = (float)(std::exp((double)l0[no_speech_id] - mx) / z);
    std::copy(all.end() - c.vocab, all.end(), lg.begin());
  } else {
    forward(o.prompt.data(), np_, 0, false, lg.data());
  }
  int64_t pos = np_;
  std::mt19937_64 rng(o.seed);
  std::vector<double> probs;
  for (int step = 0; step < o.max_new; ++step) {
    for (int32_t t : o.suppress)
      if (t >= 0 && t < c.vocab) lg[(size_t)t] = kNegInf;
    if (step == 0)
      for (int32_t t : o.suppress_begin)
        if (t >= 0 && t < c.vocab) lg[(size_t)t] = kNegInf;
    if (o.timestamp_begin > 0) step_logits_rules(lg.data(), o, r.tokens);
    const int32_t top = (int32_t)(std::max_element(lg.begin(), lg.end()) - lg.begin());
    const float mx = lg[(size_t)top];
    int32_t best = top;
    if (o.temperature > 0) {
      // Categorical over softmax(logits / T); suppressed tokens (-inf) get weight 0. The
      // uniform draw is mapped by hand (not std::discrete_distribution, whose algorithm is
      // the library's) so a seed gives the same tokens on every platform.
      probs.resize(lg.size());
      double zt = 0;
      for (size_t i = 0; i < lg.size(); ++i) zt += (probs[i] = std::exp(((double)lg[i] - mx) / o.temperature));
      const double u = (double)(rng() >> 11) * (1.0 / 9007199254740992.0) * zt;
      double acc = 0;
      for (size_t i = 0; i < lg.size(); ++i) {
        acc += probs[i];
        if (probs[i] > 0) best = (int32_t)i;  // the last token of nonzero weight, should rounding run out
        if (u < acc && probs[i] > 0) break;
      }
    }
    {
      double z = 0;
      for (float v : lg) z += std::exp((double)v - mx);
      r.sum_logprob += (double)lg[(size_t)best] - mx - std::log(z);
    }
    if (best == o.eot) break;
    r.tokens.push_back(best);
    if (step + 1 == o.max_new) break;
    forward(&best, 1, pos, false, lg.data());
    ++pos;
  }
  return r;
}

}  // namespace dl::audio
