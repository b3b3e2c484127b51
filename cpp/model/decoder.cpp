// The shared decoder forward pass, written once for every family against the
// backend op interface; family quirks arrive as traits and optional tensors.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/errors.h"
#include "model/model.h"
#include "model/session.h"

namespace dl {

void Model::embed_tokens(const int32_t* tokens, int64_t n, float* out) {
  backend_->get_rows(tok_embd_, tokens, n, out);
  if (traits_->embed_scale_sqrt_dim) {
    // Gemma rounds the scale through its compute dtype; sqrt(dim) in f32 as the reference does.
    backend_->scale(out, std::sqrt((float)cfg_.dim), n * cfg_.dim);
  }
}

void Model::forward(Session& s, const int32_t* tokens, const float* embd, int64_t n, bool all_logits,
                    const int32_t* media_ids) {
  if (n <= 0) return;
  if (s.n_past_ + n > s.n_ctx_)
    throw ContextOverflowError("context overflow: " + std::to_string(s.n_past_) + " + " + std::to_string(n) +
                               " tokens exceed the session's context of " + std::to_string(s.n_ctx_));
  if (tokens)
    for (int64_t i = 0; i < n; ++i)
      if (tokens[i] < 0 || tokens[i] >= cfg_.vocab_size)
        throw Error("token id " + std::to_string(tokens[i]) + " out of range [0, " + std::to_string(cfg_.vocab_size) +
                    ")");
  // Row ids of an embedding prefill: negative media ids, or the token id a text row was embedded
  // from (a one-body turn), so the history -- and the prefix cache -- name every row.
  if (media_ids)
    for (int64_t i = 0; i < n; ++i)
      if (media_ids[i] >= cfg_.vocab_size)
        throw Error("row id " + std::to_string(media_ids[i]) + " out of range (a media id < 0 or a token id < " +
                    std::to_string(cfg_.vocab_size) + ")");
  std::lock_guard<std::mutex> lk(mu_);
  // Pages first: a full pool refuses here, with the session unchanged.
  s.kv_->prepare_write(s.n_past_, s.n_past_ + n);
  const int64_t V = cfg_.vocab_size;
  s.logits.assign((size_t)(all_logits ? n * V : V), 0.f);
  for (int64_t i = 0; i < n; i += max_chunk_) {
    const int64_t m = std::min(max_chunk_, n - i);
    const Run run{&s, 0, m, all_logits || i + m == n};
    forward_chunk(&run, 1, tokens ? tokens + i : nullptr, embd ? embd + i * cfg_.dim : nullptr, m, all_logits,
                  nullptr);
    if (all_logits) std::memcpy(s.logits.data() + i * V, tmp_.data(), (size_t)(m * V) * 4);
  }
  if (!all_logits) std::memcpy(s.logits.data(), tmp_.data(), (size_t)V * 4);
  for (int64_t i = 0; i < n; ++i) s.history.push_back(tokens ? tokens[i] : media_ids ? media_ids[i] : -1);
}

std::vector<float> Model::embed_mean(const std::vector<int32_t>& tokens) {
  const int64_t n = (int64_t)tokens.size();
  const int64_t D = cfg_.dim;
  std::vector<float> mean((size_t)D, 0.f);
  if (n == 0) return mean;
  if (n > cfg_.seq_len) throw ContextOverflowError("embed: text longer than the model's context");
  Session s(shared_from_this(), KVType::f32, (int)n);
  std::lock_guard<std::mutex> lk(mu_);
  std::vector<float> hidden;
  for (int64_t i = 0; i < n; i += max_chunk_) {
    const int64_t m = std::min(max_chunk_, n - i);
    hidden.resize((size_t)(m * D));
    const Run run{&s, 0, m};
    forward_chunk(&run, 1, tokens.data() + i, nullptr, m, true, hidden.data());
    for (int64_t r = 0; r < m; ++r)
      for (int64_t d = 0; d < D; ++d) mean[d] += hidden[r * D + d];
  }
  double norm = 0;
  for (float& v : mean) {
    v /= (float)n;
    norm += (double)v * v;
  }
  if (norm > 0)
    for (float& v : mean) v = (float)(v / std::sqrt(norm));
  return mean;
}

void Model::forward_batch(Session* const* sessions, const int32_t* tokens, int64_t B) {
  std::vector<int64_t> counts((size_t)std::max<int64_t>(B, 0), 1);
  forward_ragged(sessions, tokens, counts.data(), B);
}

void Model::forward_ragged(Session* const* sessions, const int32_t* tokens, const int64_t* counts, int64_t B) {
  if (B <= 0) return;
  int64_t total = 0;
  const KVPool* pool = sessions[0]->kv_->pool();
  for (int64_t b = 0; b < B; ++b) {
    Session& s = *sessions[b];
    if (&s.model() != this) throw Error("eval_batch: a session belongs to another model");
    for (int64_t c = 0; c < b; ++c)
      if (sessions[c] == sessions[b]) throw Error("eval_batch: a session appears twice");
    if (s.kv_->pool() != pool) throw Error("eval_batch: sessions must all be flat or all of one KV pool");
    if (counts[b] < 1) throw Error("eval_batch: session " + std::to_string(b) + " has no tokens");
    if (s.n_past_ + counts[b] > s.n_ctx_)
      throw ContextOverflowError("context overflow: session " + std::to_string(b) + " holds " +
                                 std::to_string(s.n_past_) + " of " + std::to_string(s.n_ctx_) + " positions, " +
                                 std::to_string(counts[b]) + " more do not fit");
    for (int64_t i = 0; i < counts[b]; ++i)
      if (tokens[total + i] < 0 || tokens[total + i] >= cfg_.vocab_size)
        throw Error("token id " + std::to_string(tokens[total + i]) + " out of range");
    total += counts[b];
  }
  std::lock_guard<std::mutex> lk(mu_);
  // Every session's pages before any compute; on refusal the ones already served
  // give back what they just took, so no session has moved.
  for (int64_t b = 0; b < B; ++b) {
    try {
      sessions[b]->kv_->prepare_write(sessions[b]->n_past_, sessions[b]->n_past_ + counts[b]);
    } catch (const PoolExhaustedError& e) {
      for (int64_t c = 0; c < b; ++c) sessions[c]->kv_->truncate(sessions[c]->n_past_);
      throw PoolExhaustedError("eval_batch: session " + std::to_string(b) + " of the batch: " + e.what(), b);
    }
  }
  const int64_t V = cfg_.vocab_size;
  std::vector<Run>& runs = batch_runs_;
  std::vector<int32_t>& chunk_tokens = batch_tokens_;
  runs.clear();
  chunk_tokens.clear();
  auto flush = [&] {
    if (runs.empty()) return;
    forward_chunk(runs.data(), (int)runs.size(), chunk_tokens.data(), nullptr, (int64_t)chunk_tokens.size(), false,
                  nullptr);
    int64_t k = 0;
    for (const Run& r : runs) {
      for (int64_t i = 0; i < r.n_rows; ++i) r.s->history.push_back(chunk_tokens[r.first_row + i]);
      if (r.want_logits) {
        r.s->logits.assign(tmp_.begin() + k * V, tmp_.begin() + (k + 1) * V);
        ++k;
      }
    }
    runs.clear();
    chunk_tokens.clear();
  };
  // Rows packed into chunks of max_chunk_; a long prefill run continues in the next chunk.
  int64_t off = 0;
  for (int64_t b = 0; b < B; ++b) {
    int64_t left = counts[b];
    while (left > 0) {
      const int64_t take = std::min(left, max_chunk_ - (int64_t)chunk_tokens.size());
      runs.push_back(Run{sessions[b], (int64_t)chunk_tokens.size(), take, take == left});
      chunk_tokens.insert(chunk_tokens.end(), tokens + off, tokens + off + take);
      off += take;
      left -= take;
      if ((int64_t)chunk_tokens.size() == max_chunk_) flush();
    }
  }
  flush();
}

void Model::forward_chunk(const Run* runs, int n_runs, const int32_t* tokens, const float* embd, int64_t n,
                          bool all_logits, float* last_hidden) {
  const ModelConfig& c = cfg_;
  Backend& be = *backend_;
  const int64_t D = c.dim, hd = c.head_dim;
  const int64_t q_dim = (int64_t)c.n_heads * hd, kv_dim = (int64_t)c.n_kv_heads * hd;
  const int64_t F = c.ffn_dim;
  x_.resize((size_t)(n * D));
  xn_.resize((size_t)(n * D));
  q_.resize((size_t)(n * q_dim));
  k_.resize((size_t)(n * kv_dim));
  v_.resize((size_t)(n * kv_dim));
  attn_.resize((size_t)(n * q_dim));
  gate_.resize((size_t)(n * 2 * F));
  up_.resize((size_t)(n * F));
  ffn_.resize((size_t)(n * std::max<int64_t>(D, q_dim + 2 * kv_dim)));
  pos_.resize((size_t)n);
  for (int ri = 0; ri < n_runs; ++ri)
    for (int64_t i = 0; i < runs[ri].n_rows; ++i) pos_[runs[ri].first_row + i] = (int32_t)(runs[ri].s->n_past_ + i);

  if (tokens)
    embed_tokens(tokens, n, x_.data());
  else
    std::memcpy(x_.data(), embd, (size_t)(n * D) * 4);

  RopeParams rp;
  rp.neox = traits_->rope == RopeType::neox;
  rp.n_rot = c.n_rot;
  rp.freq_scale = c.rope_freq_scale;
  rp.freq_factors = rope_freqs_.empty() ? nullptr : rope_freqs_.data();
  rp.inv_freq = c.rope_inv_freq.empty() ? nullptr : c.rope_inv_freq.data();
  rp.mscale = c.rope_mscale;
  const Act act = traits_->act == FfnAct::silu ? Act::silu : Act::gelu_tanh;

  for (int il = 0; il < c.n_layers; ++il) {
    const LayerWeights& L = layers_[il];
    const bool swa = c.layer_is_swa[il];
    be.rms_norm(x_.data(), L.attn_norm.data(), xn_.data(), n, D, c.norm_eps);
    if (!L.wqkv.empty()) {
      float* qkv = ffn_.data();
      be.matmul(L.wqkv, xn_.data(), n, qkv);
      const int64_t w = q_dim + 2 * kv_dim;
      for (int64_t t = 0; t < n; ++t) {
        std::memcpy(q_.data() + t * q_dim, qkv + t * w, (size_t)q_dim * 4);
        std::memcpy(k_.data() + t * kv_dim, qkv + t * w + q_dim, (size_t)kv_dim * 4);
        std::memcpy(v_.data() + t * kv_dim, qkv + t * w + q_dim + kv_dim, (size_t)kv_dim * 4);
      }
    } else {
      const Weight* w[3] = {&L.wq, &L.wk, &L.wv};
      float* y[3] = {q_.data(), k_.data(), v_.data()};
      be.matmul_multi(w, y, 3, xn_.data(), n);
      if (!L.bq.empty()) be.add_bias(q_.data(), L.bq.data(), n, q_dim);
      if (!L.bk.empty()) be.add_bias(k_.data(), L.bk.data(), n, kv_dim);
      if (!L.bv.empty()) be.add_bias(v_.data(), L.bv.data(), n, kv_dim);
    }
    if (!L.q_norm.empty()) be.rms_norm(q_.data(), L.q_norm.data(), q_.data(), n * c.n_heads, hd, c.norm_eps);
    if (!L.k_norm.empty()) be.rms_norm(k_.data(), L.k_norm.data(), k_.data(), n * c.n_kv_heads, hd, c.norm_eps);
    rp.base = swa ? c.rope_base_swa : c.rope_base;
    rp.freq_scale = swa ? c.rope_freq_scale_swa : c.rope_freq_scale;
    be.rope(q_.data(), n, q_dim, c.n_heads, (int)hd, pos_.data(), rp);
    be.rope(k_.data(), n, kv_dim, c.n_kv_heads, (int)hd, pos_.data(), rp);

    // Each session's rows write its own cache and attend over it, through its block
    // table; the attentions of all sessions go to the backend together.
    attn_args_.resize((size_t)n_runs);
    for (int ri = 0; ri < n_runs; ++ri) {
      Session& s = *runs[ri].s;
      const BlockTable& kv = *s.kv_;
      const int64_t r0 = runs[ri].first_row, nr = runs[ri].n_rows;
      const size_t rb = kv.geometry().row_bytes;
      const int sh = kv.page_shift();
      const int64_t P = kv.page_rows();
      for (int64_t i = 0; i < nr;) {  // stores split at page ends
        const int64_t row = s.n_past_ + i;
        const int64_t in_page = sh >= 62 ? row : row & (P - 1);
        const int64_t cnt = std::min(nr - i, P - in_page);
        uint8_t* page = const_cast<uint8_t*>(kv.page_ptrs()[row >> sh]);
        be.kv_store(page + kv.k_off(il), s.kv_type_, rb, in_page, k_.data() + (r0 + i) * kv_dim, cnt, kv_dim, kv_dim);
        be.kv_store(page + kv.v_off(il), s.kv_type_, rb, in_page, v_.data() + (r0 + i) * kv_dim, cnt, kv_dim, kv_dim);
        i += cnt;
      }
      AttnArgs& a = attn_args_[(size_t)ri];
      a = AttnArgs{};
      a.q = q_.data() + r0 * q_dim;
      a.q_stride = q_dim;
      a.pages = kv.page_ptrs();
      a.page_shift = sh;
      a.k_off = kv.k_off(il);
      a.v_off = kv.v_off(il);
      a.kv_row_bytes = rb;
      a.kv_type = s.kv_type_;
      a.n_tok = nr;
      a.n_kv = s.n_past_ + nr;
      a.n_heads = c.n_heads;
      a.n_kv_heads = c.n_kv_heads;
      a.head_dim = (int)hd;
      a.q_pos = pos_.data() + r0;
      a.window = swa ? c.sliding_window : 0;
      a.scale = c.attn_scale;
      a.softcap = c.attn_softcap;
      a.out = attn_.data() + r0 * q_dim;
      a.out_stride = q_dim;
    }
    be.attention_multi(attn_args_.data(), n_runs);

    float* o = ffn_.data();
    be.matmul(L.wo, attn_.data(), n, o);
    if (!L.attn_post_norm.empty()) be.rms_norm(o, L.attn_post_norm.data(), o, n, D, c.norm_eps);
    be.add(x_.data(), o, n * D);

    be.rms_norm(x_.data(), L.ffn_norm.data(), xn_.data(), n, D, c.norm_eps);
    if (!L.w_gate_up.empty()) {
      be.matmul(L.w_gate_up, xn_.data(), n, gate_.data());
      be.glu(gate_.data(), 2 * F, gate_.data() + F, 2 * F, up_.data(), n, F, act);
    } else {
      const Weight* w[2] = {&L.w_gate, &L.w_up};
      float* y[2] = {gate_.data(), up_.data()};
      be.matmul_multi(w, y, 2, xn_.data(), n);
      be.glu(gate_.data(), F, up_.data(), F, up_.data(), n, F, act);
    }
    be.matmul(L.w_down, up_.data(), n, o);
    if (!L.ffn_post_norm.empty()) be.rms_norm(o, L.ffn_post_norm.data(), o, n, D, c.norm_eps);
    be.add(x_.data(), o, n * D);
  }
  for (int ri = 0; ri < n_runs; ++ri) runs[ri].s->n_past_ += runs[ri].n_rows;

  // Final norm and logits: of every row, or of the last row of each run.
  int64_t rows = 0;
  if (all_logits) {
    rows = n;
    be.rms_norm(x_.data(), output_norm_.data(), xn_.data(), n, D, c.norm_eps);
  } else {
    for (int ri = 0; ri < n_runs; ++ri) {
      if (!runs[ri].want_logits) continue;
      const int64_t last = runs[ri].first_row + runs[ri].n_rows - 1;
      be.rms_norm(x_.data() + last * D, output_norm_.data(), xn_.data() + rows * D, 1, D, c.norm_eps);
      ++rows;
    }
  }
  if (last_hidden) std::memcpy(last_hidden, xn_.data(), (size_t)(rows * D) * 4);
  tmp_.resize((size_t)(rows * c.vocab_size));
  if (rows == 0) return;  // a run that continues in the next chunk wants no logits yet
  be.matmul(output_, xn_.data(), rows, tmp_.data());
  if (c.final_softcap > 0) be.softcap(tmp_.data(), c.final_softcap, rows * c.vocab_size);
}

}  // namespace dl
