// Spin-then-sleep workers: a short spin keeps per-token dispatch cheap in the
// decode loop without burning a core while idle.
#include "core/threadpool.h"

#include <chrono>

#include "core/cpu_features.h"

#if defined(__x86_64__)
#include <immintrin.h>
#define DL_PAUSE() _mm_pause()
#else
#define DL_PAUSE() std::this_thread::yield()
#endif

namespace dl {

int default_threads() { return std::max(1, cpu_features().physical_cores); }

ThreadPool::ThreadPool(int n_threads) : n_(std::max(1, n_threads)) {
  for (int i = 1; i < n_; ++i) threads_.emplace_back(&ThreadPool::worker, this, i);
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
    epoch_.fetch_add(1);
  }
  cv_.notify_all();
  for (auto& t : threads_) t.join();
}

void ThreadPool::run(const std::function<void(int, int)>& fn, int n_threads) {
  int nth = n_threads > 0 ? std::min(n_threads, n_) : n_;
  if (nth == 1) {
    fn(0, 1);
    return;
  }
  {
    std::lock_guard<std::mutex> lk(mu_);
    fn_ = &fn;
    active_ = nth;
    pending_.store(nth - 1, std::memory_order_relaxed);
    epoch_.fetch_add(1, std::memory_order_release);
  }
  cv_.notify_all();
  fn(0, nth);
  while (pending_.load(std::memory_order_acquire) != 0) DL_PAUSE();
}

void ThreadPool::worker(int ith) {
  uint64_t seen = 0;
  for (;;) {
    // Spin a little for the next job, then sleep on the condition variable.
    uint64_t e = epoch_.load(std::memory_order_acquire);
    for (int spin = 0; e == seen && spin < 20000; ++spin) {
      DL_PAUSE();
      e = epoch_.load(std::memory_order_acquire);
    }
    if (e == seen) {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] { return epoch_.load() != seen; });
      e = epoch_.load();
    }
    const std::function<void(int, int)>* fn;
    int nth;
    {
      // Epoch, job and width read together, so a late waker never runs a job twice.
      std::lock_guard<std::mutex> lk(mu_);
      if (stop_) return;
      seen = epoch_.load();
      fn = fn_;
      nth = active_;
    }
    if (ith < nth && fn) {
      (*fn)(ith, nth);
      pending_.fetch_sub(1, std::memory_order_acq_rel);
    }
  }
}

}  // namespace dl
