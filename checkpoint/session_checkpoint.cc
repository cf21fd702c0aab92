#include "checkpoint/session_checkpoint.h"

#include <sys/stat.h>

#include <chrono>
#include <utility>

#include "absl/strings/str_cat.h"
#include "checkpoint/loader.h"
#include "checkpoint/paths.h"
#include "checkpoint/writer.h"
#include "common/status_macros.h"

namespace optimd {
namespace {

// A snapshot of the locked session's state, its memory reserved against
// the daemon's state budget and the session's limit of kMaxLiveSnapshots;
// destroying it gives both back.
absl::StatusOr<std::unique_ptr<CheckpointSnapshot>> ReservedSnapshot(
    LockedSession& session, const CheckpointOptions& options) {
  OPTIMD_ASSIGN_OR_RETURN(SnapshotReservation reservation,
                          session.ReserveSnapshot());
  CheckpointOptions with_job = options;
  with_job.job_id = session.identity().job_id;
  OPTIMD_ASSIGN_OR_RETURN(
      std::unique_ptr<CheckpointSnapshot> snapshot,
      TakeSnapshot(session.groups(), session.backend(), with_job));
  snapshot->HoldReservation(std::move(reservation));
  return snapshot;
}

// SaveSession with the session locked.
absl::StatusOr<CheckpointResult> SaveLocked(
    LockedSession& session, BackgroundSave& saves, const std::string& directory,
    const CheckpointOptions& options, bool background,
    std::function<void(const SaveStatusInfo&)> on_written,
    SaveProgress* progress) {
  if (session.state_mixed()) {
    return absl::FailedPreconditionError(
        "the session's state is mixed after a failed load; refusing to save "
        "it (load a good checkpoint first)");
  }
  OPTIMD_RETURN_IF_ERROR(saves.CheckIdle());
  OPTIMD_ASSIGN_OR_RETURN(std::string dir,
                          ResolveCheckpointDir(directory, options));
  OPTIMD_RETURN_IF_ERROR(session.SyncFromBackend());
  const std::string path =
      absl::StrCat(dir, "/", CheckpointFileName(session.identity().rank));
  CheckpointOptions with_job = options;
  with_job.job_id = session.identity().job_id;
  if (!background) {
    return SaveCheckpoint(path, session.groups(), session.backend(), with_job,
                          progress);
  }
  const auto t0 = std::chrono::steady_clock::now();
  OPTIMD_ASSIGN_OR_RETURN(std::shared_ptr<CheckpointSnapshot> snapshot,
                          ReservedSnapshot(session, options));
  CheckpointResult result;
  result.path = path;
  result.bytes = snapshot->bytes();
  saves.Start(path, std::move(snapshot), options, std::move(on_written), t0);
  result.seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
          .count();
  return result;
}

}  // namespace

absl::StatusOr<CheckpointResult> SaveSession(
    Session& session, const std::string& directory,
    const CheckpointOptions& options, bool background,
    std::function<void(const SaveStatusInfo&)> on_written,
    SaveProgress* progress) {
  BackgroundSave& saves = session.Attachment<BackgroundSave>();
  return session.WithLockedState([&](LockedSession& locked) {
    return SaveLocked(locked, saves, directory, options, background,
                      std::move(on_written), progress);
  });
}

SaveStatusInfo SaveStatusOf(Session& session) {
  return session.Attachment<BackgroundSave>().Status();
}

bool WaitForBackgroundSave(Session& session) {
  return session.Attachment<BackgroundSave>().Wait();
}

absl::StatusOr<std::unique_ptr<CheckpointSnapshot>> SnapshotSession(
    Session& session) {
  return session.WithLockedState(
      [](LockedSession& locked)
          -> absl::StatusOr<std::unique_ptr<CheckpointSnapshot>> {
        if (locked.state_mixed()) {
          return absl::FailedPreconditionError(
              "the session's state is mixed after a failed load; load a good "
              "checkpoint first");
        }
        OPTIMD_RETURN_IF_ERROR(locked.SyncFromBackend());
        return ReservedSnapshot(locked, CheckpointOptions());
      });
}

absl::StatusOr<CheckpointResult> LoadSession(Session& session,
                                             const std::string& directory,
                                             const CheckpointOptions& options) {
  OPTIMD_ASSIGN_OR_RETURN(std::string dir,
                          ResolveCheckpointDir(directory, options));
  const SessionIdentity& id = session.identity();
  std::string path = absl::StrCat(dir, "/", CheckpointFileName(id.rank));
  const std::string legacy =
      absl::StrCat(dir, "/", LegacyCheckpointFileName(id.job_id, id.rank));
  struct stat st;
  if (lstat(path.c_str(), &st) != 0 && lstat(legacy.c_str(), &st) == 0) {
    path = legacy;  // written by an earlier version
  }
  return LoadSessionFile(session, path, options);
}

absl::StatusOr<CheckpointResult> LoadSessionFile(
    Session& session, const std::string& path,
    const CheckpointOptions& options) {
  return session.WithLockedState(
      [&](LockedSession& locked) -> absl::StatusOr<CheckpointResult> {
        OPTIMD_RETURN_IF_ERROR(locked.SyncFromBackend());
        bool partial = false;
        auto r = LoadCheckpoint(path, locked.groups(), locked.backend(),
                                options, &partial);
        if (!r.ok()) {
          if (partial) locked.set_state_mixed(true);
          return r.status();
        }
        locked.set_state_mixed(false);
        return r;
      });
}

}  // namespace optimd
