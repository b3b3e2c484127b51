// The prefix cache: chained page keys, verified hits, LRU eviction of unreferenced leaves.
#include "kv/prefix_cache.h"

#include <algorithm>

#include "core/errors.h"

namespace dl {

namespace {
constexpr uint64_t kRootKey = 0x9E3779B97F4A7C15ull;

inline uint64_t mix(uint64_t x) {  // splitmix64's finalizer
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBull;
  x ^= x >> 31;
  return x;
}
}  // namespace

uint64_t prefix_page_key(uint64_t prev, const int32_t* ids, int64_t n) {
  uint64_t h = mix(prev ^ 0xD6E8FEB86659FD93ull);
  for (int64_t i = 0; i < n; ++i) h = mix(h + (uint64_t)(uint32_t)ids[i] + 0x9E3779B97F4A7C15ull);
  return mix(h ^ (uint64_t)n);
}

PrefixCache::~PrefixCache() {
  if (!pool_) return;
  std::lock_guard<std::mutex> lk(pool_->mu());
  for (auto& kv : map_) {
    pool_->set_cached_locked(kv.second.page, false);
    pool_->decref_locked(kv.second.page);
  }
  if (pool_->cache_locked() == this) pool_->bind_cache_locked(nullptr);
}

void PrefixCache::bind(const std::shared_ptr<KVPool>& pool) {
  if (!pool) throw Error("prefix cache: no pool");
  if (pool_ && pool_ != pool) throw Error("this prefix cache serves another KV pool");
  std::lock_guard<std::mutex> lk(pool->mu());
  if (pool->cache_locked() && pool->cache_locked() != this)
    throw Error("this KV pool already has another prefix cache");
  pool->bind_cache_locked(this);
  pool_ = pool;
}

std::pair<std::vector<int32_t>, int64_t> PrefixCache::match_locked(const int32_t* ids, int64_t n, BufferPtr* state) {
  const int64_t P = pool_->page_rows();
  std::vector<int32_t> pages;
  uint64_t key = kRootKey;
  int64_t deepest_chain = -1;
  size_t with_state = 0;  // pages up to the deepest one carrying a snapshot (state matches)
  BufferPtr found;
  // Full pages of the prompt only; the cap below may leave the last one partly used.
  for (int64_t p = 0; (p + 1) * P <= n; ++p) {
    const int32_t* pid = ids + p * P;
    const uint64_t k = prefix_page_key(key, pid, P);
    auto it = map_.find(k);
    // A hash hit is only a hit when the ids are the same and the chain links up.
    if (it == map_.end() || it->second.parent != key || (int64_t)it->second.ids.size() != P ||
        !std::equal(pid, pid + P, it->second.ids.begin()))
      break;
    pages.push_back(it->second.page);
    deepest_chain = it->second.chain;
    key = k;
    // A snapshot counts only where a row is left to prefill after it.
    if (state && it->second.state && (p + 1) * P <= n - 1) with_state = pages.size(), found = it->second.state;
  }
  if (state) {
    pages.resize(with_state);
    *state = found;
  }
  // Past the whole pages: a cached page (or donated partial page) whose first ids the prompt
  // shares, when that shared part holds a media row. A media row cannot be prefilled again
  // without its encoder's output, and an image ends mid-page as often as not; text rows just
  // prefill. Not for a recurrent state, which is kept only at page ends.
  const int64_t full = (int64_t)pages.size();
  int64_t part = 0;
  Entry* part_e = nullptr;
  if (!state && full * P < n - 1) {
    const int32_t* rest = ids + full * P;
    const int64_t m = std::min<int64_t>(P, n - full * P);
    for (auto& kv : map_) {
      Entry& e = kv.second;
      if (e.parent != key || e.depth != (int32_t)full) continue;
      const int64_t lim = std::min<int64_t>(m, (int64_t)e.ids.size());
      int64_t c = 0;
      while (c < lim && rest[c] == e.ids[(size_t)c]) ++c;
      if (c > part) part = c, part_e = &e;
    }
    if (part_e && std::none_of(rest, rest + part, [](int32_t t) { return t < 0; })) part = 0, part_e = nullptr;
  }
  if (pages.empty() && !part_e) return {pages, 0};
  ++tick_;
  if (part_e) {
    pages.push_back(part_e->page);
    part_e->last_used = tick_;
    deepest_chain = part_e->chain;
  }
  // Touch the matched path so its pages are the most recently used.
  key = kRootKey;
  for (size_t p = 0; p < (size_t)full; ++p) {
    key = prefix_page_key(key, ids + (int64_t)p * P, P);
    map_[key].last_used = tick_;
  }
  if (deepest_chain >= 0 && deepest_chain < (int64_t)chains_.size()) {
    ++chains_[(size_t)deepest_chain].hits;
    chains_[(size_t)deepest_chain].last_hit = tick_;
  }
  const int64_t matched = std::min<int64_t>(full * P + part, n - 1);
  // The cap may leave the last page unused: then it is not attached at all.
  pages.resize((size_t)((matched + P - 1) / P));
  return {pages, matched};
}

void PrefixCache::insert_locked(const int32_t* ids, int64_t n, const std::vector<int32_t>& page_ids,
                                const std::string& preview, const std::vector<StateAt>* states) {
  const int64_t P = pool_->page_rows();
  const int64_t full = std::min<int64_t>(n / P, (int64_t)page_ids.size());
  // The last, partly filled page goes in too when it holds a media row (match_locked's partial
  // hit); the session copies it before its next write there, as for any shared page.
  const int64_t tail = n - full * P;
  const int32_t* tid = ids + full * P;
  const bool donate_tail = tail > 0 && full < (int64_t)page_ids.size() && (!states || states->empty()) &&
                           std::any_of(tid, tid + tail, [](int32_t t) { return t < -1; }) &&
                           std::find(tid, tid + tail, -1) == tid + tail;
  if (full <= 0 && !donate_tail) return;
  ++tick_;
  Chain ch;
  ch.born = tick_;
  ch.preview = preview;
  const int64_t chain_id = (int64_t)chains_.size();
  uint64_t key = kRootKey;
  int64_t done = 0;  // whole pages in the chain
  for (int64_t p = 0; p < full; ++p) {
    const int32_t* pid = ids + p * P;
    // An anonymous embedding row (-1: no content key) cannot be matched again.
    if (std::find(pid, pid + P, -1) != pid + P) break;
    const uint64_t k = prefix_page_key(key, pid, P);
    auto it = map_.find(k);
    if (it != map_.end()) {
      // Already cached (this session attached it, or another donated the same
      // ids); a key with other ids is a hash collision: stop the chain there.
      if (it->second.parent != key || (int64_t)it->second.ids.size() != P ||
          !std::equal(pid, pid + P, it->second.ids.begin()))
        break;
      it->second.last_used = tick_;
    } else {
      Entry e;
      e.parent = key;
      e.page = page_ids[(size_t)p];
      e.depth = (int32_t)p;
      e.chain = chain_id;
      e.last_used = tick_;
      e.ids.assign(pid, pid + P);
      if (pool_->cached_locked(e.page)) break;  // the same page under another key: never twice
      pool_->incref_locked(e.page);
      pool_->set_cached_locked(e.page, true);
      if (p > 0) ++map_[key].children;
      map_.emplace(k, std::move(e));
      drop_covered_partials_locked(key, (int32_t)p, pid, P, k);
    }
    if (states) {
      Entry& e = map_[k];
      for (const StateAt& st : *states)
        if (st.first == (p + 1) * P && st.second && !e.state) e.state = st.second;
    }
    ch.keys.push_back(k);
    key = k;
    done = p + 1;
  }
  if (donate_tail && done == full) {
    const uint64_t k = prefix_page_key(key, tid, tail);
    auto it = map_.find(k);
    const int32_t page = page_ids[(size_t)full];
    if (it != map_.end()) {
      const Entry& e = it->second;
      if (e.parent == key && e.ids.size() == (size_t)tail && std::equal(tid, tid + tail, e.ids.begin())) {
        it->second.last_used = tick_;
        ch.keys.push_back(k);
      }
    } else if (!pool_->cached_locked(page) && !covered_locked(key, (int32_t)full, tid, tail)) {
      Entry e;
      e.parent = key;
      e.page = page;
      e.depth = (int32_t)full;
      e.chain = chain_id;
      e.last_used = tick_;
      e.ids.assign(tid, tid + tail);
      pool_->incref_locked(page);
      pool_->set_cached_locked(page, true);
      if (full > 0) ++map_[key].children;
      map_.emplace(k, std::move(e));
      ++partials_;
      drop_covered_partials_locked(key, (int32_t)full, tid, tail, k);
      ch.keys.push_back(k);
    }
  }
  if (!ch.keys.empty()) chains_.push_back(std::move(ch));
  // Donation records whose pages are all gone say nothing any more.
  if (chains_.size() > 64 && chains_.size() > 2 * map_.size()) {
    std::vector<Chain> keep;
    // Entry.chain indexes chains_, so renumber as records go.
    std::vector<int64_t> renum(chains_.size(), -1);
    for (size_t i = 0; i < chains_.size(); ++i) {
      bool live = false;
      for (uint64_t k : chains_[i].keys) live = live || map_.count(k);
      if (live) {
        renum[i] = (int64_t)keep.size();
        keep.push_back(std::move(chains_[i]));
      }
    }
    for (auto& kv : map_) kv.second.chain = kv.second.chain >= 0 ? renum[(size_t)kv.second.chain] : -1;
    chains_ = std::move(keep);
  }
  enforce_budget_locked();
  enforce_states_locked();
}

bool PrefixCache::covered_locked(uint64_t parent, int32_t depth, const int32_t* ids, int64_t m) const {
  for (const auto& kv : map_) {
    const Entry& e = kv.second;
    if (e.parent == parent && e.depth == depth && (int64_t)e.ids.size() >= m &&
        std::equal(ids, ids + m, e.ids.begin()))
      return true;
  }
  return false;
}

void PrefixCache::drop_covered_partials_locked(uint64_t parent, int32_t depth, const int32_t* ids, int64_t m,
                                               uint64_t except) {
  // A partial page whose ids start the new page's is never the better hit: it goes once
  // nobody but the cache holds it.
  if (partials_ == 0) return;
  const int64_t P = pool_->page_rows();
  for (auto it = map_.begin(); it != map_.end();) {
    const Entry& e = it->second;
    auto next = std::next(it);
    if (it->first != except && (int64_t)e.ids.size() < P && (int64_t)e.ids.size() <= m && e.parent == parent &&
        e.depth == depth && e.children == 0 && pool_->refcount(e.page) == 1 &&
        std::equal(e.ids.begin(), e.ids.end(), ids))
      drop_locked(it);
    it = next;
  }
}

void PrefixCache::enforce_states_locked() {
  int64_t held = 0;
  for (auto& kv : map_) held += kv.second.state != nullptr;
  while (held > std::max<int64_t>(max_states_, 0)) {
    Entry* oldest = nullptr;
    for (auto& kv : map_)
      if (kv.second.state && (!oldest || kv.second.last_used < oldest->last_used)) oldest = &kv.second;
    oldest->state.reset();
    --held;
  }
}

int64_t PrefixCache::states_held() const {
  if (!pool_) return 0;
  std::lock_guard<std::mutex> lk(pool_->mu());
  int64_t held = 0;
  for (auto& kv : map_) held += kv.second.state != nullptr;
  return held;
}

void PrefixCache::drop_locked(std::unordered_map<uint64_t, Entry>::iterator it) {
  const Entry& e = it->second;
  if (e.depth > 0) {
    auto par = map_.find(e.parent);
    if (par != map_.end()) --par->second.children;
  }
  if ((int64_t)e.ids.size() < pool_->page_rows()) --partials_;
  pool_->set_cached_locked(e.page, false);
  pool_->decref_locked(e.page);
  map_.erase(it);
}

bool PrefixCache::evict_one_locked() {
  // Only leaves go (a missing inner page would strand the pages after it), and
  // only pages nobody but the cache holds: evicting never frees a referenced page.
  auto best = map_.end();
  for (auto it = map_.begin(); it != map_.end(); ++it) {
    const Entry& e = it->second;
    if (e.children > 0 || pool_->refcount(e.page) != 1) continue;
    if (best == map_.end() || e.last_used < best->second.last_used ||
        (e.last_used == best->second.last_used && e.depth > best->second.depth))
      best = it;
  }
  if (best == map_.end()) return false;
  drop_locked(best);
  return true;
}

void PrefixCache::enforce_budget_locked() {
  if (max_groups_ <= 0) return;
  while ((int64_t)map_.size() > max_groups_ && evict_one_locked()) {
  }
}

void PrefixCache::release() {
  if (!pool_) return;
  std::lock_guard<std::mutex> lk(pool_->mu());
  for (auto& kv : map_) {
    pool_->set_cached_locked(kv.second.page, false);
    pool_->decref_locked(kv.second.page);
  }
  map_.clear();
  chains_.clear();
  partials_ = 0;
}

int64_t PrefixCache::held() const {
  if (!pool_) return 0;
  std::lock_guard<std::mutex> lk(pool_->mu());
  return (int64_t)map_.size();
}

std::vector<PrefixChainInfo> PrefixCache::chains() const {
  std::vector<PrefixChainInfo> out;
  if (!pool_) return out;
  std::lock_guard<std::mutex> lk(pool_->mu());
  const int64_t P = pool_->page_rows();
  for (const Chain& c : chains_) {
    PrefixChainInfo i;
    for (uint64_t k : c.keys) {
      auto it = map_.find(k);
      i.tokens += it != map_.end() ? (int64_t)it->second.ids.size() : P;
      i.live_pages += it != map_.end();
    }
    if (i.live_pages == 0) continue;
    i.hits = c.hits;
    i.born = c.born;
    i.last_hit = c.last_hit;
    i.preview = c.preview;
    out.push_back(std::move(i));
  }
  return out;
}

}  // namespace dl
