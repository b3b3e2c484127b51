// The paged KV pool and a session's block table over it. Knows cache geometry
// (layers, row bytes, rows per page) and nothing of architectures or attention.
//
// A page holds page_rows positions of every layer, laid out [layer][K rows | V rows];
// pages are refcounted (each session holding one and the prefix cache count once).
// A flat session is the special case of one private page of n_ctx rows. The pages
// live in the backend's memory (device memory on a GPU): this code only does
// bookkeeping, and copies pages through the backend.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/backend.h"

namespace dl {

class PrefixCache;

struct KVGeometry {
  int n_layers = 0;
  int64_t kv_dim = 0;  // K (and V) elements per row
  KVType type = KVType::f16;
  size_t row_bytes = 0;
};

struct PoolStats {
  int64_t page_rows = 0, total = 0, free = 0, used = 0;
  int64_t by_sessions = 0, by_cache = 0, shared = 0;  // held by >= 1 session, by the cache, by both
  int64_t allocated = 0;                              // pages handed out at least once (memory committed on write)
  size_t page_bytes = 0;
};

class KVPool {
 public:
  // Throws dl::Error on bad sizes and dl::DeviceError when the pool does not fit in the
  // backend's memory (both checked before anything is allocated).
  KVPool(const KVGeometry& g, int64_t page_rows, int64_t max_pages, std::shared_ptr<Backend> backend);
  ~KVPool();

  const KVGeometry& geometry() const { return geo_; }
  int64_t page_rows() const { return page_rows_; }
  int page_shift() const { return page_shift_; }
  int64_t max_pages() const { return max_pages_; }
  size_t page_bytes() const { return page_bytes_; }
  size_t k_off(int layer) const { return (size_t)layer * 2 * page_rows_ * geo_.row_bytes; }
  size_t v_off(int layer) const { return k_off(layer) + (size_t)page_rows_ * geo_.row_bytes; }
  Backend& backend() const { return *backend_; }
  uint8_t* base() const { return base_; }  // backend memory: page id i starts at base + i * page_bytes
  uint8_t* page_data(int32_t id) const { return base_ + (size_t)id * page_bytes_; }

  // n fresh pages (refcount 1 each), all or none: when the free list runs short the
  // bound prefix cache gives back unreferenced pages; then PoolExhaustedError.
  std::vector<int32_t> alloc(int64_t n);
  void incref(int32_t id);
  void decref(int32_t id);  // a page whose count drops to 0 is free again
  int32_t refcount(int32_t id) const { return refs_[(size_t)id]; }
  PoolStats stats() const;
  PoolStats stats_locked() const;

  // Everything below runs with mu() held by the caller.
  std::mutex& mu() const { return mu_; }
  std::vector<int32_t> alloc_locked(int64_t n);
  void incref_locked(int32_t id);
  void decref_locked(int32_t id);
  void set_cached_locked(int32_t id, bool on) { in_cache_[(size_t)id] = on; }
  bool cached_locked(int32_t id) const { return in_cache_[(size_t)id]; }
  PrefixCache* cache_locked() const { return cache_; }
  void bind_cache_locked(PrefixCache* c) { cache_ = c; }
  int64_t free_count_locked() const { return (int64_t)free_.size() + (max_pages_ - (int64_t)refs_.size()); }

 private:
  KVGeometry geo_;
  int64_t page_rows_, max_pages_;
  int page_shift_ = 0;
  size_t page_bytes_ = 0;
  mutable std::mutex mu_;
  // One block of backend memory for all pages (on the CPU a reserved address range
  // the OS commits as pages are first written).
  std::shared_ptr<Backend> backend_;
  BufferPtr mem_;
  uint8_t* base_ = nullptr;
  std::vector<int32_t> refs_;  // one per page handed out so far (the high-water mark)
  std::vector<uint8_t> in_cache_;
  std::vector<int32_t> free_;  // freed ids, reused first
  PrefixCache* cache_ = nullptr;  // not owned; the cache unbinds itself when it dies
};

// A session's KV storage: the pages holding its rows, in order. Row j of layer l
// lives in page j >> page_shift at byte k_off(l) / v_off(l) + (j & mask) * row_bytes.
class BlockTable {
 public:
  BlockTable(const KVGeometry& g, int64_t n_ctx, Backend& be);  // flat: one private page of n_ctx rows
  explicit BlockTable(std::shared_ptr<KVPool> pool);
  ~BlockTable() { release(); }
  BlockTable(const BlockTable&) = delete;
  BlockTable& operator=(const BlockTable&) = delete;

  bool paged() const { return pool_ != nullptr; }
  KVPool* pool() const { return pool_.get(); }
  const std::shared_ptr<KVPool>& pool_ptr() const { return pool_; }
  const KVGeometry& geometry() const { return geo_; }
  int page_shift() const { return shift_; }
  int64_t page_rows() const { return rows_; }
  const std::vector<int32_t>& page_ids() const { return ids_; }  // host copy; a flat table is {0}
  int64_t n_pages() const { return (int64_t)ids_.size(); }
  uint8_t* base() const { return pool_ ? pool_->base() : static_cast<uint8_t*>(flat_->data()); }
  size_t page_bytes() const { return pool_ ? pool_->page_bytes() : flat_->size(); }
  size_t k_off(int l) const { return (size_t)l * 2 * rows_ * geo_.row_bytes; }
  size_t v_off(int l) const { return k_off(l) + (size_t)rows_ * geo_.row_bytes; }

  // Makes rows [from, to) writable: pages appended to cover `to` rows, and a page
  // shared with others (the prefix cache, another session) that row `from` falls
  // in is copied first. All or nothing: on PoolExhaustedError the table is as before.
  void prepare_write(int64_t from, int64_t to);
  // Whether prepare_write(from, to) would change nothing (no page to append or copy).
  bool writes_in_place(int64_t from, int64_t to) const;
  // Keeps the pages covering rows [0, n) and returns the rest.
  void truncate(int64_t n);
  // Returns every page (flat tables keep their buffer).
  void release();
  // Appends pages the caller already took a reference on (the table now owns it).
  void adopt_referenced(const std::vector<int32_t>& ids);

 private:
  KVGeometry geo_;
  std::shared_ptr<KVPool> pool_;
  int shift_ = 0;
  int64_t rows_ = 0;
  std::vector<int32_t> ids_;
  BufferPtr flat_;
};

}  // namespace dl
