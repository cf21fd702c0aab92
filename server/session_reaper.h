// Frees the sessions of trainers that are gone: a thread that, every
// `period`, has the registry check each session's trainer process
// (SessionRegistry::Reap: it also lets a gone trainer's waiting steps
// through) and logs the sessions it orphaned or freed, and a second
// thread that disposes of the freed ones (SessionRegistry::Dispose), whose
// end may wait for their device while the first goes on rescuing.
//
// Thread-safe: the two threads are its only workers; destroying it stops
// and joins them.
#ifndef OPTIMD_SERVER_SESSION_REAPER_H_
#define OPTIMD_SERVER_SESSION_REAPER_H_

#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "common/mutex.h"
#include "core/session_registry.h"

namespace optimd {

// Logs what one look of SessionRegistry::Reap found (`grace` as the reaper
// keeps orphans).
void LogReaped(const SessionRegistry::Reaped& reaped, absl::Duration grace,
               const std::function<void(const std::string&)>& log);

class SessionReaper {
 public:
  // `grace`: how long an orphaned session waits for its trainer's resume.
  SessionReaper(SessionRegistry* registry, absl::Duration grace,
                absl::Duration period,
                std::function<void(const std::string&)> log);
  SessionReaper(const SessionReaper&) = delete;
  SessionReaper& operator=(const SessionReaper&) = delete;
  ~SessionReaper();

 private:
  void Run();
  void RunDisposer();

  // Constant after construction.
  SessionRegistry* const registry_;
  const absl::Duration grace_;
  const absl::Duration period_;
  const std::function<void(const std::string&)> log_;

  absl::Notification stop_;
  Mutex mu_;
  std::vector<std::shared_ptr<Session>> to_dispose_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread disposer_;
  std::thread thread_;
};

}  // namespace optimd

#endif  // OPTIMD_SERVER_SESSION_REAPER_H_
