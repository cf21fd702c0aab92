// Where checkpoints lie: the file name of a rank's checkpoint (and the
// name earlier versions used), and the checks of a directory a client
// names (absolute, existing, within the daemon's --state_dir).
//
// Thread-safe: the functions share no state.
#ifndef OPTIMD_CHECKPOINT_PATHS_H_
#define OPTIMD_CHECKPOINT_PATHS_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "checkpoint/checkpoint.h"

namespace optimd {

// "rank-<rank>.safetensors": a directory holds one job's checkpoint, a
// file per rank, so that a new process (with a new job id) finds its
// rank's file. The job id is in the file's metadata.
std::string CheckpointFileName(uint32_t rank);

// `s` reduced to a file name: every character outside [A-Za-z0-9._-]
// becomes '_', and "job" goes in front of an empty or hidden name.
std::string FileNameOf(absl::string_view s);

// "<job>.rank-<rank>.safetensors", the job id reduced by FileNameOf:
// the name of earlier versions, which LoadState falls back to.
std::string LegacyCheckpointFileName(const std::string& job_id, uint32_t rank);

// Checks `directory` (absolute, existing, within options.state_dir) and
// returns its canonical path.
absl::StatusOr<std::string> ResolveCheckpointDir(
    const std::string& directory, const CheckpointOptions& options);

}  // namespace optimd

#endif  // OPTIMD_CHECKPOINT_PATHS_H_
