// A session's state saved, snapshotted and loaded whole: what the server's
// SaveState, GetSaveStatus, SaveStateStream, LoadState and LoadStateStream
// (and the daemon's saves for its restart) call. Each takes the session's
// lock (Session::WithLockedState) and works on what LockedSession lends:
// the groups, the backend, the flag that refuses steps after a load failed
// part-way, and the reservation of a snapshot's memory.
//
// Thread-safe: calls on one session are serialized by its lock; a
// background save writes on a thread of its own (BackgroundSave, kept with
// the session), and status calls never wait for a step.
#ifndef OPTIMD_CHECKPOINT_SESSION_CHECKPOINT_H_
#define OPTIMD_CHECKPOINT_SESSION_CHECKPOINT_H_

#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "checkpoint/background_save.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/snapshot.h"
#include "core/session.h"

namespace optimd {

// Writes the session's state to `directory`/CheckpointFileName(rank).
// With `background`, returns once a consistent host copy is taken (the
// result's `bytes` is the snapshot's size) and writes it on a thread of its
// own while steps go on; SaveStatusOf reports progress. A save requested
// while a background save is still writing is FAILED_PRECONDITION, and so
// is one of a state left mixed by a failed load. `on_written`, if given, is
// called on the writing thread once a background save has ended (succeeded
// or failed). `progress`, if given, follows a save without `background`
// (which reports to SaveStatusOf).
absl::StatusOr<CheckpointResult> SaveSession(
    Session& session, const std::string& directory,
    const CheckpointOptions& options, bool background = false,
    std::function<void(const SaveStatusInfo&)> on_written = nullptr,
    SaveProgress* progress = nullptr);

// The session's last background save's progress. Never waits for a step.
SaveStatusInfo SaveStatusOf(Session& session);

// Waits until a background save of the session that is still writing has
// ended; true when there was one.
bool WaitForBackgroundSave(Session& session);

// A consistent snapshot of the session's state, for streaming it out; its
// memory is reserved against the daemon's state budget until it goes.
absl::StatusOr<std::unique_ptr<CheckpointSnapshot>> SnapshotSession(
    Session& session);

// Loads the session's state from `directory` in place: its rank's file, or
// the name earlier versions wrote. After a failure part-way (a file written
// into during the load), steps are refused until a load succeeds.
absl::StatusOr<CheckpointResult> LoadSession(Session& session,
                                             const std::string& directory,
                                             const CheckpointOptions& options);

// Loads the session's state from the checkpoint file at `path` (a
// streamed-in copy), as LoadSession does.
absl::StatusOr<CheckpointResult> LoadSessionFile(
    Session& session, const std::string& path,
    const CheckpointOptions& options);

}  // namespace optimd

#endif  // OPTIMD_CHECKPOINT_SESSION_CHECKPOINT_H_
