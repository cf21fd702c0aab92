// Writing checkpoint files: a session's groups saved from their state in
// place (through a staging buffer where the host cannot address it), and
// the file writing itself, shared with snapshots (snapshot.h). Every write
// goes to a temporary beside the final name, is fsynced and renamed over
// it, and the directory fsynced: a crash or a full disk leaves the previous
// checkpoint intact.
//
// Thread-compatible: a save reads the groups, so the caller holds their
// session's lock (or owns the host copy it writes).
#ifndef OPTIMD_CHECKPOINT_WRITER_H_
#define OPTIMD_CHECKPOINT_WRITER_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/header.h"
#include "core/backend.h"
#include "core/group.h"
#include "nlohmann/json.hpp"

namespace optimd {

// Writes the groups' state, reporting into `progress` if given. The caller
// holds the session's lock, so the state is consistent at a step boundary.
absl::StatusOr<CheckpointResult> SaveCheckpoint(
    const std::string& path, const std::vector<Group*>& groups,
    Backend* backend, const CheckpointOptions& options,
    SaveProgress* progress = nullptr);

// Writes the arranged pieces `entries` with the header made of `meta` to
// `path` atomically, computing their checksums. Their data is in `backend`
// memory, or in host memory when `backend` is null (a snapshot).
absl::StatusOr<CheckpointResult> WriteCheckpointFile(
    const std::string& path, const nlohmann::json& meta,
    std::vector<checkpoint_header::Entry> entries, Backend* backend,
    const CheckpointOptions& options, SaveProgress* progress);

}  // namespace optimd

#endif  // OPTIMD_CHECKPOINT_WRITER_H_
