// Sessions kept across the daemon's own restarts: on SIGTERM every session
// is saved under the save directory (a checkpoint per job and rank, as
// SaveState writes them), and a restarted daemon offers such a checkpoint
// to CreateSession(resume=true) of the same job id and rank.
//
// Layout: <save_dir>/<job directory>/rank-<r>.safetensors, the job
// directory named from the job id (filesystem-safe, with a checksum of the
// whole id; the id itself is in each file's metadata), and beside each
// checkpoint its session's resume secret, rank-<r>.safetensors.secret
// (mode 0600), which a resume must present.
//
// Thread-compatible: SaveAll runs once, after the service drained.
#ifndef OPTIMD_SERVER_RESTART_STORE_H_
#define OPTIMD_SERVER_RESTART_STORE_H_

#include <functional>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "checkpoint/checkpoint.h"
#include "core/session_registry.h"

namespace optimd {

class RestartStore {
 public:
  // An empty `save_dir` keeps nothing across restarts.
  RestartStore(std::string save_dir, CheckpointOptions options)
      : save_dir_(std::move(save_dir)), options_(std::move(options)) {}

  bool enabled() const { return !save_dir_.empty(); }

  // The directory holding the saved checkpoint of `job_id` and `rank`,
  // when there is one.
  std::optional<std::string> Find(const std::string& job_id,
                                  uint32_t rank) const;

  // The resume secret saved with that checkpoint; nullopt when none was
  // (a checkpoint saved before secrets existed).
  std::optional<std::string> SavedSecret(const std::string& job_id,
                                         uint32_t rank) const;

  // Saves every session of `registry` (after any background save still
  // writing has ended), smallest first, within `bound`: logs each start,
  // progress every 10 s and each end (`warn`: a session that could not be
  // saved). When the bound is reached, the sessions not saved are named
  // and `out_of_time` is set: a save is then still writing on a thread of
  // its own, and the caller must end the process without waiting for it.
  struct SaveAllResult {
    int failed = 0;  // sessions not saved, out of time included
    bool out_of_time = false;
  };
  SaveAllResult SaveAll(
      SessionRegistry& registry, absl::Duration bound,
      const std::function<void(const std::string&)>& log,
      const std::function<void(const std::string&)>& warn) const;

  // "<job id reduced to at most 48 of [A-Za-z0-9._-]>-<crc32c of the id>".
  static std::string JobDirectory(const std::string& job_id);

  // The path of the checkpoint of `rank` in `dir` (a directory Find gave).
  static std::string CheckpointPath(const std::string& dir, uint32_t rank);
  // Removes the checkpoint at `checkpoint_path` and its secret: its session
  // has stepped past it (run by Session::RunAfterNextStep).
  static void Forget(const std::string& checkpoint_path);

  // A checkpoint's resume secret is its path plus this.
  static constexpr char kSecretSuffix[] = ".secret";

 private:
  // One session's save with its secret; nothing of it is left on failure.
  absl::StatusOr<CheckpointResult> SaveOne(Session& s,
                                           SaveProgress* progress) const;

  const std::string save_dir_;
  const CheckpointOptions options_;
};

}  // namespace optimd

#endif  // OPTIMD_SERVER_RESTART_STORE_H_
