// The trainer process of a session, as the daemon sees it on its node, so
// that a trainer gone without CloseSession (killed) is noticed: its pid
// and start time, read from /proc (a pid reused by another process has
// another start time).
//
// Thread-compatible (plain values).
#ifndef OPTIMD_CORE_TRAINER_PROCESS_H_
#define OPTIMD_CORE_TRAINER_PROCESS_H_

#include <cstdint>
#include <optional>

namespace optimd {

struct TrainerProcess {
  uint32_t pid = 0;
  uint64_t start_ticks = 0;  // field 22 of /proc/<pid>/stat
};

// The process `pid` as it is now; nullopt when the daemon cannot see it
// (no such process, or the trainer runs in another pid namespace).
std::optional<TrainerProcess> FindTrainerProcess(uint32_t pid);

// True when `p` no longer runs: its pid is free or belongs to a newer
// process.
bool TrainerGone(const TrainerProcess& p);

}  // namespace optimd

#endif  // OPTIMD_CORE_TRAINER_PROCESS_H_
