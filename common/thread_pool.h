// A fixed pool of worker threads that runs one parallel loop at a time.
// ParallelFor may be called from one thread at a time (the device worker);
// the pool itself is internally synchronized.
#ifndef OPTIMD_COMMON_THREAD_POOL_H_
#define OPTIMD_COMMON_THREAD_POOL_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "common/mutex.h"

namespace optimd {

class ThreadPool {
 public:
  // `threads` total workers including the caller of ParallelFor; 0 picks the
  // number of hardware threads.
  explicit ThreadPool(int threads);
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;
  ~ThreadPool();

  int size() const { return static_cast<int>(workers_.size()) + 1; }

  // Calls fn(i, worker) for every i in [0, n), spread over the pool; returns
  // when all calls finished. `worker` is in [0, size()).
  void ParallelFor(uint64_t n, const std::function<void(uint64_t, int)>& fn)
      ABSL_LOCKS_EXCLUDED(mu_);

 private:
  void WorkerLoop(int worker);
  void RunShare(int worker);

  std::vector<std::thread> workers_;

  Mutex mu_;
  uint64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
  int busy_ ABSL_GUARDED_BY(mu_) = 0;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  const std::function<void(uint64_t, int)>* fn_ = nullptr;
  uint64_t n_ = 0;
  std::atomic<uint64_t> next_{0};
};

}  // namespace optimd

#endif  // OPTIMD_COMMON_THREAD_POOL_H_
