// The paged KV pool (page allocation, refcounts, statistics) and block tables.
#include "kv/pool.h"

#include <algorithm>
#include <cstring>
#include <new>


#include "core/errors.h"
#include "kv/prefix_cache.h"

namespace dl {

namespace {
constexpr int kFlatShift = 62;  // a flat table is one page: j >> 62 is 0 for every row
constexpr int64_t kMaxPages = int64_t(1) << 30;
}  // namespace

KVPool::KVPool(const KVGeometry& g, int64_t page_rows, int64_t max_pages, std::shared_ptr<Backend> backend)
    : geo_(g), page_rows_(page_rows), max_pages_(max_pages), backend_(std::move(backend)) {
  if (page_rows < 1 || page_rows > 65536 || (page_rows & (page_rows - 1)) != 0)
    throw Error("page_rows must be a power of two in [1, 65536], got " + std::to_string(page_rows));
  if (max_pages < 1 || max_pages > kMaxPages)
    throw Error("max_pages must be in [1, 2^30], got " + std::to_string(max_pages));
  if (g.n_layers < 1 || g.row_bytes == 0) throw Error("KV pool: empty cache geometry");
  while ((int64_t(1) << page_shift_) < page_rows) ++page_shift_;
  // Sizes are checked before anything is allocated: one page must be addressable
  // and the whole pool must fit in a size_t.
  const unsigned __int128 pb = (unsigned __int128)g.n_layers * 2 * (uint64_t)page_rows * g.row_bytes;
  if (pb > (unsigned __int128)(SIZE_MAX / 2) || pb * (uint64_t)max_pages > (unsigned __int128)(SIZE_MAX / 2))
    throw Error("KV pool too large: " + std::to_string(max_pages) + " pages of " + std::to_string((uint64_t)pb) +
                " bytes");
  page_bytes_ = (size_t)pb;
  const size_t bytes = page_bytes_ * (size_t)max_pages;
  backend_->check_fits(bytes, "KV pool");
  mem_ = backend_->alloc(bytes, "KV pool");
  base_ = static_cast<uint8_t*>(mem_->data());
}

KVPool::~KVPool() = default;

std::vector<int32_t> KVPool::alloc(int64_t n) {
  std::lock_guard<std::mutex> lk(mu_);
  return alloc_locked(n);
}

std::vector<int32_t> KVPool::alloc_locked(int64_t n) {
  std::vector<int32_t> out;
  if (n <= 0) return out;
  // Short of free pages: the prefix cache gives back its least recently used
  // unreferenced ones first. Only then is the asker refused (nothing changed).
  while (free_count_locked() < n && cache_ && cache_->evict_one_locked()) {
  }
  if (free_count_locked() < n)
    throw PoolExhaustedError("KV pool exhausted: " + std::to_string(n) + " page(s) wanted, " +
                             std::to_string(free_count_locked()) + " free of " + std::to_string(max_pages_) +
                             " (" + std::to_string(page_rows_) + " rows each)");
  out.reserve((size_t)n);
  // The only allocations, made before any page changes hands; free_ never outgrows
  // refs_, so giving a page back (decref) never allocates.
  if (refs_.capacity() < refs_.size() + (size_t)n) {
    const size_t cap = std::max(refs_.size() + (size_t)n, 2 * refs_.capacity());
    refs_.reserve(cap);
    in_cache_.reserve(cap);
    free_.reserve(cap);
  }
  while ((int64_t)out.size() < n) {
    int32_t id;
    if (!free_.empty()) {
      id = free_.back();
      free_.pop_back();
    } else {  // a page never used before: its memory is committed when first written
      id = (int32_t)refs_.size();
      refs_.push_back(0);
      in_cache_.push_back(0);
    }
    refs_[(size_t)id] = 1;
    out.push_back(id);
  }
  return out;
}

void KVPool::incref(int32_t id) {
  std::lock_guard<std::mutex> lk(mu_);
  incref_locked(id);
}

void KVPool::decref(int32_t id) {
  std::lock_guard<std::mutex> lk(mu_);
  decref_locked(id);
}

void KVPool::incref_locked(int32_t id) {
  if (id < 0 || (size_t)id >= refs_.size() || refs_[(size_t)id] <= 0) throw Error("KV pool: incref of a free page");
  ++refs_[(size_t)id];
}

void KVPool::decref_locked(int32_t id) {
  if (id < 0 || (size_t)id >= refs_.size() || refs_[(size_t)id] <= 0) throw Error("KV pool: decref of a free page");
  if (--refs_[(size_t)id] == 0) free_.push_back(id);
}

PoolStats KVPool::stats() const {
  std::lock_guard<std::mutex> lk(mu_);
  return stats_locked();
}

PoolStats KVPool::stats_locked() const {
  PoolStats s;
  s.page_rows = page_rows_;
  s.total = max_pages_;
  s.page_bytes = page_bytes_;
  s.allocated = (int64_t)refs_.size();
  for (size_t i = 0; i < refs_.size(); ++i) {
    const int32_t r = refs_[i];
    if (r == 0) continue;
    ++s.used;
    const bool c = in_cache_[i] != 0;
    const bool sess = r - (c ? 1 : 0) > 0;
    s.by_cache += c;
    s.by_sessions += sess;
    s.shared += c && sess;
  }
  s.free = s.total - s.used;
  return s;
}

// ---- block tables -------------------------------------------------------------

BlockTable::BlockTable(const KVGeometry& g, int64_t n_ctx, Backend& be) : geo_(g), shift_(kFlatShift), rows_(n_ctx) {
  const unsigned __int128 bytes = (unsigned __int128)g.n_layers * 2 * (uint64_t)n_ctx * g.row_bytes;
  if (n_ctx < 1 || bytes > (unsigned __int128)(SIZE_MAX / 2)) throw Error("session context too large");
  be.check_fits((size_t)bytes, "session KV cache");
  flat_ = be.alloc((size_t)bytes, "session KV cache");  // uninitialized: rows are written before read
  ids_.push_back(0);
}

BlockTable::BlockTable(std::shared_ptr<KVPool> pool)
    : geo_(pool->geometry()), pool_(std::move(pool)), shift_(pool_->page_shift()), rows_(pool_->page_rows()) {}

void BlockTable::prepare_write(int64_t from, int64_t to) {
  if (!pool_ || to <= from) return;
  const int64_t have = (int64_t)ids_.size();
  const int64_t need = (to + rows_ - 1) >> shift_;
  const int64_t first = from >> shift_;
  std::lock_guard<std::mutex> lk(pool_->mu());
  // The page row `from` falls in, if it exists and someone else holds it too.
  const bool cow = first < have && pool_->refcount(ids_[(size_t)first]) > 1;
  const int64_t n_new = std::max<int64_t>(0, need - have) + (cow ? 1 : 0);
  std::vector<int32_t> fresh = pool_->alloc_locked(n_new);  // throws with nothing changed
  size_t k = 0;
  if (cow) {
    const int32_t old = ids_[(size_t)first], cp = fresh[k++];
    // Rows past `from` are about to be overwritten; copying the whole page is simplest.
    pool_->backend().copy(pool_->page_data(cp), pool_->page_data(old), pool_->page_bytes());
    ids_[(size_t)first] = cp;
    pool_->decref_locked(old);
  }
  for (; k < fresh.size(); ++k) ids_.push_back(fresh[k]);
}

bool BlockTable::writes_in_place(int64_t from, int64_t to) const {
  if (!pool_ || to <= from) return true;
  const int64_t have = (int64_t)ids_.size(), first = from >> shift_;
  if ((to + rows_ - 1) >> shift_ > have) return false;
  std::lock_guard<std::mutex> lk(pool_->mu());
  return !(first < have && pool_->refcount(ids_[(size_t)first]) > 1);
}

void BlockTable::truncate(int64_t n) {
  if (!pool_) return;
  const int64_t keep = (std::max<int64_t>(0, n) + rows_ - 1) >> shift_;
  if ((int64_t)ids_.size() <= keep) return;
  std::lock_guard<std::mutex> lk(pool_->mu());
  while ((int64_t)ids_.size() > keep) {
    pool_->decref_locked(ids_.back());
    ids_.pop_back();
  }
}

void BlockTable::release() { truncate(0); }

void BlockTable::adopt_referenced(const std::vector<int32_t>& ids) {
  if (!pool_) throw Error("adopt: a flat session holds no pool pages");
  ids_.insert(ids_.end(), ids.begin(), ids.end());
}

}  // namespace dl
