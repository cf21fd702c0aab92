#include "checkpoint/temporaries.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <limits>
#include <random>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/stale_files.h"

namespace optimd {

namespace {

constexpr char kTemporaryMark[] = ".tmp-";

// Splits "<final>.tmp-<pid>-<n>" (pid of 1 to 9 digits, n of at least
// one) into its final name and pid; false for any other name.
bool ParseTemporaryName(const std::string& name, std::string* final_name,
                        long* pid) {
  const size_t mark = name.rfind(kTemporaryMark);
  if (mark == std::string::npos || mark == 0) return false;
  const std::string rest = name.substr(mark + sizeof(kTemporaryMark) - 1);
  const size_t dash = rest.find('-');
  if (dash == 0 || dash == std::string::npos || dash > 9 ||
      dash + 1 == rest.size()) {
    return false;
  }
  for (size_t i = 0; i < rest.size(); ++i) {
    if (i != dash && (rest[i] < '0' || rest[i] > '9')) return false;
  }
  *final_name = name.substr(0, mark);
  *pid = std::stol(rest.substr(0, dash));
  return *pid > 0;
}

// Whether the save of process `pid` has ended: the process is gone, or is
// this one (whose saves the caller tells apart by time).
bool WriterGone(long pid) { return pid == getpid() || ProcessGone(pid); }

// Removes `name` in the directory `dir_fd` when it is a regular file
// (owned by this user, if `own_only`) last written before `before`.
bool RemoveIfOld(int dir_fd, const char* name, time_t before, bool own_only) {
  struct stat st;
  if (fstatat(dir_fd, name, &st, AT_SYMLINK_NOFOLLOW) != 0 ||
      !S_ISREG(st.st_mode) || st.st_mtime >= before ||
      (own_only && st.st_uid != geteuid())) {
    return false;
  }
  return unlinkat(dir_fd, name, 0) == 0;
}

// RemoveStaleTemporariesUnder's walk; takes `dir_fd` over.
int RemoveUnder(int dir_fd, int depth_left, time_t before) {
  DIR* d = fdopendir(dir_fd);
  if (d == nullptr) {
    close(dir_fd);
    return 0;
  }
  int removed = 0;
  while (const dirent* e = readdir(d)) {
    const std::string name = e->d_name;
    if (name == "." || name == "..") continue;
    std::string final_name;
    long pid = 0;
    if (ParseTemporaryName(name, &final_name, &pid)) {
      if (absl::EndsWith(final_name, ".safetensors") && WriterGone(pid) &&
          RemoveIfOld(dirfd(d), e->d_name, before, /*own_only=*/true)) {
        ++removed;
      }
      continue;
    }
    if (depth_left > 0 && (e->d_type == DT_DIR || e->d_type == DT_UNKNOWN)) {
      const int sub = openat(dirfd(d), e->d_name,
                             O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
      if (sub >= 0) removed += RemoveUnder(sub, depth_left - 1, before);
    }
  }
  closedir(d);
  return removed;
}

}  // namespace

std::string CheckpointTemporaryPath(const std::string& path) {
  return absl::StrCat(path, kTemporaryMark, getpid(), "-",
                      std::random_device{}());
}

int RemoveStaleTemporaries(const std::string& dir,
                           const std::string& final_name, time_t before) {
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) return 0;
  int removed = 0;
  while (const dirent* e = readdir(d)) {
    std::string name_final;
    long pid = 0;
    // A pid of ours is never mid-save on this name: a session saves one
    // file at a time.
    if (ParseTemporaryName(e->d_name, &name_final, &pid) &&
        name_final == final_name && WriterGone(pid) &&
        RemoveIfOld(dirfd(d), e->d_name, before, /*own_only=*/false)) {
      ++removed;
    }
  }
  closedir(d);
  return removed;
}

int RemoveStaleTemporariesUnder(const std::string& root, int max_depth) {
  const int fd = open(root.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return 0;
  // Nothing of this process's is being written yet: any age is stale.
  return RemoveUnder(fd, max_depth, std::numeric_limits<time_t>::max());
}

}  // namespace optimd
