// Where LoadStateStream spools a streamed checkpoint before loading it
// ("<dir>/.optimd-load-<pid>-XXXXXX"), and the removal of the spool files a
// killed daemon left. Thread-safe.
#ifndef OPTIMD_SERVER_SPOOL_FILES_H_
#define OPTIMD_SERVER_SPOOL_FILES_H_

#include <string>

#include "absl/status/status.h"
#include "checkpoint/checkpoint.h"

namespace optimd {

// The spool directory: --state_dir, else /tmp.
std::string SpoolDirectory(const CheckpointOptions& options);

// Removes the spool files in `dir` whose daemon is gone; nothing else.
void RemoveStaleSpoolFiles(const std::string& dir);

// The status of a spool file's failed `what` ("creating", "writing") in
// `dir`, from its errno: RESOURCE_EXHAUSTED when the disk, the quota, the
// file size limit or descriptors ran out; PERMISSION_DENIED when the
// daemon's user may not write there; FAILED_PRECONDITION when the
// directory is gone, read-only or not a directory (set --state_dir);
// UNAVAILABLE for I/O errors of the disk. Each names the directory and
// what to do; nothing was loaded.
absl::Status SpoolFileError(int err, const std::string& what,
                            const std::string& dir);

}  // namespace optimd

#endif  // OPTIMD_SERVER_SPOOL_FILES_H_
