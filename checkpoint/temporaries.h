// The temporary files of checkpoint saves: how they are named, and removing
// those that saves killed midway left behind.
//
// A save writes "<final name>.tmp-<pid>-<n>" beside its file (<pid> the
// writer's process, <n> a random number), then renames it over the final
// name. A writer killed before the rename leaves its temporary, as large
// as the checkpoint, for good: the next save of the same file removes it,
// and the daemon removes those in the directories it owns at start.
//
// Thread-safe: the functions share no state. A temporary is removed only
// when its writer is gone (or is this process and wrote it before the
// given time), so a save in progress elsewhere is never disturbed.
#ifndef OPTIMD_CHECKPOINT_TEMPORARIES_H_
#define OPTIMD_CHECKPOINT_TEMPORARIES_H_

#include <ctime>
#include <string>

namespace optimd {

// A fresh temporary name for a save to `path`, written by this process.
std::string CheckpointTemporaryPath(const std::string& path);

// Removes temporary files that saves to `dir`/`final_name` left behind
// (regular files only) when their process is gone (or is this one) and
// they were last written before `before`. Files of any other name are
// never touched. Returns how many it removed. SaveCheckpoint and
// WriteSnapshot call it before each write.
int RemoveStaleTemporaries(const std::string& dir,
                           const std::string& final_name, time_t before);

// How deep below its root RemoveStaleTemporariesUnder looks: the save
// directory's checkpoints are one level down (a directory per job); those
// in --state_dir wherever clients put them.
inline constexpr int kTemporarySearchDepth = 4;

// For the daemon's start, before it saves anything: removes, in `root` and
// the directories below it up to `max_depth` levels (symbolic links are
// not followed), the temporaries of checkpoints
// ("*.safetensors.tmp-<pid>-<n>") that are regular files of this user and
// whose writer is gone. A temporary named with this process's pid is an
// earlier process's (pids are reused; in a container the daemon may be
// pid 1 every time) and is removed too. Returns how many it removed.
int RemoveStaleTemporariesUnder(const std::string& root, int max_depth);

}  // namespace optimd

#endif  // OPTIMD_CHECKPOINT_TEMPORARIES_H_
