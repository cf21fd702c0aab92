#include "server/spool_files.h"

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

}  // namespace optimd
