#include "common/stale_files.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"

namespace optimd {
namespace {

bool AllHex(absl::string_view s) {
  if (s.empty()) return false;
  for (char c : s) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}

bool AllDigits(absl::string_view s) {
  if (s.empty()) return false;
  for (char c : s) {
    if (c < '0' || c > '9') return false;
  }
  return true;
}

}  // namespace

bool ProcessGone(long pid) {
  return kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH;
}

bool ParseSegmentName(const std::string& name, long* pid) {
  if (!absl::StartsWith(name, "optimd-")) return false;
  const std::vector<absl::string_view> parts =
      absl::StrSplit(absl::string_view(name).substr(7), '-');
  int64_t value = 0;
  if (parts.size() == 3 && parts[0] == "py" && AllHex(parts[2]) &&
      AllDigits(parts[1]) && parts[1].size() <= 9 &&
      absl::SimpleAtoi(parts[1], &value)) {
    *pid = static_cast<long>(value);  // optimd-py-<pid>-<hex>
    return value > 0;
  }
  if (parts.size() == 3 && AllDigits(parts[0]) && parts[0].size() <= 9 &&
      AllDigits(parts[1]) && AllDigits(parts[2]) &&
      absl::SimpleAtoi(parts[0], &value)) {
    *pid = static_cast<long>(value);  // optimd-<pid>-<salt>-<n>
    return value > 0;
  }
  return false;
}

int RemoveFilesOfGoneProcesses(
    const std::string& dir,
    const std::function<bool(const std::string& name, long* pid)>& pid_of) {
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) return 0;
  int removed = 0;
  while (const dirent* e = readdir(d)) {
    long pid = 0;
    if (!pid_of(e->d_name, &pid) || pid == getpid() || !ProcessGone(pid)) {
      continue;
    }
    struct stat st;
    if (fstatat(dirfd(d), e->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0 ||
        !S_ISREG(st.st_mode) || st.st_uid != geteuid()) {
      continue;
    }
    if (unlinkat(dirfd(d), e->d_name, 0) == 0) ++removed;
  }
  closedir(d);
  return removed;
}

int RemoveStaleSegments(const std::string& dir) {
  return RemoveFilesOfGoneProcesses(dir, ParseSegmentName);
}

}  // namespace optimd
