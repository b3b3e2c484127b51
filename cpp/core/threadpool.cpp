// Chunked work sharing with spin-then-sleep workers. Ordering: a worker announces
// itself (in_job_) before it looks at open_, and the caller closes open_ before it
// waits for in_job_ to drain (both seq_cst), so no worker touches a finished job.
#include "core/threadpool.h"

#include "core/cpu_features.h"

#if defined(__x86_64__)
#include <immintrin.h>
#define DL_PAUSE() _mm_pause()
#else
#define DL_PAUSE() std::this_thread::yield()
#endif

namespace dl {

namespace {
// Waiting: pause for a while (a job's next op usually comes within microseconds), then
// give the core away at every check (sched_yield). On a machine shared with other
// processes, a waiter that only pauses holds a core that the thread it waits for (or the
// caller, whose chunks it would take) could run on.
constexpr int kPauseSpins = 2000, kYieldSpins = 2000;  // then a worker sleeps
inline void wait_step(int spin) {
  if (spin < kPauseSpins)
    DL_PAUSE();
  else
    std::this_thread::yield();
}
}  // namespace

int default_threads() { return std::max(1, cpu_features().physical_cores); }

ThreadPool::ThreadPool(int n_threads) : n_(std::max(1, n_threads)), regions_(new Region[std::max(1, n_threads)]) {
  for (int i = 1; i < n_; ++i) threads_.emplace_back(&ThreadPool::worker, this, i);
}

ThreadPool::~ThreadPool() {
  stop_.store(true);
  epoch_.fetch_add(1);
  {
    std::lock_guard<std::mutex> lk(mu_);
  }
  cv_.notify_all();
  for (auto& t : threads_) t.join();
}

void ThreadPool::work(int id) {
  const int nr = n_regions_;
  int64_t done = 0;  // reported once at the end: one shared-line update per thread, not per chunk
  for (int k = 0; k < nr; ++k) {
    Region& r = regions_[(id + k) % nr];
    for (;;) {
      const int64_t c = r.next.fetch_add(1, std::memory_order_relaxed);
      if (c >= r.end) break;
      const int64_t lo = c * grain_, hi = std::min(n_items_, lo + grain_);
      (*fn_)(lo, hi);
      done += hi - lo;
    }
  }
  if (done) done_.fetch_add(done, std::memory_order_release);
}

void ThreadPool::parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  grain = std::max<int64_t>(1, grain);
  if (n_ == 1 || n <= grain) {
    fn(0, n);
    return;
  }
  fn_ = &fn;
  n_items_ = n;
  grain_ = grain;
  const int64_t chunks = (n + grain - 1) / grain;
  n_regions_ = (int)std::min<int64_t>(n_, chunks);
  for (int r = 0; r < n_regions_; ++r) {
    regions_[r].next.store(chunks * r / n_regions_, std::memory_order_relaxed);
    regions_[r].end = chunks * (r + 1) / n_regions_;
  }
  done_.store(0);
  open_.store(true);
  epoch_.fetch_add(1);
  if (sleepers_.load() > 0) {
    std::lock_guard<std::mutex> lk(mu_);
    cv_.notify_all();
  }
  work(0);
  for (int spin = 0; done_.load(std::memory_order_acquire) < n; ++spin) wait_step(spin);
  open_.store(false);
  for (int spin = 0; in_job_.load() != 0; ++spin) wait_step(spin);
}

void ThreadPool::run(const std::function<void(int, int)>& fn, int n_threads) {
  const int nth = n_threads > 0 ? std::min(n_threads, n_) : n_;
  parallel_for(nth, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) fn((int)i, nth);
  });
}

void ThreadPool::worker(int id) {
  uint64_t seen = epoch_.load();
  while (!stop_.load()) {
    uint64_t e = epoch_.load(std::memory_order_acquire);
    for (int spin = 0; e == seen && spin < kPauseSpins + kYieldSpins; ++spin) {
      wait_step(spin);
      e = epoch_.load(std::memory_order_acquire);
    }
    if (e == seen) {
      std::unique_lock<std::mutex> lk(mu_);
      sleepers_.fetch_add(1);
      cv_.wait(lk, [&] { return epoch_.load() != seen || stop_.load(); });
      sleepers_.fetch_sub(1);
      e = epoch_.load();
    }
    seen = e;
    in_job_.fetch_add(1);
    if (open_.load()) work(id);
    in_job_.fetch_sub(1);
  }
}

}  // namespace dl
