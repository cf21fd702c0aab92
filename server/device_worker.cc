#include "server/device_worker.h"

#include <pthread.h>

namespace optimd {

DeviceWorker::DeviceWorker(std::string name) : name_(std::move(name)) {
  thread_ = std::thread([this] { Loop(); });
  pthread_setname_np(thread_.native_handle(), name_.substr(0, 15).c_str());
}

DeviceWorker::~DeviceWorker() {
  {
    MutexLock lock(&mu_);
    stop_ = true;
  }
  thread_.join();
}

void DeviceWorker::Post(std::function<void()> task) {
  MutexLock lock(&mu_);
  queue_.push_back(std::move(task));
}

int DeviceWorker::pending() const {
  MutexLock lock(&mu_);
  return static_cast<int>(queue_.size()) + running_;
}

void DeviceWorker::Loop() {
  for (;;) {
    std::function<void()> task;
    {
      MutexLock lock(&mu_);
      mu_.Await(
          +[](DeviceWorker* w) ABSL_NO_THREAD_SAFETY_ANALYSIS {
            return w->stop_ || !w->queue_.empty();
          },
          this);
      if (queue_.empty()) return;  // stop_ and drained
      task = std::move(queue_.front());
      queue_.pop_front();
      running_ = 1;
    }
    task();
    MutexLock lock(&mu_);
    running_ = 0;
  }
}

}  // namespace optimd
