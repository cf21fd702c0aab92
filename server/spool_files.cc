#include "server/spool_files.h"

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/stale_files.h"

namespace optimd {

std::string SpoolDirectory(const CheckpointOptions& options) {
  return options.state_dir.empty() ? std::string("/tmp") : options.state_dir;
}

void RemoveStaleSpoolFiles(const std::string& dir) {
  const std::string prefix = ".optimd-load-";
  RemoveFilesOfGoneProcesses(dir, [&](const std::string& name, long* pid) {
    if (name.compare(0, prefix.size(), prefix) != 0) return false;
    const size_t dash = name.find('-', prefix.size());
    if (dash == std::string::npos) return false;
    const std::string digits = name.substr(prefix.size(), dash - prefix.size());
    if (digits.empty() || digits.size() > 9 ||
        digits.find_first_not_of("0123456789") != std::string::npos) {
      return false;
    }
    *pid = std::stol(digits);
    return true;
  });
}

absl::Status SpoolFileError(int err, const std::string& what,
                            const std::string& dir) {
  const std::string head =
      absl::StrCat(what, " the spool file of the streamed checkpoint in ", dir,
                   " failed (", std::strerror(err), "); nothing was loaded: ");
  switch (err) {
    case ENOSPC:
    case EDQUOT:
      return absl::ResourceExhaustedError(
          absl::StrCat(head,
                       "free space there (the stream needs its whole size) or "
                       "load the file with LoadState"));
    case EFBIG:
      return absl::ResourceExhaustedError(
          absl::StrCat(head,
                       "the daemon's file size limit (ulimit -f) is below the "
                       "checkpoint's size: raise it, or load the file with "
                       "LoadState"));
    case EMFILE:
    case ENFILE:
      return absl::ResourceExhaustedError(
          absl::StrCat(head,
                       "the daemon is out of file descriptors: retry "
                       "once other calls ended, or raise its limit"));
    case EACCES:
    case EPERM:
      return absl::PermissionDeniedError(
          absl::StrCat(head,
                       "give the daemon's user write access there, or point "
                       "--state_dir at a directory it may write"));
    case ENOENT:
    case ENOTDIR:
    case EROFS:
      return absl::FailedPreconditionError(absl::StrCat(
          head,
          "the daemon spools in --state_dir (else /tmp): make it a "
          "writable directory, or restart the daemon with another"));
    case EIO:
      return absl::UnavailableError(
          absl::StrCat(head,
                       "the disk reported an I/O error: retry, or "
                       "check the disk"));
  }
  return absl::FailedPreconditionError(
      absl::StrCat(head,
                   "check that --state_dir (else /tmp) is a writable directory "
                   "with free space"));
}

}  // namespace optimd
