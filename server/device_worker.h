// A device worker: one thread that runs a backend's slow work (buffer
// mapping, state allocation, steps) in the order it was posted, so that gRPC
// threads never block on it. Thread-safe.
#ifndef OPTIMD_SERVER_DEVICE_WORKER_H_
#define OPTIMD_SERVER_DEVICE_WORKER_H_

#include <deque>
#include <functional>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "common/mutex.h"

namespace optimd {

class DeviceWorker {
 public:
  explicit DeviceWorker(std::string name);
  DeviceWorker(const DeviceWorker&) = delete;
  DeviceWorker& operator=(const DeviceWorker&) = delete;
  // Runs every task already posted, then joins the thread.
  ~DeviceWorker();

  // Queues `task`; tasks run one at a time in posting order.
  void Post(std::function<void()> task) ABSL_LOCKS_EXCLUDED(mu_);

  // Tasks posted and not yet finished.
  int pending() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  void Loop();

  const std::string name_;
  mutable Mutex mu_;
  std::deque<std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);
  int running_ ABSL_GUARDED_BY(mu_) = 0;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace optimd

#endif  // OPTIMD_SERVER_DEVICE_WORKER_H_
