// Sessions: their KV block table (flat or paged), rewinding, releasing pages, and
// the glue between a session and the prefix cache (attach before prefill, donate after).
#include <algorithm>
#include <atomic>

#include "core/errors.h"
#include "kv/prefix_cache.h"
#include "model/model.h"
#include "model/session.h"

namespace dl {

KVGeometry Model::kv_geometry(KVType t) const {
  KVGeometry g;
  g.n_layers = cfg_.n_kv_layers;  // recurrent layers keep no KV
  // One row width for every cached layer: the widest (gemma4's global and sliding layers differ;
  // a narrower layer uses the front of its rows).
  g.kv_dim = 0;
  bool q8_ok = true;
  for (int il = 0; il < cfg_.n_layers; ++il) {
    if (cfg_.kv_slot[il] < 0 || cfg_.kv_src[il] != il) continue;
    const int64_t d = (int64_t)cfg_.l_kv_heads[il] * cfg_.l_head_dim[il];
    g.kv_dim = std::max(g.kv_dim, d);
    q8_ok = q8_ok && d % 32 == 0 && cfg_.l_head_dim[il] % 32 == 0;
  }
  if (g.kv_dim == 0) g.kv_dim = (int64_t)cfg_.n_kv_heads * cfg_.head_dim;  // no attention layer
  g.type = t;
  if (t == KVType::q8_0 && !q8_ok) throw Error("q8_0 KV needs head_size and kv_dim to be multiples of 32");
  g.row_bytes = kv_row_bytes(t, g.kv_dim);
  return g;
}

uint64_t Session::next_serial() {
  static std::atomic<uint64_t> n{0};
  return ++n;
}

Session::Session(std::shared_ptr<Model> model, KVType kv_type, int n_ctx)
    : model_(std::move(model)), kv_type_(kv_type) {
  const ModelConfig& c = model_->config();
  n_ctx_ = n_ctx > 0 ? std::min(n_ctx, c.seq_len) : std::min(c.seq_len, 4096);
  kv_ = std::make_unique<BlockTable>(model_->kv_geometry(kv_type), n_ctx_, model_->backend());
  init_recurrent();
}

void Session::init_recurrent() {
  const ModelConfig& c = model_->config();
  if (c.n_rec_layers == 0) return;
  rstate_ = model_->backend().alloc((size_t)c.n_rec_layers * (size_t)c.rec_state_floats * 4, "recurrent state");
  reset_recurrent();
}

void Session::reset_recurrent() {
  if (rstate_) model_->state_copy(rstate_->data(), nullptr, rstate_->size());
  snaps_.clear();
}

// Called by the model inside a forward (its lock held).
void Session::snapshot() {
  if (!rstate_ || (!snaps_.empty() && snaps_.back().first == n_past_)) return;
  for (auto& sn : snaps_)
    if (sn.first > n_past_) throw Error("snapshot: a later snapshot is still held (internal)");
  BufferPtr buf;
  if ((int)snaps_.size() >= kMaxSnapshots) {
    // The oldest goes; its buffer is reused unless the prefix cache holds it too.
    if (snaps_.front().second.use_count() == 1) buf = snaps_.front().second;
    snaps_.erase(snaps_.begin());
  }
  if (!buf) buf = model_->backend().alloc(rstate_->size(), "recurrent state snapshot");
  model_->backend().copy(buf->data(), rstate_->data(), rstate_->size());
  snaps_.emplace_back(n_past_, std::move(buf));
}

int64_t Session::rewind_point(int64_t n) const {
  if (n < 0 || n > n_past_) throw Error("rewind_point: position out of range");
  if (!rstate_ || n == n_past_) return n;
  int64_t best = 0;
  for (const auto& sn : snaps_)
    if (sn.first <= n) best = std::max(best, sn.first);
  return best;
}

Session::Session(std::shared_ptr<Model> model, std::shared_ptr<KVPool> pool, int n_ctx) : model_(std::move(model)) {
  if (!pool) throw Error("create_session: no pool");
  const KVGeometry g = model_->kv_geometry(pool->geometry().type);
  if (g.n_layers != pool->geometry().n_layers || g.row_bytes != pool->geometry().row_bytes)
    throw Error("create_session: the pool was made for another cache geometry");
  if (&pool->backend() != &model_->backend())
    throw Error("create_session: the pool lives on another backend than the model (create it from this model)");
  kv_type_ = g.type;
  const ModelConfig& c = model_->config();
  n_ctx_ = n_ctx > 0 ? std::min(n_ctx, c.seq_len) : c.seq_len;  // memory comes page by page
  kv_ = std::make_unique<BlockTable>(std::move(pool));
  init_recurrent();
}

void Session::truncate(int64_t n) {
  if (n < 0 || n > n_past_) throw Error("truncate: position out of range");
  if (rewind_point(n) != n)
    throw Error("truncate: this model's recurrent layers cannot rewind to position " + std::to_string(n) +
                " (their state is kept at position " + std::to_string(n_past_) +
                " and at 0; rewind_point(n) says where they can go)");
  if (rstate_ && n == 0) {
    reset_recurrent();
  } else if (rstate_ && n < n_past_) {
    for (const auto& sn : snaps_)
      if (sn.first == n) model_->state_copy(rstate_->data(), sn.second->data(), rstate_->size());
  }
  if (rstate_)
    while (!snaps_.empty() && snaps_.back().first > n) snaps_.pop_back();
  n_past_ = n;
  history.resize((size_t)n);
  while (!rope_marks.empty() && rope_marks.back().first > n) rope_marks.pop_back();
  // Pages past n go back; a shared page n falls in is copied on the next write.
  kv_->truncate(n);
}

void Session::release_pages() {
  if (!kv_->paged()) return;  // a flat session owns its cache: nothing to give back
  kv_->release();
  reset_recurrent();
  n_past_ = 0;
  history.clear();
  rope_marks.clear();
  logits.clear();
  drop_lazy_logits();
}

int64_t prefix_attach(PrefixCache& cache, Session& s, const std::vector<int32_t>& prompt) {
  if (!s.kv().paged()) throw Error("prefix_attach: the session is not paged (create it over a pool)");
  cache.bind(s.kv().pool_ptr());
  if (s.n_past() != 0 || s.kv().n_pages() != 0) throw Error("prefix_attach: the session is not fresh");
  if ((int64_t)prompt.size() > s.n_ctx()) throw ContextOverflowError("prefix_attach: prompt longer than the context");
  KVPool& pool = *s.kv().pool();
  std::vector<int32_t> pages;
  int64_t matched = 0;
  // Pages alone do not hold a recurrent layer's state: a hybrid attaches only up to a page
  // that carries a snapshot of it, and restores that.
  BufferPtr state;
  const bool hybrid = s.recurrent_state() != nullptr;
  {
    std::lock_guard<std::mutex> lk(pool.mu());
    std::tie(pages, matched) =
        cache.match_locked(prompt.data(), (int64_t)prompt.size(), hybrid ? &state : nullptr);
    // Referenced before the lock is let go, so no eviction can take them.
    for (int32_t id : pages) pool.incref_locked(id);
  }
  if (matched == 0) return 0;
  s.kv().adopt_referenced(pages);
  s.set_attached(matched, prompt.data());
  if (hybrid) {
    s.model().state_copy(s.rstate_->data(), state->data(), s.rstate_->size());
    s.snaps_.assign(1, {matched, state});  // shared with the cache, never written
  }
  return matched;
}

void Session::set_attached(int64_t n, const int32_t* ids) {
  n_past_ = n;
  history.assign(ids, ids + n);
  rope_marks.clear();
  logits.clear();
  drop_lazy_logits();
}

void prefix_insert(PrefixCache& cache, Session& s, const std::vector<int32_t>& tokens, const std::string& preview) {
  if (!s.kv().paged()) throw Error("prefix_insert: the session is not paged (create it over a pool)");
  cache.bind(s.kv().pool_ptr());
  const int64_t n = std::min<int64_t>((int64_t)tokens.size(), s.n_past());
  // Donated pages must hold what the ids say: the ids are checked against what was evaluated.
  for (int64_t i = 0; i < n; ++i)
    if (tokens[(size_t)i] != s.history[(size_t)i])
      throw Error("prefix_insert: tokens differ from the session's evaluated history at position " +
                  std::to_string(i));
  KVPool& pool = *s.kv().pool();
  std::lock_guard<std::mutex> lk(pool.mu());
  cache.insert_locked(tokens.data(), n, s.kv().page_ids(), preview, &s.snapshots());
}

}  // namespace dl
