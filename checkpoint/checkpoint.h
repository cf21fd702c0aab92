// Checkpoints of a session's optimizer state: one safetensors file per
// session that the `safetensors` library reads as it is. This header holds
// the format's description, its limits and the options and results every
// part of the package shares: paths.h (file names, directories), writer.h
// (a save from the state in place), snapshot.h (a host copy, written in the
// background or streamed), loader.h (a load in place), header.h (the
// safetensors header), temporaries.h, session_checkpoint.h (a session's
// state saved, snapshotted and loaded whole), and key_names.h (tensor
// names whose keys would collide, refused at registration).
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
#ifndef OPTIMD_CHECKPOINT_CHECKPOINT_H_
#define OPTIMD_CHECKPOINT_CHECKPOINT_H_

#include <atomic>
#include <cstdint>
#include <string>

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
};

struct CheckpointResult {
  std::string path;
  uint64_t bytes = 0;               // file size
  uint64_t peak_staging_bytes = 0;  // extra memory used while streaming
  double seconds = 0;
};

// Progress of a save, readable from other threads.
struct SaveProgress {
  std::atomic<uint64_t> bytes_written{0};
  std::atomic<uint64_t> total_bytes{0};
};

}  // namespace optimd

#endif  // OPTIMD_CHECKPOINT_CHECKPOINT_H_
