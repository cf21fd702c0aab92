// Snapshots: a consistent host copy of a session's state and parameters,
// taken at a step boundary, that a background save writes or a stream
// reads while steps go on. The copy is laid out as the file's data section,
// so that it can be read as the bytes of the checkpoint file itself.
//
// Thread-compatible: one user at a time (the thread writing or streaming
// it).
#ifndef OPTIMD_CHECKPOINT_SNAPSHOT_H_
#define OPTIMD_CHECKPOINT_SNAPSHOT_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "checkpoint/checkpoint.h"
#include "core/backend.h"
#include "core/group.h"
#include "core/snapshot_reservation.h"

namespace optimd {

// A consistent host copy of a session's state (and parameters), taken at a
// step boundary, that a background thread writes while steps go on.
class CheckpointSnapshot {
 public:
  ~CheckpointSnapshot();
  CheckpointSnapshot(const CheckpointSnapshot&) = delete;
  CheckpointSnapshot& operator=(const CheckpointSnapshot&) = delete;
  // Host memory the snapshot holds.
  uint64_t bytes() const;
  // Keeps `reservation` (the snapshot's memory, reserved against the
  // daemon's budget: LockedSession::ReserveSnapshot) until the snapshot is
  // destroyed, and gives it back after the memory is freed.
  void HoldReservation(SnapshotReservation reservation) {
    reservation_.emplace(std::move(reservation));
  }

  // The snapshot as the bytes of a checkpoint file (the same bytes SaveState
  // would write), for streaming. Computes the checksums on first use.
  uint64_t FileSize();
  // Copies file bytes [offset, offset + n) to `out`.
  void ReadFile(uint64_t offset, uint64_t n, uint8_t* out);

 private:
  friend absl::StatusOr<std::unique_ptr<CheckpointSnapshot>> TakeSnapshot(
      const std::vector<Group*>&, Backend*, const CheckpointOptions&);
  friend absl::StatusOr<CheckpointResult> WriteSnapshot(
      const std::string&, const CheckpointSnapshot&, const CheckpointOptions&,
      SaveProgress*);
  struct Data;
  CheckpointSnapshot();
  std::unique_ptr<Data> data_;
  std::optional<SnapshotReservation> reservation_;
};

// Copies the groups' state into host memory (pinned on the CUDA backend).
absl::StatusOr<std::unique_ptr<CheckpointSnapshot>> TakeSnapshot(
    const std::vector<Group*>& groups, Backend* backend,
    const CheckpointOptions& options);

// Writes a snapshot to `path` atomically; thread-compatible, touches no
// session state.
absl::StatusOr<CheckpointResult> WriteSnapshot(
    const std::string& path, const CheckpointSnapshot& snapshot,
    const CheckpointOptions& options, SaveProgress* progress);

}  // namespace optimd

#endif  // OPTIMD_CHECKPOINT_SNAPSHOT_H_
