#include "checkpoint/paths.h"

#include <limits.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstdlib>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "checkpoint/file_io.h"

namespace optimd {

std::string CheckpointFileName(uint32_t rank) {
  return absl::StrCat("rank-", rank, ".safetensors");
}

std::string FileNameOf(absl::string_view s) {
  std::string name;
  for (char c : s) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
                    (c >= '0' && c <= '9') || c == '.' || c == '_' || c == '-';
    name.push_back(ok ? c : '_');
  }
  if (name.empty() || name[0] == '.') name = "job" + name;
  return name;
}

std::string LegacyCheckpointFileName(const std::string& job_id, uint32_t rank) {
  return absl::StrCat(FileNameOf(job_id), ".rank-", rank, ".safetensors");
}

absl::StatusOr<std::string> ResolveCheckpointDir(
    const std::string& directory, const CheckpointOptions& options) {
  // The file system's calls stop at a NUL: the path written would not be
  // the path given.
  if (directory.find('\0') != std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("checkpoint directory '", absl::CHexEscape(directory),
                     "' holds a NUL byte; give the directory's path alone"));
  }
  if (directory.empty() || directory[0] != '/') {
    return absl::InvalidArgumentError(
        absl::StrCat("checkpoint directory '", directory,
                     "' must be an absolute path on the daemon's machine"));
  }
  char resolved[PATH_MAX];
  if (realpath(directory.c_str(), resolved) == nullptr) {
    return ErrnoStatus(errno, absl::StrCat("checkpoint directory ", directory));
  }
  struct stat st;
  if (stat(resolved, &st) != 0 || !S_ISDIR(st.st_mode)) {
    return absl::FailedPreconditionError(
        absl::StrCat(directory, " is not a directory"));
  }
  std::string dir = resolved;
  if (!options.state_dir.empty()) {
    char root[PATH_MAX];
    if (realpath(options.state_dir.c_str(), root) == nullptr) {
      return absl::FailedPreconditionError(absl::StrCat(
          "the daemon's --state_dir ", options.state_dir, " does not exist"));
    }
    const std::string r = root;
    if (dir != r && !absl::StartsWith(dir, r + "/")) {
      return absl::PermissionDeniedError(
          absl::StrCat(directory, " is outside the daemon's --state_dir ", r,
                       "; checkpoints may only be written and read there"));
    }
  }
  return dir;
}

}  // namespace optimd
