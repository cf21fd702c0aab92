// A device worker: one thread that runs a backend's slow work (buffer
// mapping, state allocation, steps), so that gRPC threads never block on
// it. Each task belongs to an owner (a session): an owner's tasks run in
// the order they were posted, and owners take turns, one task each, so
// that one session's many queued requests do not hold back another
// session's step. Thread-safe.
#ifndef OPTIMD_SERVER_DEVICE_WORKER_H_
#define OPTIMD_SERVER_DEVICE_WORKER_H_

#include <deque>
#include <functional>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>

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

  // Queues `task` for `owner` (compared by address only, never read):
  // after the owner's tasks posted before it, and after at most one task
  // of each other owner with tasks waiting.
  void Post(const void* owner, std::function<void()> task)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Serves `owner`'s waiting tasks before any other owner's, one after the
  // other, until none is left (a retired session: its tasks finish at
  // once, and the last one frees its state before a new session's work).
  void Drain(const void* owner) ABSL_LOCKS_EXCLUDED(mu_);

  // Tasks posted and not yet finished.
  int pending() const ABSL_LOCKS_EXCLUDED(mu_);
  // Tasks of `owner` posted and not yet started.
  int queued(const void* owner) const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  void Loop();
  // The next task in turn; the queue must not be empty.
  std::function<void()> TakeNext() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::string name_;
  mutable Mutex mu_;
  // Each owner's waiting tasks, in posting order; owners with none are
  // not kept.
  std::unordered_map<const void*, std::deque<std::function<void()>>> queues_
      ABSL_GUARDED_BY(mu_);
  // Owners with waiting tasks, in the order they take their turns; a
  // draining owner stays at the front until its tasks are done.
  std::deque<const void*> turns_ ABSL_GUARDED_BY(mu_);
  // Owners being drained (Drain) that still have waiting tasks.
  std::unordered_set<const void*> draining_ ABSL_GUARDED_BY(mu_);
  int queued_ ABSL_GUARDED_BY(mu_) = 0;
  int running_ ABSL_GUARDED_BY(mu_) = 0;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace optimd

#endif  // OPTIMD_SERVER_DEVICE_WORKER_H_
