// A persistent thread pool for data-parallel kernels: run(fn) calls fn(ith, nth)
// on nth threads (the caller is thread 0) and returns when all are done.
#pragma once
#include <atomic>
#include <condition_variable>
#include <functional>
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
  // Runs fn(ith, nth) for ith in [0, nth) with nth = min(n_threads, size()).
  // Not reentrant: one run at a time per pool (callers serialize per model).
  void run(const std::function<void(int, int)>& fn, int n_threads = 0);

 private:
  void worker(int ith);
  int n_;
  std::vector<std::thread> threads_;
  std::mutex mu_;
  std::condition_variable cv_;
  const std::function<void(int, int)>* fn_ = nullptr;
  int active_ = 0;                  // threads taking part in the current job
  std::atomic<uint64_t> epoch_{0};  // bumped per job; workers spin on it briefly before sleeping
  std::atomic<int> pending_{0};
  bool stop_ = false;
};

// Default thread count: the physical cores.
int default_threads();

}  // namespace dl
