#include "server/session_reaper.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace optimd {

SessionReaper::SessionReaper(SessionRegistry* registry, absl::Duration grace,
                             absl::Duration period,
                             std::function<void(const std::string&)> log)
    : registry_(registry),
      grace_(grace),
      period_(period),
      log_(std::move(log)),
      thread_([this] { Run(); }) {}

SessionReaper::~SessionReaper() {
  stop_.Notify();
  thread_.join();
}

void SessionReaper::Run() {
  while (!stop_.WaitForNotificationWithTimeout(period_)) {
    const SessionRegistry::Reaped reaped = registry_->Reap(absl::Now(), grace_);
    for (const SessionIdentity& id : reaped.orphaned) {
      log_(absl::StrCat("session of job '", id.job_id, "' rank ", id.rank,
                        " orphaned: its trainer is gone; kept ",
                        absl::FormatDuration(grace_),
                        " for a resume (resume=true)"));
    }
    for (const SessionIdentity& id : reaped.abandoned) {
      log_(absl::StrCat("session of job '", id.job_id, "' rank ", id.rank,
                        ": steps waiting for its gone trainer's ready flag "
                        "let through, skipped (their gradients may be "
                        "incomplete)"));
    }
    for (const auto& [id, status] : reaped.abandon_failed) {
      log_(absl::StrCat("session of job '", id.job_id, "' rank ", id.rank,
                        ": cannot let through the steps waiting for its gone "
                        "trainer: ",
                        status.ToString()));
    }
    for (const SessionIdentity& id : reaped.freed) {
      log_(absl::StrCat("session of job '", id.job_id, "' rank ", id.rank,
                        " freed: no resume within ",
                        absl::FormatDuration(grace_)));
    }
  }
}

}  // namespace optimd
