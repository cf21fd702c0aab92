// Loading a checkpoint file into a session's groups in place: every
// header field checked against the registered groups, every checksum
// verified before any state changes, then the data streamed in (through a
// staging buffer where the host cannot address the state).
//
// Thread-compatible: a load writes the groups, so the caller holds their
// session's lock.
#ifndef OPTIMD_CHECKPOINT_LOADER_H_
#define OPTIMD_CHECKPOINT_LOADER_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "checkpoint/checkpoint.h"
#include "core/backend.h"
#include "core/group.h"

namespace optimd {

// Loads state in place. A corrupt file is DATA_LOSS, and a file that
// changed during the verifying pass ABORTED, with nothing changed. Only a
// file written into by another process during the second pass can fail its
// checksums part-way: then DATA_LOSS with *partially_written set, and the
// state is a mix that must not be stepped until a load succeeds.
absl::StatusOr<CheckpointResult> LoadCheckpoint(
    const std::string& path, const std::vector<Group*>& groups,
    Backend* backend, const CheckpointOptions& options,
    bool* partially_written);

}  // namespace optimd

#endif  // OPTIMD_CHECKPOINT_LOADER_H_
