#include "server/restart_store.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/crc32c.h"

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

namespace {

std::string SecretPath(const std::string& dir, uint32_t rank) {
  return absl::StrCat(dir, "/", CheckpointFileName(rank),
                      Session::kSecretSuffix);
}

// Writes `secret` to `path`, readable by the daemon's user only.
absl::Status WriteSecret(const std::string& path, const std::string& secret) {
  unlink(path.c_str());
  const int fd = open(
      path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0) {
    return absl::InternalError(
        absl::StrCat("cannot create ", path, ": ", strerror(errno)));
  }
  const bool written = write(fd, secret.data(), secret.size()) ==
                       static_cast<ssize_t>(secret.size());
  const bool closed = close(fd) == 0;
  if (!written || !closed) {
    unlink(path.c_str());
    return absl::InternalError(absl::StrCat("cannot write ", path));
  }
  return absl::OkStatus();
}

}  // namespace

std::optional<std::string> RestartStore::SavedSecret(const std::string& job_id,
                                                     uint32_t rank) const {
  if (!enabled()) return std::nullopt;
  const std::string path =
      SecretPath(absl::StrCat(save_dir_, "/", JobDirectory(job_id)), rank);
  const int fd = open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) return std::nullopt;
  char buf[SessionRegistry::kMaxSecretBytes + 1];
  const ssize_t n = read(fd, buf, sizeof(buf));
  close(fd);
  // Unreadable or oversized: a secret no resume can match.
  if (n < 0 || n > static_cast<ssize_t>(SessionRegistry::kMaxSecretBytes)) {
    return std::string(SessionRegistry::kMaxSecretBytes + 1, '?');
  }
  return std::string(buf, static_cast<size_t>(n));
}

int RestartStore::SaveAll(
    SessionRegistry& registry,
    const std::function<void(const std::string&)>& log,
    const std::function<void(const std::string&)>& warn) const {
  const auto sessions = registry.List();
  // A background save still writing finishes first: its file is the
  // trainer's, and the restart save below needs the session's snapshot.
  for (const auto& s : sessions) {
    if (s->WaitForBackgroundSave()) {
      log(absl::StrCat("waited for the background save of job '",
                       s->identity().job_id, "' rank ", s->identity().rank));
    }
  }
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
      // Without its secret the checkpoint would be open to any resume of
      // that job id: it is not kept then.
      const absl::Status secret =
          WriteSecret(SecretPath(dir, id.rank), s->resume_secret());
      if (!secret.ok()) {
        unlink(saved->path.c_str());
        saved = secret;
      }
    }
    if (saved.ok()) {
      log(absl::StrCat("saved job '", id.job_id, "' rank ", id.rank, ": ",
                       saved->bytes, " bytes in ",
                       absl::StrFormat("%.2f", saved->seconds), " s to ",
                       saved->path));
    } else {
      ++failed;
      rmdir(dir.c_str());  // only if nothing else of the job is there
      warn(absl::StrCat("cannot save job '", id.job_id, "' rank ", id.rank,
                        ": ", saved.status().ToString(),
                        "; its state is lost"));
    }
  }
  return failed;
}

}  // namespace optimd
