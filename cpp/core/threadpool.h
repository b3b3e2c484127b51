// A persistent thread pool for data-parallel kernels. A job's chunks are cut into
// one contiguous region per thread; each thread walks its own region front to back
// (so a core streams weights sequentially and its prefetchers keep up), then takes
// what is left of the others' regions from their shared counters, so the caller
// (which takes part) finishes the job alone if a worker is descheduled.
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace dl {

class ThreadPool {
 public:
  explicit ThreadPool(int n_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return n_; }
  // Calls fn(lo, hi) over [0, n) in chunks of `grain`, each chunk exactly once,
  // on the caller and the workers. One job at a time per pool.
  void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);
  // Calls fn(ith, nth) for every ith in [0, nth), nth = min(n_threads or size(), size()).
  // Each index runs once, on whichever thread takes it.
  void run(const std::function<void(int, int)>& fn, int n_threads = 0);

 private:
  void worker(int id);
  void work(int id);
  int n_;
  std::vector<std::thread> threads_;
  // The open job (valid while open_): written by the caller before it opens the job.
  const std::function<void(int64_t, int64_t)>* fn_ = nullptr;
  int64_t n_items_ = 0, grain_ = 1;
  // Region r covers chunks [next, end): next is taken by its owner and by helpers alike.
  struct alignas(64) Region {
    std::atomic<int64_t> next{0};
    int64_t end = 0;
  };
  std::unique_ptr<Region[]> regions_;
  int n_regions_ = 1;
  std::atomic<int64_t> done_{0};
  std::atomic<bool> open_{false};
  std::atomic<int> in_job_{0};      // workers inside work(); the caller waits for 0 before reuse
  std::atomic<uint64_t> epoch_{0};  // bumped per job; workers spin on it, then sleep
  std::atomic<int> sleepers_{0};
  std::atomic<bool> stop_{false};
  std::mutex mu_;
  std::condition_variable cv_;
};

// Default thread count: the physical cores.
int default_threads();

}  // namespace dl
