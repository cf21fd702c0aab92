#include "server/restart_store.h"

#include <sys/stat.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/crc32c.h"

namespace optimd {

std::string RestartStore::JobDirectory(const std::string& job_id) {
  return absl::StrFormat("%s-%08x", FileNameOf(job_id.substr(0, 48)),
                         Crc32cExtend(0, job_id.data(), job_id.size()));
}

std::optional<std::string> RestartStore::Find(const std::string& job_id,
                                              uint32_t rank) const {
  if (!enabled()) return std::nullopt;
  const std::string dir = absl::StrCat(save_dir_, "/", JobDirectory(job_id));
  struct stat st;
  if (lstat(absl::StrCat(dir, "/", CheckpointFileName(rank)).c_str(), &st) !=
          0 ||
      !S_ISREG(st.st_mode)) {
    return std::nullopt;
  }
  return dir;
}

int RestartStore::SaveAll(
    SessionRegistry& registry,
    const std::function<void(const std::string&)>& log) const {
  const auto sessions = registry.List();
  if (!enabled()) {
    if (!sessions.empty()) {
      log(absl::StrCat(sessions.size(),
                       " sessions are dropped: no --save_dir to keep them "
                       "across a restart"));
    }
    return 0;
  }
  log(absl::StrCat("saving ", sessions.size(), " sessions to ", save_dir_));
  int failed = 0;
  for (const auto& s : sessions) {
    const SessionIdentity& id = s->identity();
    const std::string dir =
        absl::StrCat(save_dir_, "/", JobDirectory(id.job_id));
    mkdir(dir.c_str(), 0777);  // the umask decides; an existing one is fine
    auto saved = s->SaveState(dir, options_);
    if (saved.ok()) {
      log(absl::StrCat("saved job '", id.job_id, "' rank ", id.rank, ": ",
                       saved->bytes, " bytes in ",
                       absl::StrFormat("%.2f", saved->seconds), " s to ",
                       saved->path));
    } else {
      ++failed;
      log(absl::StrCat("cannot save job '", id.job_id, "' rank ", id.rank, ": ",
                       saved.status().ToString(), "; its state is lost"));
    }
  }
  return failed;
}

}  // namespace optimd
