// Checkpoints of a session's optimizer state: one safetensors file per
// session that the `safetensors` library reads as it is.
//
// Tensors (1-D, little-endian): `<name>` the parameter read from the
// trainer's buffer; `<name>.master` (F32) or `<name>.remainder` (I16) where
// the layout keeps one; `<name>.exp_avg`, `<name>.exp_avg_sq` and, with
// amsgrad, `<name>.max_exp_avg_sq` (moment dtype). Zero-element tensors keep
// their entries with shape [0]. The header's __metadata__ holds one key,
// "optimd": JSON with the format version, and per group its id, step
// counter, hyperparameters and tensors (name, numel, layout, frozen), and a
// crc32c of every tensor's bytes.
//
// That is format version 1. A session whose version 1 header could come
// near the 100 MiB header limit (about 110,000 tensors) is saved packed,
// version 2: one safetensors tensor per group, kind and dtype
// ("g<group>.<kind>.<dtype>"), the pieces concatenated in tensor order, and
// per tensor [name, numel, layout index, flags] with a table of layouts.
//
// Saving writes a temporary file in the target directory, fsyncs it, renames
// it over the final name and fsyncs the directory: a crash or a full disk
// leaves the previous checkpoint intact. Loading checks every name, shape,
// dtype and layout against the registered groups, then reads the file twice
// whatever its size: a first pass verifies every checksum and changes
// nothing, the second streams the data in place, checking them again.
#ifndef OPTIMD_CORE_CHECKPOINT_H_
#define OPTIMD_CORE_CHECKPOINT_H_

#include <atomic>
#include <cstdint>
#include <ctime>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/backend.h"
#include "core/group.h"

namespace optimd {

// The newest format read: 1 (one safetensors tensor per piece of state,
// "<name>.exp_avg") and 2 (packed: one per kind and dtype of a group, for
// sessions whose per-tensor header would not fit).
inline constexpr int kCheckpointFormatVersion = 2;
// The largest header read or written: the `safetensors` library's limit.
inline constexpr uint64_t kMaxCheckpointHeaderBytes = uint64_t{100} << 20;

struct CheckpointOptions {
  // When not empty, checkpoints may only be written to or read from this
  // directory or below it (PERMISSION_DENIED otherwise).
  std::string state_dir;
  // Staging buffer for backends whose memory the host cannot address.
  uint64_t staging_bytes = uint64_t{64} << 20;
  // Sessions whose per-tensor (version 1) header could take more than this
  // many bytes (an estimate that errs high) are saved packed (version 2).
  uint64_t packed_above_header_bytes = kMaxCheckpointHeaderBytes / 2;
  // Written into the metadata ("job_id") of saves, for the record.
  std::string job_id;
  // Tests only (the daemon never sets it, and no flag reaches it): called
  // with the file's path between a load's verifying pass and the check
  // that the file is still what that pass read, so that a test can change
  // the file there. Empty: nothing is called.
  std::function<void(const std::string& path)> after_verifying_pass;
};

struct CheckpointResult {
  std::string path;
  uint64_t bytes = 0;               // file size
  uint64_t peak_staging_bytes = 0;  // extra memory used while streaming
  double seconds = 0;
};

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

// Progress of a save, readable from other threads.
struct SaveProgress {
  std::atomic<uint64_t> bytes_written{0};
  std::atomic<uint64_t> total_bytes{0};
};

// Writes the groups' state, reporting into `progress` if given. The caller
// holds the session's lock, so the state is consistent at a step boundary.
absl::StatusOr<CheckpointResult> SaveCheckpoint(
    const std::string& path, const std::vector<Group*>& groups,
    Backend* backend, const CheckpointOptions& options,
    SaveProgress* progress = nullptr);

// A consistent host copy of a session's state (and parameters), taken at a
// step boundary, that a background thread writes while steps go on.
class CheckpointSnapshot {
 public:
  ~CheckpointSnapshot();
  CheckpointSnapshot(const CheckpointSnapshot&) = delete;
  CheckpointSnapshot& operator=(const CheckpointSnapshot&) = delete;
  // Host memory the snapshot holds.
  uint64_t bytes() const;
  // Runs `fn` when the snapshot is destroyed, after its memory is freed
  // (it returns the memory's reservation; see Session::ReserveSnapshot).
  void OnDestroy(std::function<void()> fn) { on_destroy_ = std::move(fn); }

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
  std::function<void()> on_destroy_;
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

#endif  // OPTIMD_CORE_CHECKPOINT_H_
