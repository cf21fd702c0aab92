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

#include "core/checkpoint.h"
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
  // writing has ended), logging each (`warn`: a session that could not be
  // saved); returns how many could not be saved.
  int SaveAll(SessionRegistry& registry,
              const std::function<void(const std::string&)>& log,
              const std::function<void(const std::string&)>& warn) const;

  // "<job id reduced to at most 48 of [A-Za-z0-9._-]>-<crc32c of the id>".
  static std::string JobDirectory(const std::string& job_id);

 private:
  const std::string save_dir_;
  const CheckpointOptions options_;
};

}  // namespace optimd

#endif  // OPTIMD_SERVER_RESTART_STORE_H_
