#include "server/session_reaper.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace optimd {

void LogReaped(const SessionRegistry::Reaped& reaped, absl::Duration grace,
               const std::function<void(const std::string&)>& log) {
  for (const SessionIdentity& id : reaped.orphaned) {
    log(absl::StrCat("session of job '", id.job_id, "' rank ", id.rank,
                     " orphaned: its trainer is gone; kept ",
                     absl::FormatDuration(grace),
                     " for a resume (resume=true)"));
  }
  for (const SessionIdentity& id : reaped.abandoned) {
    log(absl::StrCat("session of job '", id.job_id, "' rank ", id.rank,
                     ": steps waiting for its gone trainer's ready flag "
                     "let through, skipped (their gradients may be "
                     "incomplete)"));
  }
  for (const auto& [id, status] : reaped.abandon_failed) {
    log(absl::StrCat("session of job '", id.job_id, "' rank ", id.rank,
                     ": cannot let through the steps waiting for its gone "
                     "trainer: ",
                     status.ToString()));
  }
  for (const SessionIdentity& id : reaped.freed) {
    log(absl::StrCat("session of job '", id.job_id, "' rank ", id.rank,
                     " freed: no resume within ", absl::FormatDuration(grace)));
  }
}

SessionReaper::SessionReaper(SessionRegistry* registry, absl::Duration grace,
                             absl::Duration period,
                             std::function<void(const std::string&)> log)
    : registry_(registry),
      grace_(grace),
      period_(period),
      log_(std::move(log)),
      disposer_([this] { RunDisposer(); }),
      thread_([this] { Run(); }) {}

SessionReaper::~SessionReaper() {
  stop_.Notify();
  thread_.join();
  {
    MutexLock lock(&mu_);
    stopping_ = true;
  }
  disposer_.join();
}

void SessionReaper::RunDisposer() {
  while (true) {
    std::vector<std::shared_ptr<Session>> batch;
    {
      MutexLock lock(&mu_);
      mu_.Await(
          +[](SessionReaper* r) ABSL_NO_THREAD_SAFETY_ANALYSIS {
            return r->stopping_ || !r->to_dispose_.empty();
          },
          this);
      if (to_dispose_.empty()) return;  // stopping, nothing left
      batch.swap(to_dispose_);
    }
    registry_->Dispose(std::move(batch));
  }
}

void SessionReaper::Run() {
  while (!stop_.WaitForNotificationWithTimeout(period_)) {
    SessionRegistry::Reaped reaped = registry_->Reap(absl::Now(), grace_);
    if (!reaped.freed_sessions.empty()) {
      MutexLock lock(&mu_);
      for (auto& s : reaped.freed_sessions) to_dispose_.push_back(std::move(s));
      reaped.freed_sessions.clear();
    }
    LogReaped(reaped, grace_, log_);
  }
}

}  // namespace optimd
