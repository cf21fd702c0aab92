#include "common/thread_pool.h"

namespace optimd {

ThreadPool::ThreadPool(int threads) {
  if (threads <= 0) {
    threads = static_cast<int>(std::thread::hardware_concurrency());
    if (threads <= 0) threads = 1;
  }
  for (int i = 1; i < threads; ++i) {
    workers_.emplace_back([this, i] { WorkerLoop(i); });
  }
}

ThreadPool::~ThreadPool() {
  {
    MutexLock lock(&mu_);
    stop_ = true;
  }
  for (auto& t : workers_) t.join();
}

void ThreadPool::RunShare(int worker) {
  for (;;) {
    const uint64_t i = next_.fetch_add(1, std::memory_order_relaxed);
    if (i >= n_) return;
    (*fn_)(i, worker);
  }
}

void ThreadPool::WorkerLoop(int worker) {
  struct WaitArg {
    ThreadPool* pool;
    uint64_t seen;
  };
  WaitArg arg{this, 0};
  for (;;) {
    {
      MutexLock lock(&mu_);
      mu_.Await(
          +[](WaitArg* a) ABSL_NO_THREAD_SAFETY_ANALYSIS {
            return a->pool->stop_ || a->pool->generation_ != a->seen;
          },
          &arg);
      if (stop_) return;
      arg.seen = generation_;
    }
    RunShare(worker);
    MutexLock lock(&mu_);
    --busy_;
  }
}

void ThreadPool::ParallelFor(uint64_t n,
                             const std::function<void(uint64_t, int)>& fn) {
  if (n == 0) return;
  if (workers_.empty() || n == 1) {
    for (uint64_t i = 0; i < n; ++i) fn(i, 0);
    return;
  }
  {
    MutexLock lock(&mu_);
    fn_ = &fn;
    n_ = n;
    next_.store(0, std::memory_order_relaxed);
    busy_ = static_cast<int>(workers_.size());
    ++generation_;
  }
  RunShare(0);
  MutexLock lock(&mu_);
  mu_.Await(
      +[](int* busy) { return *busy == 0; }, &busy_);
}

}  // namespace optimd
