// Frees the sessions of trainers that are gone: a thread that, every
// `period`, has the registry check each session's trainer process
// (SessionRegistry::Reap) and logs the sessions it orphaned or freed.
//
// Thread-safe: the reaper's own thread is its only worker; destroying it
// stops and joins that thread.
#ifndef OPTIMD_SERVER_SESSION_REAPER_H_
#define OPTIMD_SERVER_SESSION_REAPER_H_

#include <functional>
#include <string>
#include <thread>

#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "core/session_registry.h"

namespace optimd {

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

  // Constant after construction.
  SessionRegistry* const registry_;
  const absl::Duration grace_;
  const absl::Duration period_;
  const std::function<void(const std::string&)> log_;

  absl::Notification stop_;
  std::thread thread_;
};

}  // namespace optimd

#endif  // OPTIMD_SERVER_SESSION_REAPER_H_
