// Files named after a process that is gone: removed when the daemon starts
// (or, for spool files, when the service starts), since nothing else would.
// - Trainers' shared-memory segments ("optimd-py-<pid>-<hex>" from the
//   Python client, "optimd-<pid>-<salt>-<n>" from the C++ one): a trainer
//   unlinks its own when it closes, a daemon those of sessions it frees;
//   when both die together, nothing would. Mappings that still exist are
//   not affected (unlinking removes only the name).
// - The daemon's spool files of incoming checkpoint streams
//   (server/spool_files.h).
#ifndef OPTIMD_COMMON_STALE_FILES_H_
#define OPTIMD_COMMON_STALE_FILES_H_

#include <functional>
#include <string>

namespace optimd {

// True when no process `pid` exists (one of another user exists).
bool ProcessGone(long pid);

// Removes the regular files of `dir` that belong to this user and whose
// name `pid_of` reads a pid from (returning false for other names), when
// that process is gone and is not this one; returns how many.
int RemoveFilesOfGoneProcesses(
    const std::string& dir,
    const std::function<bool(const std::string& name, long* pid)>& pid_of);

// Whether `name` (a file name, no directory) is a trainer segment's, and
// if so its creator's pid.
bool ParseSegmentName(const std::string& name, long* pid);

// RemoveFilesOfGoneProcesses over trainer segments in `dir` (/dev/shm).
int RemoveStaleSegments(const std::string& dir);

}  // namespace optimd

#endif  // OPTIMD_COMMON_STALE_FILES_H_
