// Where LoadStateStream spools a streamed checkpoint before loading it
// ("<dir>/.optimd-load-<pid>-XXXXXX"), and the removal of the spool files a
// killed daemon left. Thread-safe.
#ifndef OPTIMD_SERVER_SPOOL_FILES_H_
#define OPTIMD_SERVER_SPOOL_FILES_H_

#include <string>

#include "checkpoint/checkpoint.h"

namespace optimd {

// The spool directory: --state_dir, else /tmp.
std::string SpoolDirectory(const CheckpointOptions& options);

// Removes the spool files in `dir` whose daemon is gone; nothing else.
void RemoveStaleSpoolFiles(const std::string& dir);

}  // namespace optimd

#endif  // OPTIMD_SERVER_SPOOL_FILES_H_
