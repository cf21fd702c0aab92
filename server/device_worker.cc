#include "server/device_worker.h"

#include <pthread.h>

#include <algorithm>

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

void DeviceWorker::Post(const void* owner, std::function<void()> task) {
  MutexLock lock(&mu_);
  std::deque<std::function<void()>>& queue = queues_[owner];
  if (queue.empty()) turns_.push_back(owner);
  queue.push_back(std::move(task));
  ++queued_;
}

void DeviceWorker::Drain(const void* owner) {
  MutexLock lock(&mu_);
  if (queues_.count(owner) == 0) return;  // nothing waits
  draining_.insert(owner);
  turns_.erase(std::find(turns_.begin(), turns_.end(), owner));
  turns_.push_front(owner);
}

int DeviceWorker::pending() const {
  MutexLock lock(&mu_);
  return queued_ + running_;
}

int DeviceWorker::queued(const void* owner) const {
  MutexLock lock(&mu_);
  auto it = queues_.find(owner);
  return it == queues_.end() ? 0 : static_cast<int>(it->second.size());
}

std::function<void()> DeviceWorker::TakeNext() {
  const void* owner = turns_.front();
  turns_.pop_front();
  auto it = queues_.find(owner);
  std::function<void()> task = std::move(it->second.front());
  it->second.pop_front();
  if (it->second.empty()) {
    queues_.erase(it);
    draining_.erase(owner);
  } else if (draining_.count(owner) != 0) {
    turns_.push_front(owner);  // drained before anyone else
  } else {
    turns_.push_back(owner);  // its next task waits for the others' turns
  }
  --queued_;
  return task;
}

void DeviceWorker::Loop() {
  for (;;) {
    std::function<void()> task;
    {
      MutexLock lock(&mu_);
      mu_.Await(
          +[](DeviceWorker* w) ABSL_NO_THREAD_SAFETY_ANALYSIS {
            return w->stop_ || w->queued_ > 0;
          },
          this);
      if (queued_ == 0) return;  // stop_ and drained
      task = TakeNext();
      running_ = 1;
    }
    task();
    MutexLock lock(&mu_);
    running_ = 0;
  }
}

}  // namespace optimd
