// The prefix cache over one KV pool: full pages keyed by a chained hash of the
// previous page's key and the page's ids (tokens, or negative media ids), the ids
// verified on every hit, least recently used unreferenced leaves evicted past the
// budget or when the pool runs short. A page is also hit in part, and a session's last
// partly filled page is kept, where that part holds media rows (an image or clip ending
// mid-page must not be prefilled again). Knows pages and ids, not models.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "kv/pool.h"

namespace dl {

struct PrefixChainInfo {
  int64_t tokens = 0, live_pages = 0, hits = 0, born = 0, last_hit = 0;
  std::string preview;
};

class PrefixCache {
 public:
  explicit PrefixCache(int64_t max_groups) : max_groups_(max_groups) {}
  ~PrefixCache();

  // Binds the cache to `pool` on first use; a cache serves one pool.
  void bind(const std::shared_ptr<KVPool>& pool);
  // Pages of the longest cached page-aligned prefix of `ids`, plus the first rows of one more
  // page where they hold a media row (one token short of it at most: the caller prefills at
  // least one row, and copies a shared last page before writing it). Returns (pages, matched).
  // The pages are not yet referenced by the caller; call under the pool lock.
  // With `state` (a model whose recurrent layers keep a state beside the KV), only a prefix
  // ending on a page that carries a state snapshot matches, and *state is that snapshot.
  std::pair<std::vector<int32_t>, int64_t> match_locked(const int32_t* ids, int64_t n, BufferPtr* state = nullptr);
  // Adds the full pages of a session's rows (page_ids[i] holds ids[i*P, (i+1)*P)); a state
  // snapshot taken at position (i+1)*P goes with page i (and is freed with it).
  using StateAt = std::pair<int64_t, BufferPtr>;
  void insert_locked(const int32_t* ids, int64_t n, const std::vector<int32_t>& page_ids, const std::string& preview,
                     const std::vector<StateAt>* states = nullptr);
  // The budget of state snapshots (each one model's whole recurrent state); past it the least
  // recently used page gives up its snapshot (the page stays). Default 16 (a Qwen3.5-9B state is
  // about 50 MiB).
  void set_max_states(int64_t n) { max_states_ = n; }
  int64_t max_states() const { return max_states_; }
  int64_t states_held() const;
  // Gives one least recently used unreferenced leaf page back to the pool.
  bool evict_one_locked();
  void release();  // every page back to the pool; the cache is empty after
  int64_t held() const;
  std::vector<PrefixChainInfo> chains() const;
  const std::shared_ptr<KVPool>& pool() const { return pool_; }
  int64_t max_groups() const { return max_groups_; }

 private:
  struct Entry {
    uint64_t parent = 0;
    int32_t page = -1;
    int32_t depth = 0;
    int32_t children = 0;
    int64_t chain = -1;  // the donation that brought the page in
    int64_t last_used = 0;
    std::vector<int32_t> ids;
    BufferPtr state;  // an opaque snapshot of the state at the end of this page, or null
  };
  struct Chain {
    std::vector<uint64_t> keys;
    int64_t hits = 0, born = 0, last_hit = 0;
    std::string preview;
  };
  void drop_locked(std::unordered_map<uint64_t, Entry>::iterator it);
  // A child of `parent` at `depth` whose ids start with ids[0, m).
  bool covered_locked(uint64_t parent, int32_t depth, const int32_t* ids, int64_t m) const;
  void drop_covered_partials_locked(uint64_t parent, int32_t depth, const int32_t* ids, int64_t m, uint64_t except);
  void enforce_budget_locked();
  void enforce_states_locked();

  int64_t max_groups_;
  int64_t max_states_ = 16;
  std::shared_ptr<KVPool> pool_;
  std::unordered_map<uint64_t, Entry> map_;
  std::vector<Chain> chains_;
  int64_t tick_ = 0;
  int64_t partials_ = 0;  // entries of fewer than page_rows ids
};

// The chained page key: a hash of the previous page's key and this page's ids.
uint64_t prefix_page_key(uint64_t prev, const int32_t* ids, int64_t n);

}  // namespace dl
