// The shared decoder forward pass, written once for every family against the
// backend op interface; family quirks arrive as traits and optional tensors. All
// activations live in backend memory; a step crosses to the host twice: one upload
// of its ids, positions and block tables, one download of its logits.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "core/errors.h"
#include "core/threadpool.h"
#include "model/model.h"
#include "model/session.h"

namespace dl {

float* Model::scratch(BufferPtr& b, int64_t floats, const char* what) {
  const size_t bytes = (size_t)std::max<int64_t>(floats, 1) * sizeof(float);
  if (!b || b->size() < bytes) b = backend_->alloc(bytes, what);
  return static_cast<float*>(b->data());
}

void Model::state_copy(void* dst, const void* src, size_t bytes) {
  std::lock_guard<std::mutex> lk(mu_);
  if (src)
    backend_->copy(dst, src, bytes);
  else
    backend_->zero(dst, bytes);
}

void Model::embed_tokens(const int32_t* tokens, int64_t n, float* out) {
  // Host in, host out (the chat layer embeds text rows beside media rows).
  for (int64_t i = 0; i < n; ++i)
    if (tokens[i] < 0 || tokens[i] >= cfg_.vocab_size)
      throw Error("token id " + std::to_string(tokens[i]) + " out of range");
  if (n <= 0) return;
  std::lock_guard<std::mutex> lk(mu_);
  drop_spec();  // the metadata and activations below are a kept step's
  int32_t* ids = reinterpret_cast<int32_t*>(scratch(meta_, n, "step metadata"));
  backend_->upload(ids, tokens, (size_t)n * 4);
  float* x = scratch(x_, n * cfg_.dim, "activations");
  backend_->get_rows(tok_embd_, ids, n, x);
  if (traits_->embed_scale_sqrt_dim) backend_->scale(x, std::sqrt((float)cfg_.dim), n * cfg_.dim);
  backend_->download(out, x, (size_t)(n * cfg_.dim) * 4);
}

void Model::forward(Session& s, const int32_t* tokens, const float* embd, int64_t n, bool all_logits,
                    const int32_t* media_ids, int64_t span_lo, int64_t span_hi, const MropeGrid* grid) {
  if (n <= 0) return;
  if (span_lo < 0 || span_hi < span_lo || span_hi > n)
    throw Error("non-causal span [" + std::to_string(span_lo) + ", " + std::to_string(span_hi) +
                ") is not within the call's " + std::to_string(n) + " rows");
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
  // Every element is written below (the last chunk's row, or every chunk's rows): no zero fill
  // of a vocabulary's floats per decode step unless the size changes.
  s.drop_lazy_logits();
  if (s.logits.size() != (size_t)(all_logits ? n * V : V)) s.logits.assign((size_t)(all_logits ? n * V : V), 0.f);
  // A model with recurrent layers snapshots their state at the last page boundary the rows
  // cross (the chunk splits there; the prefix cache keeps page-aligned snapshots) and at the
  // end of a prefill (a turn's end, where a chat rewinds to).
  const bool snap = s.recurrent_state() != nullptr;
  const int64_t P = s.kv_->paged() ? s.kv_->page_rows() : 0;
  const int64_t boundary = snap && P > 0 ? (s.n_past_ + n) / P * P : -1;
  // A non-causal span is prefilled in one chunk (every row's keys must be stored before any
  // attends), however long: chunks end where it starts, and it is one chunk of its own (a page
  // boundary inside it is not split at).
  const bool span = span_lo < span_hi;
  span_pos_lo_ = s.n_past_ + span_lo, span_pos_hi_ = span ? s.n_past_ + span_hi : span_pos_lo_;
  if (grid)
    mrope_lo_ = s.n_past_ + grid->lo, mrope_hi_ = s.n_past_ + grid->hi, mrope_base_ = grid->base,
    mrope_first_ = grid->first, mrope_gw_ = grid->w;
  struct Reset {
    Model* m;
    ~Reset() {
      m->span_pos_lo_ = m->span_pos_hi_ = m->mrope_lo_ = m->mrope_hi_ = 0;
      m->deep_chunk_ = nullptr;
    }
  } reset{this};
  for (int64_t i = 0; i < n;) {
    int64_t m = std::min(max_chunk_, n - i);
    if (span && i < span_hi && i + m > span_lo && (i < span_lo || i + m < span_hi))
      m = i < span_lo ? span_lo - i : span_hi - i;
    if (s.n_past_ < boundary && s.n_past_ + m > boundary) {
      const int64_t cut = boundary - s.n_past_;
      if (!(span && i + cut > span_lo && i + cut < span_hi)) m = cut;
    }
    const Run run{&s, 0, m, all_logits || i + m == n};
    deep_chunk_ = grid && grid->deep ? grid->deep + i * cfg_.n_deepstack * cfg_.dim : nullptr;
    const int64_t rows =
        forward_chunk(&run, 1, tokens ? tokens + i : nullptr, embd ? embd + i * cfg_.dim : nullptr, m, all_logits);
    if (rows > 0)
      backend_->download(s.logits.data() + (all_logits ? i * V : 0), logits_->data(), (size_t)(rows * V) * 4);
    i += m;
    if (snap && (s.n_past_ == boundary || (i == n && n > 1))) s.snapshot();
  }
  for (int64_t i = 0; i < n; ++i) s.history.push_back(tokens ? tokens[i] : media_ids ? media_ids[i] : -1);
}

void Model::forward_mrope(Session& s, const float* embd, int64_t n, const int32_t* media_ids, int64_t lo, int64_t hi,
                          int grid_h, int grid_w, bool non_causal, int64_t first_row, const float* deep) {
  if (!cfg_.mrope)
    throw Error("eval_embd_span_mrope: the model has no M-RoPE sections (rope.dimension_sections)");
  if (lo < 0 || hi < lo || hi > n)
    throw Error("M-RoPE span [" + std::to_string(lo) + ", " + std::to_string(hi) + ") is not within the call's " +
                std::to_string(n) + " rows");
  const int64_t cells = (int64_t)grid_h * grid_w;
  if (grid_h < 1 || grid_w < 1 || first_row < 0 || first_row + (hi - lo) > cells || (first_row > 0 && lo != 0) ||
      first_row > s.n_past_)
    throw Error("M-RoPE span of " + std::to_string(hi - lo) + " rows from grid row " + std::to_string(first_row) +
                " does not fit a " + std::to_string(grid_h) + " x " + std::to_string(grid_w) + " grid");
  if (s.n_past_ + n > s.n_ctx_) {
    forward(s, nullptr, embd, n, false, media_ids);  // throws the usual overflow error
    return;
  }
  // The image starts first_row rows back; its top-left takes the rope position its first row
  // would have had, and rows after it continue at that + max(grid).
  const int64_t start = s.n_past_ + lo - first_row;
  const auto marks = s.rope_marks;
  const int64_t delta = s.rope_delta(start);
  MropeGrid g;
  g.lo = lo, g.hi = hi, g.base = start + delta, g.first = first_row, g.w = grid_w;
  g.deep = cfg_.n_deepstack > 0 ? deep : nullptr;
  const bool ends = first_row + (hi - lo) == cells;
  if (ends) {
    const int64_t end = s.n_past_ + hi;
    while (!s.rope_marks.empty() && s.rope_marks.back().first >= end) s.rope_marks.pop_back();
    s.rope_marks.emplace_back(end, delta + std::max(grid_h, grid_w) - cells);
  }
  try {
    forward(s, nullptr, embd, n, false, media_ids, non_causal ? lo : 0, non_causal ? hi : 0, &g);
  } catch (...) {
    s.rope_marks = marks;
    while (!s.rope_marks.empty() && s.rope_marks.back().first > s.n_past_) s.rope_marks.pop_back();
    throw;
  }
}

std::vector<float> Model::embed_mean(const std::vector<int32_t>& tokens) {
  const int64_t n = (int64_t)tokens.size();
  const int64_t D = cfg_.dim;
  std::vector<float> mean((size_t)D, 0.f);
  if (n == 0) return mean;
  if (n > cfg_.seq_len) throw ContextOverflowError("embed: text longer than the model's context");
  Session s(shared_from_this(), KVType::f32, (int)n);
  std::lock_guard<std::mutex> lk(mu_);
  std::vector<float>& hidden = hidden_host_;
  for (int64_t i = 0; i < n; i += max_chunk_) {
    const int64_t m = std::min(max_chunk_, n - i);
    hidden.resize((size_t)(m * D));
    const Run run{&s, 0, m};
    s.kv_->prepare_write(s.n_past_, s.n_past_ + m);
    forward_chunk(&run, 1, tokens.data() + i, nullptr, m, true);
    backend_->download(hidden.data(), xn_->data(), (size_t)(m * D) * 4);  // the final-norm rows
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

std::shared_ptr<float> Model::logits_block_for(size_t floats) {
  const char* e = std::getenv("DASLLAMA_LAZY_LOGITS");  // 0: copy each row into its session
  if (e && e[0] == '0') return nullptr;
  // use_count() == 1: only this list holds it (sessions take references under mu_, held here).
  for (auto& b : logits_blocks_)
    if (b.first.use_count() == 1) {
      if (b.second < floats) b.first = backend_->host_block(floats), b.second = floats;
      return b.first;
    }
  if (logits_blocks_.size() >= kLogitsBlocks) return nullptr;
  logits_blocks_.emplace_back(backend_->host_block(floats), floats);
  return logits_blocks_.back().first;
}

void Model::forward_batch(Session* const* sessions, const int32_t* tokens, int64_t B) {
  std::vector<int64_t> counts((size_t)std::max<int64_t>(B, 0), 1);
  forward_ragged(sessions, tokens, counts.data(), B);
}

void Model::forward_ragged(Session* const* sessions, const int32_t* tokens, const int64_t* counts, int64_t B,
                           int32_t* greedy_ids) {
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
  // Greedy: every chunk's argmax lands in batch_ids_ (a chunk's rows at most: never regrown, so
  // a recorded step's pointer to it stays good), and the want-runs' ids go to greedy_ids in
  // session order: each session's last run is its only one that wants logits, and runs are
  // made in session order.
  struct Reset {
    Model* m;
    ~Reset() { m->greedy_out_ = nullptr; }
  } reset{this};
  greedy_out_ = greedy_ids ? reinterpret_cast<int32_t*>(scratch(batch_ids_, max_chunk_, "greedy ids")) : nullptr;
  int64_t next_b = 0;
  std::vector<Run>& runs = batch_runs_;
  std::vector<int32_t>& chunk_tokens = batch_tokens_;
  runs.clear();
  chunk_tokens.clear();
  // A decode-only step whose sessions all fit one chunk may record its successor (speculate).
  bool decode_only = B <= max_chunk_ && spec_on() && backend_->defer_steps();
  for (int64_t b = 0; b < B && decode_only; ++b) decode_only = counts[b] == 1 && !sessions[b]->recurrent_state();
  // The chunk's logits down and into the sessions (rows of them, made by the step just issued).
  auto finish = [&](int64_t rows) {
    if (greedy_ids) {
      if (!batch_ids_host_) batch_ids_host_ = backend_->host_block((size_t)max_chunk_);
      int32_t* hids = reinterpret_cast<int32_t*>(batch_ids_host_.get());
      if (rows > 0 && decode_only && (int64_t)runs.size() == B) {
        backend_->download_start(hids, greedy_out_, (size_t)rows * 4);
        speculate(sessions, B);
        backend_->download_finish();
      } else if (rows > 0) {
        backend_->download(hids, greedy_out_, (size_t)rows * 4);
      }
      int64_t k = 0;
      for (const Run& r : runs) {
        for (int64_t i = 0; i < r.n_rows; ++i) r.s->history.push_back(chunk_tokens[r.first_row + i]);
        if (!r.want_logits) continue;
        r.s->drop_lazy_logits();
        r.s->logits.clear();  // not this step's: the step kept its logits on the backend
        greedy_ids[next_b++] = hids[k++];
      }
      runs.clear();
      chunk_tokens.clear();
      return;
    }
    // Every session's logits in one download, into a host block the sessions then point
    // into (no copy of B x vocab floats -- 32.8 MB at B = 64 for a 128K vocabulary -- a step:
    // a session copies its row when it is read as a vector, a sampler reads it in place).
    // Where every block is still referenced, the rows go through the staging buffer and are
    // copied into the sessions' own logits on the host threads.
    std::shared_ptr<float> blk = rows > 0 ? logits_block_for((size_t)(rows * V)) : nullptr;
    const float* lg = blk ? blk.get() : rows > 0 ? backend_->host_staging((size_t)(rows * V)) : nullptr;
    if (rows > 0 && decode_only && (int64_t)runs.size() == B) {
      // The device runs this step while the host records the next one.
      backend_->download_start(const_cast<float*>(lg), logits_->data(), (size_t)(rows * V) * 4);
      speculate(sessions, B);
      backend_->download_finish();
    } else if (rows > 0) {
      backend_->download(const_cast<float*>(lg), logits_->data(), (size_t)(rows * V) * 4);
    }
    batch_want_.clear();
    for (const Run& r : runs) {
      for (int64_t i = 0; i < r.n_rows; ++i) r.s->history.push_back(chunk_tokens[r.first_row + i]);
      if (r.want_logits) batch_want_.push_back(r.s);
    }
    if (blk) {
      for (size_t k = 0; k < batch_want_.size(); ++k) {
        Session& s = *batch_want_[k];
        s.lazy_block_ = blk, s.lazy_ = lg + k * V, s.lazy_n_ = V;
      }
    } else {
      auto copy_rows = [&](int64_t lo, int64_t hi) {
        for (int64_t k = lo; k < hi; ++k) {
          batch_want_[k]->drop_lazy_logits();
          batch_want_[k]->logits.assign(lg + k * V, lg + (k + 1) * V);
        }
      };
      ThreadPool* tp = batch_want_.size() >= 4 ? backend_->host_threads() : nullptr;
      if (tp && tp->size() > 1)
        tp->parallel_for((int64_t)batch_want_.size(), 1, copy_rows);
      else
        copy_rows(0, (int64_t)batch_want_.size());
    }
    runs.clear();
    chunk_tokens.clear();
  };
  auto flush = [&] {
    if (runs.empty()) return;
    finish(forward_chunk(runs.data(), (int)runs.size(), chunk_tokens.data(), nullptr, (int64_t)chunk_tokens.size(),
                         false));
  };
  if (spec_.on) {
    if (spec_matches(sessions, counts, B, greedy_ids != nullptr) && backend_->deferred_pending()) {
      // This step was recorded while the last one ran: its ids in, then it is issued.
      backend_->upload(spec_.ids_dev, tokens, (size_t)B * 4);
      backend_->launch_deferred();
      spec_.on = false;
      ++spec_hits_;
      for (int64_t b = 0; b < B; ++b) {
        sessions[b]->n_past_ += 1;
        runs.push_back(Run{sessions[b], b, 1, true});
      }
      chunk_tokens.assign(tokens, tokens + B);
      finish(B);
      return;
    }
    drop_spec();
  }
  // Rows packed into chunks of max_chunk_; a long prefill run continues in the next chunk. A
  // session with recurrent layers snapshots their state as forward() does (at the last page
  // boundary its rows cross, at a prefill's end): its run ends there and the chunk runs first.
  int64_t off = 0;
  for (int64_t b = 0; b < B; ++b) {
    Session& s = *sessions[b];
    const bool snap = s.recurrent_state() != nullptr;
    const int64_t p0 = s.n_past_, P = s.kv_->paged() ? s.kv_->page_rows() : 0;
    const int64_t boundary = snap && P > 0 ? (p0 + counts[b]) / P * P : -1;
    int64_t left = counts[b];
    while (left > 0) {
      const int64_t pos = p0 + counts[b] - left;
      int64_t take = std::min(left, max_chunk_ - (int64_t)chunk_tokens.size());
      if (pos < boundary && pos + take > boundary) take = boundary - pos;
      runs.push_back(Run{&s, (int64_t)chunk_tokens.size(), take, take == left});
      chunk_tokens.insert(chunk_tokens.end(), tokens + off, tokens + off + take);
      off += take;
      left -= take;
      const bool at_snapshot = snap && (pos + take == boundary || (left == 0 && counts[b] > 1));
      if ((int64_t)chunk_tokens.size() == max_chunk_ || at_snapshot) flush();
      if (at_snapshot) s.snapshot();
    }
  }
  flush();
}

// The host data of a step in one upload: token ids, positions, each run's block table.
void Model::stage_step(const Run* runs, int n_runs, const int32_t* tokens, int64_t n) {
  std::vector<int32_t>& h = meta_host_;
  h.clear();
  if (tokens) h.insert(h.end(), tokens, tokens + n);
  const size_t pos_at = h.size();
  h.resize(pos_at + (size_t)n);
  // Rope positions (t's under M-RoPE): a row's cache position plus its session's rope delta
  // (nonzero after an M-RoPE image), the image rows at their grid's t position.
  bool shifted = false;
  mrope_step_ = false;
  for (int ri = 0; ri < n_runs; ++ri) {
    const Session& s = *runs[ri].s;
    for (int64_t i = 0; i < runs[ri].n_rows; ++i) {
      const int64_t p = s.n_past_ + i;
      int64_t r = p;
      if (p >= mrope_lo_ && p < mrope_hi_ && n_runs == 1) {
        r = mrope_base_;
        mrope_step_ = true;
      } else if (!s.rope_marks.empty()) {
        r = p + s.rope_delta(p);
      }
      shifted |= r != p;
      h[pos_at + (size_t)(runs[ri].first_row + i)] = (int32_t)r;
    }
  }
  size_t hw_at = pos_at;
  if (mrope_step_) {  // then h's and w's rows (equal to t's but for the image's)
    hw_at = h.size();
    h.resize(hw_at + 2 * (size_t)n);
    for (size_t i = 0; i < (size_t)n; ++i) {
      const int64_t p = runs[0].s->n_past_ + (int64_t)i;
      int32_t ph = h[pos_at + i], pw = ph;
      if (p >= mrope_lo_ && p < mrope_hi_) {
        const int64_t k = p - mrope_lo_ + mrope_first_;
        ph = (int32_t)(mrope_base_ + k / mrope_gw_), pw = (int32_t)(mrope_base_ + k % mrope_gw_);
      }
      h[hw_at + i] = ph;
      h[hw_at + (size_t)n + i] = pw;
    }
  }
  std::vector<size_t> table_at((size_t)n_runs);
  for (int ri = 0; ri < n_runs; ++ri) {
    const std::vector<int32_t>& ids = runs[ri].s->kv_->page_ids();
    table_at[(size_t)ri] = h.size();
    h.insert(h.end(), ids.begin(), ids.end());
  }
  // A non-causal span in this step (forward's, one run): its rows mask by the span's last position.
  // Attention masks by cache positions: rope's when they are the same.
  size_t mask_at = pos_at;
  const bool span = span_pos_hi_ > span_pos_lo_ && n_runs == 1;
  if (span || shifted) {
    mask_at = h.size();
    h.resize(mask_at + (size_t)n);
    for (int ri = 0; ri < n_runs; ++ri)
      for (int64_t i = 0; i < runs[ri].n_rows; ++i) {
        const int64_t p = runs[ri].s->n_past_ + i;
        h[mask_at + (size_t)(runs[ri].first_row + i)] =
            span && p >= span_pos_lo_ && p < span_pos_hi_ ? (int32_t)(span_pos_hi_ - 1) : (int32_t)p;
      }
  }
  int32_t* dev = reinterpret_cast<int32_t*>(scratch(meta_, (int64_t)h.size(), "step metadata"));
  backend_->upload(dev, h.data(), h.size() * 4);
  tokens_dev_ = tokens ? dev : nullptr;
  pos_dev_ = dev + pos_at;
  pos_hw_dev_ = dev + hw_at;
  mask_pos_dev_ = dev + mask_at;
  run_pages_.resize((size_t)n_runs);
  for (int ri = 0; ri < n_runs; ++ri) run_pages_[(size_t)ri] = dev + table_at[(size_t)ri];
}

int64_t Model::forward_chunk(const Run* runs, int n_runs, const int32_t* tokens, const float* embd, int64_t n,
                             bool all_logits) {
  const ModelConfig& c = cfg_;
  Backend& be = *backend_;
  const int64_t D = c.dim;
  if (!spec_making_) drop_spec();  // another step: the recorded one would read its metadata
  if (embd) {  // embedding rows from the host: uploaded with the step's other host data, before the step
    embd_dev_ = scratch(embd_, n * D, "embedding rows");
    be.upload(embd_dev_, embd, (size_t)(n * D) * 4);
  }
  // Deepstack rows, layer-major ([layer][row][dim]) so each layer's add is one contiguous run.
  const int K = deep_chunk_ ? c.n_deepstack : 0;
  float* deep = nullptr;
  if (K > 0) {
    deep_host_.resize((size_t)(K * n * D));
    for (int64_t r = 0; r < n; ++r)
      for (int l = 0; l < K; ++l)
        std::memcpy(deep_host_.data() + ((size_t)l * n + r) * D, deep_chunk_ + (r * K + l) * D, (size_t)D * 4);
    deep = scratch(deep_, K * n * D, "deepstack rows");
    be.upload(deep, deep_host_.data(), deep_host_.size() * 4);
  }
  stage_step(runs, n_runs, tokens, n);
  if (dev_ids_) tokens_dev_ = dev_ids_;
  float* x = scratch(x_, n * D, "activations");
  be.begin_step();
  if (tokens_dev_) {
    be.get_rows(tok_embd_, tokens_dev_, n, x);
    // Gemma rounds the scale through its compute dtype; sqrt(dim) in f32 as the reference does.
    if (traits_->embed_scale_sqrt_dim) be.scale(x, std::sqrt((float)D), n * D);
  } else {
    be.copy(x, embd_dev_, (size_t)(n * D) * 4);
  }
  if (c.ple_dim > 0) ple_inputs(n);
  for (int il = 0; il < c.n_layers; ++il) {
    if (decode_layer(il, runs, n_runs, n)) continue;
    if (c.rec_slot[il] >= 0)
      recurrent_block(il, runs, n_runs, n);
    else
      attention_block(il, runs, n_runs, n);
    ffn_block(il, n);
    const LayerWeights& L = layers_[il];
    if (c.ple_dim > 0) {
      // x += post_norm(proj(gelu(gate x) * this layer's per-layer input))
      const int64_t P = c.ple_dim;
      float* g = scratch(ple_tmp_, n * std::max<int64_t>(P, D), "activations");
      float* o = static_cast<float*>(ffn_->data());
      be.matmul(L.ple_gate, x, n, g);
      be.glu(g, P, static_cast<const float*>(ple_->data()) + il * P, (int64_t)c.n_layers * P, g, n, P, Act::gelu_tanh);
      project_residual(L.ple_proj, Vec{}, L.ple_post_norm, g, n, o);
    }
    if (L.out_scale != 1.f) be.scale(x, L.out_scale, n * D);
    if (il < K) be.add(x, deep + (int64_t)il * n * D, n * D);
  }
  for (int ri = 0; ri < n_runs; ++ri) runs[ri].s->n_past_ += runs[ri].n_rows;
  const int64_t rows = logits_block(runs, n_runs, n, all_logits);
  if (greedy_out_ && rows > 0)
    be.argmax(logits_dst_ ? logits_dst_ : static_cast<const float*>(logits_->data()), rows, c.vocab_size, greedy_out_);
  if (defer_end_) spec_kept_ = be.end_step_deferred();
  else be.end_step();
  return rows;
}

Model::~Model() {
  if (spec_.on && backend_) backend_->drop_deferred();  // its ops name this model's buffers
}

bool Model::spec_on() {
  // On by default (H200, nineteenth session: Q8_0 B=4/16/32/64 +4/+3/+6/+5%, Q4_0 +5/+5/+8/+10%);
  // DASLLAMA_SPECULATE=0 turns it off. Read at each step, so one process A/Bs it.
  const char* e = std::getenv("DASLLAMA_SPECULATE");
  return !(e && std::strcmp(e, "0") == 0);
}

// Records the step after the one just issued for the same sessions (one token each, at the
// positions they now have), ended deferred, ids to come. Nothing when a session's next row
// needs a page taken or copied (the pool must not move for a step that may never run), or a
// session is at its context's end. A failure here is dropped: the step then runs as usual.
void Model::speculate(Session* const* sessions, int64_t B) {
  spec_.on = false;
  for (int64_t b = 0; b < B; ++b) {
    const Session& s = *sessions[b];
    if (s.n_past_ + 1 > s.n_ctx_ || !s.kv_->writes_in_place(s.n_past_, s.n_past_ + 1)) return;
  }
  spec_runs_.clear();
  spec_.n_past.resize((size_t)B);
  for (int64_t b = 0; b < B; ++b) {
    spec_runs_.push_back(Run{sessions[b], b, 1, true});
    spec_.n_past[(size_t)b] = sessions[b]->n_past_;
  }
  spec_ids_.assign((size_t)B, 0);  // placeholders: the real ids are uploaded before the launch
  spec_making_ = defer_end_ = true;
  spec_kept_ = false;
  bool ok = false;
  try {
    forward_chunk(spec_runs_.data(), (int)B, spec_ids_.data(), nullptr, B, false);
    ok = spec_kept_ && tokens_dev_ != nullptr;
  } catch (...) {
  }
  spec_making_ = defer_end_ = false;
  for (int64_t b = 0; b < B; ++b) sessions[b]->n_past_ = spec_.n_past[(size_t)b];  // forward_chunk moved them
  if (!ok) {
    backend_->drop_deferred();
    return;
  }
  spec_.sessions.assign(sessions, sessions + B);
  spec_.serials.resize((size_t)B), spec_.pages.resize((size_t)B);
  for (int64_t b = 0; b < B; ++b) {
    spec_.serials[(size_t)b] = sessions[b]->serial_;
    spec_.pages[(size_t)b] = sessions[b]->kv_->page_ids();
  }
  spec_.ids_dev = const_cast<int32_t*>(tokens_dev_);
  spec_.greedy = greedy_out_ != nullptr;
  spec_.on = true;
}

// Whether this call is the speculated step: the same sessions (address and serial) in the same
// order, one token each, each where the recording left it, with the same pages, still writable
// in place.
bool Model::spec_matches(Session* const* sessions, const int64_t* counts, int64_t B, bool greedy) const {
  if (!spec_.on || (size_t)B != spec_.sessions.size() || spec_.greedy != greedy) return false;
  for (int64_t b = 0; b < B; ++b) {
    const Session& s = *sessions[b];
    const size_t i = (size_t)b;
    if (counts[b] != 1 || sessions[b] != spec_.sessions[i] || s.serial_ != spec_.serials[i] ||
        s.n_past_ != spec_.n_past[i] || s.kv_->page_ids() != spec_.pages[i] ||
        !s.kv_->writes_in_place(s.n_past_, s.n_past_ + 1))
      return false;
  }
  return true;
}

void Model::drop_spec() {
  if (!spec_.on) return;
  spec_.on = false;
  backend_->drop_deferred();
}

bool Model::can_pipeline(const Session& s) const {
  const char* e = std::getenv("DASLLAMA_PIPELINE");
  if (e && std::strcmp(e, "0") == 0) return false;
  return (backend_->async_steps() || (e && std::strcmp(e, "1") == 0)) && !s.recurrent_state();
}

int64_t Model::forward_greedy(Session& s, const int32_t* token, int32_t* next) {
  if (s.n_past_ + 1 > s.n_ctx_)
    throw ContextOverflowError("context overflow: " + std::to_string(s.n_past_) +
                               " + 1 tokens exceed the session's context of " + std::to_string(s.n_ctx_));
  if (token && (*token < 0 || *token >= cfg_.vocab_size))
    throw Error("token id " + std::to_string(*token) + " out of range [0, " + std::to_string(cfg_.vocab_size) + ")");
  if (!token && !s.greedy_) throw Error("forward_greedy: no id on the backend from an earlier greedy step");
  std::lock_guard<std::mutex> lk(mu_);
  s.kv_->prepare_write(s.n_past_, s.n_past_ + 1);
  if (!s.greedy_) s.greedy_ = backend_->alloc(256 + (size_t)cfg_.vocab_size * 4, "greedy decode");
  int32_t* id = static_cast<int32_t*>(s.greedy_->data());
  struct Reset {
    Model* m;
    ~Reset() { m->dev_ids_ = nullptr, m->greedy_out_ = nullptr, m->logits_dst_ = nullptr; }
  } reset{this};
  dev_ids_ = token ? nullptr : id;
  greedy_out_ = id;
  logits_dst_ = reinterpret_cast<float*>(static_cast<uint8_t*>(s.greedy_->data()) + 256);
  const Run run{&s, 0, 1, true};
  forward_chunk(&run, 1, token, nullptr, 1, false);
  s.history.push_back(token ? *token : -1);
  return backend_->download_async(next, id, 4);
}

void Model::fetch_logits(Session& s) {
  if (!s.greedy_) throw Error("fetch_logits: no greedy step has run on this session");
  const int64_t V = cfg_.vocab_size;
  std::lock_guard<std::mutex> lk(mu_);  // a download between another thread's step brackets would break them
  s.drop_lazy_logits();
  s.logits.resize((size_t)V);
  backend_->download(s.logits.data(), static_cast<uint8_t*>(s.greedy_->data()) + 256, (size_t)V * 4);
}

// The per-layer inputs of a chunk's rows (gemma4 E-series), n x (n_layers x ple_dim) into ple_:
// (norm(proj(x) / sqrt(dim)) + table(token) * sqrt(ple_dim)) / sqrt(2), per layer's slice, from
// the scaled input embeddings x. Embedding rows (media) take the padding token's table row
// (id 0), as llama.cpp does.
void Model::ple_inputs(int64_t n) {
  const ModelConfig& c = cfg_;
  Backend& be = *backend_;
  const int64_t D = c.dim, P = c.ple_dim, W = (int64_t)c.n_layers * P;
  const float* x = static_cast<const float*>(x_->data());
  float* pl = scratch(ple_, n * W, "activations");
  float* tb = scratch(ple_tmp_, n * std::max(W, D), "activations");
  be.matmul(ple_model_proj_, x, n, pl);
  be.scale(pl, 1.f / std::sqrt((float)D), n * W);
  be.rms_norm(pl, ple_proj_norm_.data(), pl, n * c.n_layers, P, c.norm_eps);
  const int32_t* ids = tokens_dev_;
  if (!ids) {
    int32_t* z = reinterpret_cast<int32_t*>(scratch(ple_ids_, n, "step metadata"));
    be.zero(z, (size_t)n * 4);
    ids = z;
  }
  be.get_rows(ple_embd_, ids, n, tb);
  be.scale(tb, std::sqrt((float)P), n * W);
  be.add(pl, tb, n * W);
  be.scale(pl, 1.f / std::sqrt(2.f), n * W);
}

// Norm, QKV, RoPE, the KV store and attention through each session's block table, the
// output projection and the residual add.
RopeParams Model::rope_params(int il) const {
  const ModelConfig& c = cfg_;
  const bool swa = c.layer_is_swa[il];
  RopeParams rp;
  rp.neox = traits_->rope == RopeType::neox;
  rp.n_rot = c.l_n_rot[il];
  rp.freq_factors = swa && traits_->rope_freqs_global_only ? nullptr : rope_freqs_.data();
  rp.inv_freq = rope_inv_freq_ ? static_cast<const double*>(rope_inv_freq_->data()) : nullptr;
  rp.mscale = c.rope_mscale;
  rp.base = swa ? c.rope_base_swa : c.rope_base;
  rp.freq_scale = swa ? c.rope_freq_scale_swa : c.rope_freq_scale;
  return rp;
}

// Run ri's attention at layer il: its queries (rows of q from its first row) against its own
// cache through its block table, out into att's rows.
AttnArgs Model::attn_args(int il, const Run& run, int ri, const float* q, float* att) const {
  const ModelConfig& c = cfg_;
  const Session& s = *run.s;
  const BlockTable& kv = *s.kv_;
  const int64_t hd = c.l_head_dim[il], q_dim = (int64_t)c.n_heads * hd;
  const bool swa = c.layer_is_swa[il];
  AttnArgs a;
  a.kv.base = kv.base();
  a.kv.pages = run_pages_[(size_t)ri];
  a.kv.n_pages = kv.n_pages();
  a.kv.page_shift = kv.page_shift();
  a.kv.page_bytes = kv.page_bytes();
  a.kv.k_off = kv.k_off(c.kv_slot[il]);
  a.kv.v_off = kv.v_off(c.kv_slot[il]);
  a.kv.row_bytes = kv.geometry().row_bytes;
  a.kv.type = s.kv_type_;
  a.q = q + run.first_row * q_dim;
  a.q_stride = q_dim;
  a.n_tok = run.n_rows;
  a.n_kv = s.n_past_ + run.n_rows;
  a.n_heads = c.n_heads;
  a.n_kv_heads = c.l_kv_heads[il];
  a.head_dim = (int)hd;
  a.q_pos = mask_pos_dev_ + run.first_row;
  a.window = swa ? c.sliding_window : 0;
  a.scale = c.attn_scale > 0 ? c.attn_scale : 1.f / std::sqrt((float)hd);
  a.softcap = c.attn_softcap;
  a.sinks = layers_[il].attn_sinks.data();
  a.out = att + run.first_row * q_dim;
  a.out_stride = q_dim;
  a.exact = mode_ == QuantMode::fp32;
  return a;
}

// A one-token decode step of one session through a plain dense layer (pre-norm attention
// with its own K/V, no biases, per-head norms, gates, post norms or sinks; a gate/up GLU FFN)
// goes to the backend whole, where it can fuse it (Backend::decode_layer).
bool Model::decode_layer(int il, const Run* runs, int n_runs, int64_t n) {
  const ModelConfig& c = cfg_;
  const LayerWeights& L = layers_[il];
  if (n != 1 || n_runs != 1 || mrope_step_ || span_pos_hi_ > span_pos_lo_ || deep_chunk_ || c.ple_dim > 0) return false;
  if (c.rec_slot[il] >= 0 || c.kv_src[il] != il || traits_->attn_output_gate || traits_->v_norm) return false;
  if (!L.wqkv.empty() || L.wv.empty() || !L.bq.empty() || !L.bk.empty() || !L.bv.empty() || !L.bo.empty() ||
      !L.q_norm.empty() || !L.k_norm.empty() || !L.attn_post_norm.empty() || !L.attn_sinks.empty() ||
      !L.router.empty() || !L.ffn_pre_norm_2.empty() || !L.ffn_post_norm.empty() || !L.w_gate_up.empty() ||
      L.out_scale != 1.f || L.w_gate.empty() || traits_->act == FfnAct::swiglu_oai)
    return false;
  DecodeLayer d;
  d.x = static_cast<float*>(x_->data());
  d.dim = c.dim;
  d.attn_norm = L.attn_norm.data(), d.ffn_norm = L.ffn_norm.data(), d.eps = c.norm_eps;
  d.wq = &L.wq, d.wk = &L.wk, d.wv = &L.wv, d.wo = &L.wo;
  d.gate = &L.w_gate, d.up = &L.w_up, d.down = &L.w_down;
  d.act = traits_->act == FfnAct::silu ? Act::silu : Act::gelu_tanh;
  d.rope = rope_params(il);
  d.pos = pos_dev_;
  const int64_t hd = c.l_head_dim[il], q_dim = (int64_t)c.n_heads * hd, kv_dim = (int64_t)c.l_kv_heads[il] * hd;
  const int64_t F = c.l_ffn_dim[il];
  d.attn = attn_args(il, runs[0], 0, scratch(q_, q_dim, "activations"), scratch(attn_, q_dim, "activations"));
  d.k = scratch(k_, kv_dim, "activations"), d.v = scratch(v_, kv_dim, "activations");
  d.gate_out = scratch(gate_, 2 * F, "activations"), d.up_out = scratch(up_, F, "activations");
  if (!backend_->decode_layer(d)) return false;
  ++fused_layers_;
  return true;
}

void Model::attention_block(int il, const Run* runs, int n_runs, int64_t n) {
  const ModelConfig& c = cfg_;
  Backend& be = *backend_;
  const LayerWeights& L = layers_[il];
  const bool swa = c.layer_is_swa[il];
  const int64_t D = c.dim, hd = c.l_head_dim[il];
  const int n_kv_heads = c.l_kv_heads[il];
  const int64_t q_dim = (int64_t)c.n_heads * hd, kv_dim = (int64_t)n_kv_heads * hd;
  // A layer that shares an earlier layer's KV (gemma4 E-series) projects only its queries.
  const bool own_kv = c.kv_src[il] == il;
  // An output-gated query projection makes [q | gate] per head: 2 q_dim wide, split below.
  const bool gated = traits_->attn_output_gate;
  const int64_t q_rows = gated ? 2 * q_dim : q_dim;
  float* x = static_cast<float*>(x_->data());
  float* xn = scratch(xn_, n * D, "activations");
  float* q = scratch(q_, n * q_dim, "activations");
  float* k = scratch(k_, n * kv_dim, "activations");
  float* v = scratch(v_, n * kv_dim, "activations");
  float* att = scratch(attn_, n * q_dim, "activations");
  float* o = scratch(ffn_, n * std::max<int64_t>(D, q_rows + 2 * kv_dim), "activations");
  float* qg = gated ? scratch(qgate_, n * (q_rows + q_dim), "activations") : nullptr;  // [q | gate] rows, then the gates
  float* qdst = gated ? qg : q;

  MatmulStep qkv;
  qkv.x = x, qkv.n = n, qkv.xn = xn;
  qkv.norm = true, qkv.norm_w = L.attn_norm.data(), qkv.eps = c.norm_eps;
  if (!own_kv) {
    qkv.count = 1, qkv.w[0] = &L.wq, qkv.y[0] = qdst;
    be.matmul_step(qkv);
    if (!L.bq.empty()) be.add_bias(qdst, L.bq.data(), n, q_rows);
  } else if (!L.wqkv.empty()) {
    qkv.count = 1, qkv.w[0] = &L.wqkv, qkv.y[0] = o;
    be.matmul_step(qkv);
    const int64_t w = q_rows + 2 * kv_dim;
    be.copy_rows(qdst, q_rows, o, w, n, q_rows);
    be.copy_rows(k, kv_dim, o + q_rows, w, n, kv_dim);
    be.copy_rows(v, kv_dim, o + q_rows + kv_dim, w, n, kv_dim);
  } else {
    // No V projection: the values are the keys' projection (before the key norm and rope).
    qkv.count = L.wv.empty() ? 2 : 3;
    qkv.w[0] = &L.wq, qkv.w[1] = &L.wk, qkv.w[2] = &L.wv;
    qkv.y[0] = qdst, qkv.y[1] = k, qkv.y[2] = v;
    be.matmul_step(qkv);
    if (L.wv.empty()) be.copy(v, k, (size_t)(n * kv_dim) * 4);
    if (!L.bq.empty()) be.add_bias(qdst, L.bq.data(), n, q_rows);
    if (!L.bk.empty()) be.add_bias(k, L.bk.data(), n, kv_dim);
    if (!L.bv.empty()) be.add_bias(v, L.bv.data(), n, kv_dim);
  }
  float* gate = gated ? qg + n * q_rows : nullptr;
  if (gated) {  // head h's rows: q at 2 h hd, its gate at (2 h + 1) hd
    be.copy_rows(q, hd, qg, 2 * hd, n * c.n_heads, hd);
    be.copy_rows(gate, hd, qg + hd, 2 * hd, n * c.n_heads, hd);
  }
  if (!L.q_norm.empty()) be.rms_norm(q, L.q_norm.data(), q, n * c.n_heads, hd, c.norm_eps);
  if (!L.k_norm.empty()) be.rms_norm(k, L.k_norm.data(), k, n * n_kv_heads, hd, c.norm_eps);
  if (own_kv && traits_->v_norm) be.rms_norm(v, nullptr, v, n * n_kv_heads, hd, c.norm_eps);
  RopeParams rp = rope_params(il);
  if (mrope_step_) {
    // M-RoPE over image rows: one rope per axis, each turning only its section's pairs (the
    // others' frequency is 0: cos 1, sin 0), at that axis' positions.
    rp.freq_factors = nullptr;  // folded into the tables
    for (int a = 0; a < 3; ++a) {
      rp.inv_freq = static_cast<const double*>(mrope_inv_freq_[a]->data());
      const int32_t* pa = a == 0 ? pos_dev_ : pos_hw_dev_ + (a - 1) * n;
      be.rope(q, n, q_dim, c.n_heads, (int)hd, pa, rp);
      if (own_kv) be.rope(k, n, kv_dim, n_kv_heads, (int)hd, pa, rp);
    }
  } else {
    be.rope(q, n, q_dim, c.n_heads, (int)hd, pos_dev_, rp);
    if (own_kv) be.rope(k, n, kv_dim, n_kv_heads, (int)hd, pos_dev_, rp);
  }

  // Each session's rows write its own cache and attend over it, through its block
  // table; the attentions of all sessions go to the backend together.
  attn_args_.resize((size_t)n_runs);
  for (int ri = 0; ri < n_runs; ++ri) {
    const Session& s = *runs[ri].s;
    const int64_t r0 = runs[ri].first_row, nr = runs[ri].n_rows;
    AttnArgs& a = attn_args_[(size_t)ri];
    a = attn_args(il, runs[ri], ri, q, att);
    if (own_kv) be.kv_store(a.kv, s.n_past_, k + r0 * kv_dim, v + r0 * kv_dim, nr, kv_dim, kv_dim);
  }
  // A sliding layer over a non-causal span that ends at or past the window: a span row at p sees
  // keys (p - window, p] and the whole span, so each row's window reaches back from the span's
  // end by window + (end - p) -- one call per span row (rare: an image deep in a long chat).
  const int64_t M = span_pos_hi_ - 1;
  if (span_window_split(swa, n_runs, M)) {
    const AttnArgs a = attn_args_[0];
    const int64_t p0 = runs[0].s->n_past_;
    const int64_t lo = std::max<int64_t>(span_pos_lo_ - p0, 0), hi = std::min<int64_t>(span_pos_hi_ - p0, a.n_tok);
    attn_args_.clear();
    auto part = [&](int64_t r, int64_t m, int window) {
      if (m <= 0) return;
      AttnArgs b = a;
      b.q = a.q + r * q_dim, b.q_pos = a.q_pos + r, b.out = a.out + r * q_dim, b.n_tok = m, b.window = window;
      attn_args_.push_back(b);
    };
    part(0, lo, a.window);
    for (int64_t r = lo; r < hi; ++r) part(r, 1, (int)(a.window + (M - (p0 + r))));
    part(hi, a.n_tok - hi, a.window);
    be.attention_multi(attn_args_.data(), (int)attn_args_.size());
  } else {
    be.attention_multi(attn_args_.data(), n_runs);
  }
  if (gated) be.glu(gate, q_dim, att, q_dim, att, n, q_dim, Act::sigmoid);

  project_residual(L.wo, L.bo, L.attn_post_norm, att, n, o);
}

// A gated-DeltaNet layer (in place of attention): norm; the qkv, z, alpha and beta projections;
// per session the causal conv (silu) and the gated delta rule from its recurrent state; the
// gated norm (RMS norm per value head times silu(z)); the output projection and residual add.
void Model::recurrent_block(int il, const Run* runs, int n_runs, int64_t n) {
  const ModelConfig& c = cfg_;
  Backend& be = *backend_;
  const LayerWeights& L = layers_[il];
  const int64_t D = c.dim, C = c.ssm_conv_dim, nv = c.ssm_nv, dk = c.ssm_dk, inner = nv * c.ssm_dv;
  const int K = c.ssm_conv_k;
  float* x = static_cast<float*>(x_->data());
  float* xn = scratch(xn_, n * D, "activations");
  float* proj = scratch(ssm_x_, n * 2 * C, "activations");  // the qkv projection, then the conv's output
  float* conv = proj + n * C;
  float* zo = scratch(ssm_o_, n * 2 * inner, "activations");  // z, then the delta rule's output
  float* out = zo + n * inner;
  float* ab = scratch(ssm_ab_, n * 4 * nv, "activations");    // alpha, then beta logits (then ssm_ba's rows)
  float* o = scratch(ffn_, n * D, "activations");
  be.rms_norm(x, L.attn_norm.data(), xn, n, D, c.norm_eps);
  if (L.ssm_ba.empty()) {
    const Weight* ws[4] = {&L.ssm_qkv, &L.ssm_z, &L.ssm_alpha, &L.ssm_beta};
    float* ys[4] = {proj, zo, ab, ab + n * nv};
    be.matmul_multi(ws, ys, 4, xn, n);
  } else {
    // Per key head [beta (r) | alpha (r)], r = nv / nk: de-interleaved into the alpha and beta rows.
    const Weight* ws[3] = {&L.ssm_qkv, &L.ssm_z, &L.ssm_ba};
    float* ba = ab + 2 * n * nv;
    float* ys[3] = {proj, zo, ba};
    be.matmul_multi(ws, ys, 3, xn, n);
    const int64_t r = nv / c.ssm_nk;
    be.copy_rows(ab + n * nv, r, ba, 2 * r, n * c.ssm_nk, r);
    be.copy_rows(ab, r, ba + r, 2 * r, n * c.ssm_nk, r);
  }
  for (int ri = 0; ri < n_runs; ++ri) {
    const int64_t r0 = runs[ri].first_row, nr = runs[ri].n_rows;
    float* st = runs[ri].s->recurrent_state() + (int64_t)c.rec_slot[il] * c.rec_state_floats;
    be.conv1d_causal(st, proj + r0 * C, C, nr, C, L.ssm_conv.data(), K, true, conv + r0 * C);
    DeltaRuleArgs a;
    a.state = st + (int64_t)(K - 1) * C;
    a.q = conv + r0 * C;
    a.k = a.q + (int64_t)c.ssm_nk * dk;
    a.v = a.q + 2 * (int64_t)c.ssm_nk * dk;
    a.qkv_stride = C;
    a.alpha = ab + r0 * nv;
    a.beta = ab + n * nv + r0 * nv;
    a.ab_stride = nv;
    a.A = L.ssm_a.data();
    a.dt_bias = L.ssm_dt.data();
    a.n = nr;
    a.n_k_heads = c.ssm_nk, a.n_v_heads = c.ssm_nv, a.dk = c.ssm_dk, a.dv = c.ssm_dv;
    a.grouped = traits_->ssm_v_grouped;
    // A run of a whole chunk or more (a prefill) takes the chunked form; shorter runs (decode,
    // short prompts and tails) go token by token, so they match decode steps bitwise.
    a.chunked = nr >= kDeltaChunk;
    a.out = out + r0 * inner;
    a.out_stride = inner;
    be.delta_rule(a);
  }
  be.rms_norm(out, L.ssm_norm.data(), out, n * nv, c.ssm_dv, c.norm_eps);
  be.glu(zo, inner, out, inner, out, n, inner, Act::silu);
  project_residual(L.ssm_out, Vec{}, Vec{}, out, n, o);
}

// x += W in (+ bias, through a post-norm when the family has them), x the residual
// stream; `o` is scratch for the projection.
void Model::project_residual(const Weight& w, const Vec& bias, const Vec& post_norm, const float* in, int64_t n,
                             float* o) {
  Backend& be = *backend_;
  float* x = static_cast<float*>(x_->data());
  if (!post_norm.empty() || !bias.empty()) {
    be.matmul(w, in, n, o);
    if (!bias.empty()) be.add_bias(o, bias.data(), n, cfg_.dim);
    if (!post_norm.empty()) be.rms_norm(o, post_norm.data(), o, n, cfg_.dim, cfg_.norm_eps);
    be.add(x, o, n * cfg_.dim);
    return;
  }
  MatmulStep st;
  st.x = in, st.n = n, st.count = 1, st.w[0] = &w, st.y[0] = o, st.residual = x;
  be.matmul_step(st);
}

// Norm, gate and up (or phi3's fused gate|up), the GLU, down, the residual add.
void Model::ffn_block(int il, int64_t n) {
  const ModelConfig& c = cfg_;
  Backend& be = *backend_;
  const LayerWeights& L = layers_[il];
  const int64_t D = c.dim, F = c.l_ffn_dim[il];
  const Act act = traits_->act == FfnAct::silu ? Act::silu : traits_->act == FfnAct::gelu_tanh ? Act::gelu_tanh : Act::swiglu_oai;
  float* x = static_cast<float*>(x_->data());
  float* xn = static_cast<float*>(xn_->data());
  float* o = static_cast<float*>(ffn_->data());
  float* gate = scratch(gate_, n * 2 * F, "activations");
  float* up = scratch(up_, n * F, "activations");
  if (!L.ffn_pre_norm_2.empty()) {
    parallel_moe_ffn(il, n);
    return;
  }
  if (!L.router.empty()) {  // a mixture of experts reads the normed rows (xn) itself
    be.rms_norm(x, L.ffn_norm.data(), xn, n, D, c.norm_eps);
    moe_block(il, n);
    if (!L.ffn_post_norm.empty()) be.rms_norm(o, L.ffn_post_norm.data(), o, n, D, c.norm_eps);
    be.add(x, o, n * D);
    return;
  }
  MatmulStep gu;
  gu.x = x, gu.n = n, gu.xn = xn;
  gu.norm = true, gu.norm_w = L.ffn_norm.data(), gu.eps = c.norm_eps;
  if (!L.w_gate_up.empty()) {
    gu.count = 1, gu.w[0] = &L.w_gate_up, gu.y[0] = gate;
    be.matmul_step(gu);
    be.glu(gate, 2 * F, gate + F, 2 * F, up, n, F, act);
  } else {
    gu.count = 2, gu.w[0] = &L.w_gate, gu.w[1] = &L.w_up, gu.y[0] = gate, gu.y[1] = up;
    be.matmul_step(gu);
    be.glu(gate, F, up, F, up, n, F, act);
  }
  project_residual(L.w_down, Vec{}, L.ffn_post_norm, up, n, o);
}

// A mixture-of-experts FFN over the normed rows xn, into ffn_: the router's logits, the k
// experts of each token (ids and weights stay on the backend), each picked expert's GLU through
// matmul_id (an expert's weights read once per step for all the tokens routed to it), the
// weighted sum; then a shared expert, when the layer has one, scaled by its sigmoid gate.
void Model::moe_block(int il, int64_t n) {
  const ModelConfig& c = cfg_;
  Backend& be = *backend_;
  const LayerWeights& L = layers_[il];
  const int64_t D = c.dim, E = c.n_expert, F = c.expert_ffn_dim;
  const int k = c.n_expert_used;
  const int64_t P = n * k;
  const Act act = traits_->act == FfnAct::silu ? Act::silu : traits_->act == FfnAct::gelu_tanh ? Act::gelu_tanh : Act::swiglu_oai;
  const float* xn = static_cast<const float*>(xn_->data());
  float* o = static_cast<float*>(ffn_->data());
  float* lg = scratch(moe_logits_, n * E + n, "activations");
  int32_t* ids = reinterpret_cast<int32_t*>(scratch(moe_ids_, P + n, "activations"));
  float* w = scratch(moe_w_, P + n, "activations");
  float* gate = scratch(gate_, P * F, "activations");
  float* up = scratch(up_, P * F, "activations");
  float* yd = scratch(moe_y_, P * D, "activations");
  be.matmul(L.router, xn, n, lg);
  if (!L.router_b.empty()) be.add_bias(lg, L.router_b.data(), n, E);
  be.moe_route(lg, n, (int)E, k, traits_->moe_gate, c.moe_norm_topk, ids, w);
  be.matmul_id(L.gate_exps, xn, k, ids, P, L.gate_exps_b.data(), gate);
  be.matmul_id(L.up_exps, xn, k, ids, P, L.up_exps_b.data(), up);
  be.glu(gate, F, up, F, up, P, F, act);
  be.matmul_id(L.down_exps, up, 1, ids, P, L.down_exps_b.data(), yd);
  be.moe_sum(yd, w, n, k, D, o);
  if (L.gate_shexp.empty()) return;
  const int64_t Fs = c.shexp_ffn_dim;
  float* sh = scratch(moe_sh_, n * (2 * Fs + 2 * D), "activations");
  float* sg = sh, *su = sh + n * Fs, *sd = sh + 2 * n * Fs, *so = sd + n * D;
  const Weight* ws[2] = {&L.gate_shexp, &L.up_shexp};
  float* ys[2] = {sg, su};
  be.matmul_multi(ws, ys, 2, xn, n);
  be.glu(sg, Fs, su, Fs, su, n, Fs, act);
  be.matmul(L.down_shexp, su, n, sd);
  // The gate's logit through moe_route as one expert of one: sigmoid(logit) as its weight.
  be.matmul(L.router_shexp, xn, n, lg + n * E);
  be.moe_route(lg + n * E, n, 1, 1, MoeGate::sigmoid, false, ids + P, w + P);
  be.moe_sum(sd, w + P, n, 1, D, so);
  be.add(o, so, n * D);
}

// gemma4's MoE layer: a dense MLP and the experts side by side on the residual x, each through its
// own norms, summed, post-normed and added. The router reads x normed by its own weight; the k
// weights (softmax, renormalized) take a per-expert scale; the experts' gate and up are one stack.
void Model::parallel_moe_ffn(int il, int64_t n) {
  const ModelConfig& c = cfg_;
  Backend& be = *backend_;
  const LayerWeights& L = layers_[il];
  const int64_t D = c.dim, Fd = c.l_ffn_dim[il], E = c.n_expert, F = c.expert_ffn_dim;
  const int k = c.n_expert_used;
  const int64_t P = n * k;
  const Act act = traits_->act == FfnAct::silu ? Act::silu : traits_->act == FfnAct::gelu_tanh ? Act::gelu_tanh : Act::swiglu_oai;
  float* x = static_cast<float*>(x_->data());
  float* xn = static_cast<float*>(xn_->data());
  float* o = static_cast<float*>(ffn_->data());
  // The dense MLP, into o.
  float* gate = scratch(gate_, std::max(n * Fd, P * 2 * F), "activations");
  float* up = scratch(up_, std::max(n * Fd, P * F), "activations");
  MatmulStep gu;
  gu.x = x, gu.n = n, gu.xn = xn;
  gu.norm = true, gu.norm_w = L.ffn_norm.data(), gu.eps = c.norm_eps;
  gu.count = 2, gu.w[0] = &L.w_gate, gu.w[1] = &L.w_up, gu.y[0] = gate, gu.y[1] = up;
  be.matmul_step(gu);
  be.glu(gate, Fd, up, Fd, up, n, Fd, act);
  be.matmul(L.w_down, up, n, o);
  be.rms_norm(o, L.ffn_post_norm_1.data(), o, n, D, c.norm_eps);
  // The experts, into o2.
  float* lg = scratch(moe_logits_, n * E, "activations");
  int32_t* ids = reinterpret_cast<int32_t*>(scratch(moe_ids_, P, "activations"));
  float* w = scratch(moe_w_, 3 * P, "activations");
  float* yd = scratch(moe_y_, P * D, "activations");
  float* r = scratch(moe_x_, 2 * n * D, "activations");
  float* o2 = r + n * D;
  be.rms_norm(x, L.router_in_norm.empty() ? nullptr : L.router_in_norm.data(), r, n, D, c.norm_eps);
  be.matmul(L.router, r, n, lg);
  be.moe_route(lg, n, (int)E, k, traits_->moe_gate, c.moe_norm_topk, ids, w);
  if (!L.exp_scale.empty()) {
    // w[p] * scale[ids[p]]: the scales gathered by expert id, then moe_sum as an elementwise
    // product (P rows of one pair of width 1), into its own buffer (no op here writes its input).
    float* sc = w + P;
    be.get_rows(L.exp_scale, ids, P, sc);
    be.moe_sum(sc, w, P, 1, 1, w + 2 * P);
    w += 2 * P;
  }
  be.rms_norm(x, L.ffn_pre_norm_2.data(), xn, n, D, c.norm_eps);
  if (!L.gate_up_exps.empty()) {
    be.matmul_id(L.gate_up_exps, xn, k, ids, P, nullptr, gate);  // per pair [gate | up], 2F wide
    be.glu(gate, 2 * F, gate + F, 2 * F, up, P, F, act);
  } else {
    be.matmul_id(L.gate_exps, xn, k, ids, P, nullptr, gate);
    be.matmul_id(L.up_exps, xn, k, ids, P, nullptr, up);
    be.glu(gate, F, up, F, up, P, F, act);
  }
  be.matmul_id(L.down_exps, up, 1, ids, P, nullptr, yd);
  be.moe_sum(yd, w, n, k, D, o2);
  be.rms_norm(o2, L.ffn_post_norm_2.data(), o2, n, D, c.norm_eps);
  be.add(o, o2, n * D);
  if (!L.ffn_post_norm.empty()) be.rms_norm(o, L.ffn_post_norm.data(), o, n, D, c.norm_eps);
  be.add(x, o, n * D);
}

// Final norm and logits: of every row, or of the last row of each run that wants them.
int64_t Model::logits_block(const Run* runs, int n_runs, int64_t n, bool all_logits) {
  const ModelConfig& c = cfg_;
  Backend& be = *backend_;
  const int64_t D = c.dim;
  const float* x = static_cast<const float*>(x_->data());
  float* xn = static_cast<float*>(xn_->data());
  int64_t rows = 0;
  if (all_logits) {
    rows = n;
    be.rms_norm(x, output_norm_.data(), xn, n, D, c.norm_eps);
  } else {
    // The runs' last rows, normed one launch per stretch of adjacent rows (a batch of decode
    // runs is one stretch): a row's norm does not depend on the rows beside it.
    int64_t src = 0, dst = 0, len = 0;
    auto norm = [&] {
      if (len > 0) be.rms_norm(x + src * D, output_norm_.data(), xn + dst * D, len, D, c.norm_eps);
      len = 0;
    };
    for (int ri = 0; ri < n_runs; ++ri) {
      if (!runs[ri].want_logits) continue;
      const int64_t last = runs[ri].first_row + runs[ri].n_rows - 1;
      if (len == 0 || last != src + len) norm(), src = last, dst = rows;
      ++len, ++rows;
    }
    norm();
  }
  if (rows == 0) return 0;  // a run that continues in the next chunk wants no logits yet
  float* lg = logits_dst_ ? logits_dst_ : scratch(logits_, rows * c.vocab_size, "logits");
  // (greedy_out_: the greedy steps' device argmax reads whole rows, so never in parts)
  if (!greedy_out_ && be.matmul_logits(output_, xn, rows, lg, c.final_softcap)) {
    ++parted_logits_;
  } else {
    be.matmul(output_, xn, rows, lg);
    if (c.final_softcap > 0) be.softcap(lg, c.final_softcap, rows * c.vocab_size);
  }
  return rows;
}

}  // namespace dl
