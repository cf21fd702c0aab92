// Trainers' shared-memory segments whose creator is gone. A trainer names
// each segment after its process ("optimd-py-<pid>-<hex>" from the Python
// client, "optimd-<pid>-<salt>-<n>" from the C++ one) and unlinks it when
// it closes; a daemon unlinks those of sessions it frees. When both die
// (the node's daemon and a trainer killed together), nothing would: the
// daemon removes such files at start. Mappings that still exist are not
// affected (unlinking removes only the name).
#ifndef OPTIMD_CORE_STALE_SEGMENTS_H_
#define OPTIMD_CORE_STALE_SEGMENTS_H_

#include <string>

namespace optimd {

// Whether `name` (a file name, no directory) is a trainer segment's, and
// if so its creator's pid.
bool ParseSegmentName(const std::string& name, long* pid);

// Removes the regular files of `dir` (e.g. /dev/shm) named as trainer
// segments whose creator process is gone and that belong to this user;
// returns how many.
int RemoveStaleSegments(const std::string& dir);

}  // namespace optimd

#endif  // OPTIMD_CORE_STALE_SEGMENTS_H_
