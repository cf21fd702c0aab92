#include "server/restart_store.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "checkpoint/paths.h"
#include "checkpoint/session_checkpoint.h"
#include "common/crc32c.h"

namespace optimd {

std::string RestartStore::JobDirectory(const std::string& job_id) {
  return absl::StrFormat("%s-%08x", FileNameOf(job_id.substr(0, 48)),
                         Crc32cExtend(0, job_id.data(), job_id.size()));
}

std::string RestartStore::CheckpointPath(const std::string& dir,
                                         uint32_t rank) {
  return absl::StrCat(dir, "/", CheckpointFileName(rank));
}

void RestartStore::Forget(const std::string& checkpoint_path) {
  unlink(checkpoint_path.c_str());
  unlink((checkpoint_path + kSecretSuffix).c_str());
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
  return absl::StrCat(RestartStore::CheckpointPath(dir, rank),
                      RestartStore::kSecretSuffix);
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

namespace {

// One session's restart save, run on a thread of its own so that the
// shutdown can log its progress and stop waiting at the time bound. Shared
// with that thread, which outlives the wait when the bound is reached.
struct RestartSave {
  std::atomic<bool> done{false};
  SaveProgress progress;
  absl::StatusOr<CheckpointResult> result = absl::UnknownError("not run");
};

std::string Describe(const SessionIdentity& id) {
  return absl::StrCat("job '", id.job_id, "' rank ", id.rank);
}

// Smallest first: within the time bound, as many sessions as can be.
void SortBySize(std::vector<std::shared_ptr<Session>>& sessions) {
  std::vector<std::pair<uint64_t, std::shared_ptr<Session>>> sized;
  for (auto& s : sessions) {
    const SessionInfo info = s->Info();
    sized.emplace_back(info.state_bytes + info.param_bytes, std::move(s));
  }
  std::stable_sort(
      sized.begin(), sized.end(),
      [](const auto& a, const auto& b) { return a.first < b.first; });
  sessions.clear();
  for (auto& [bytes, s] : sized) sessions.push_back(std::move(s));
}

// Waits for `save` until `deadline`, logging its progress every
// kProgressEvery; false when the deadline came first.
bool AwaitSave(const RestartSave& save, const std::string& what,
               absl::Time deadline,
               const std::function<void(const std::string&)>& log) {
  constexpr absl::Duration kProgressEvery = absl::Seconds(10);
  const absl::Time start = absl::Now();
  absl::Time next_report = start + kProgressEvery;
  while (!save.done.load()) {
    const absl::Time now = absl::Now();
    if (now >= deadline) return false;
    if (now >= next_report) {
      const uint64_t written = save.progress.bytes_written.load();
      const uint64_t total = save.progress.total_bytes.load();
      log(absl::StrCat(
          "saving ", what, ": ", written, " of ", total, " bytes (",
          absl::StrFormat("%.0f", total ? 100.0 * written / total : 0.0),
          "%) in ", absl::FormatDuration(now - start)));
      next_report = now + kProgressEvery;
    }
    absl::SleepFor(std::min(absl::Milliseconds(5), deadline - now));
  }
  return true;
}

}  // namespace

absl::StatusOr<CheckpointResult> RestartStore::SaveOne(
    Session& s, SaveProgress* progress) const {
  const SessionIdentity& id = s.identity();
  const std::string dir = absl::StrCat(save_dir_, "/", JobDirectory(id.job_id));
  mkdir(dir.c_str(), 0777);  // the umask decides; an existing one is fine
  auto saved =
      SaveSession(s, dir, options_, /*background=*/false, nullptr, progress);
  if (saved.ok()) {
    // Without its secret the checkpoint would be open to any resume of
    // that job id: it is not kept then.
    const absl::Status secret =
        WriteSecret(SecretPath(dir, id.rank), s.resume_secret());
    if (!secret.ok()) {
      unlink(saved->path.c_str());
      saved = secret;
    }
  }
  if (!saved.ok()) rmdir(dir.c_str());  // only if nothing else of the job is
  return saved;
}

RestartStore::SaveAllResult RestartStore::SaveAll(
    SessionRegistry& registry, absl::Duration bound,
    const std::function<void(const std::string&)>& log,
    const std::function<void(const std::string&)>& warn) const {
  SaveAllResult out;
  auto sessions = registry.List();
  // A background save still writing finishes first: its file is the
  // trainer's, and the restart save below needs the session's snapshot.
  for (const auto& s : sessions) {
    if (WaitForBackgroundSave(*s)) {
      log("waited for the background save of " + Describe(s->identity()));
    }
  }
  if (!enabled()) {
    if (!sessions.empty()) {
      log(absl::StrCat(sessions.size(),
                       " sessions are dropped: no --save_dir to keep them "
                       "across a restart"));
    }
    return out;
  }
  SortBySize(sessions);
  const absl::Time deadline = absl::Now() + bound;
  log(absl::StrCat("saving ", sessions.size(), " sessions to ", save_dir_,
                   ", smallest first, within ", absl::FormatDuration(bound)));
  for (size_t i = 0; i < sessions.size(); ++i) {
    const std::string what = Describe(sessions[i]->identity());
    log(absl::StrCat("saving ", what, " (", i + 1, " of ", sessions.size(),
                     ")"));
    auto save = std::make_shared<RestartSave>();
    std::thread writer([this, save, s = sessions[i]] {
      save->result = SaveOne(*s, &save->progress);
      save->done.store(true);
    });
    if (!AwaitSave(*save, what, deadline, log)) {
      // The writer cannot be stopped part-way; the process ends without
      // it, and the next start removes its temporary file.
      writer.detach();
      std::string lost;
      for (size_t j = i; j < sessions.size(); ++j) {
        absl::StrAppend(&lost, j > i ? ", " : "",
                        Describe(sessions[j]->identity()));
      }
      warn(absl::StrCat("the shutdown save ran out of its ",
                        absl::FormatDuration(bound),
                        " (--shutdown_save_s); not saved, their state is "
                        "lost: ",
                        lost));
      out.failed += static_cast<int>(sessions.size() - i);
      out.out_of_time = true;
      return out;
    }
    writer.join();
    if (save->result.ok()) {
      log(absl::StrCat("saved ", what, ": ", save->result->bytes, " bytes in ",
                       absl::StrFormat("%.2f", save->result->seconds), " s to ",
                       save->result->path));
    } else {
      ++out.failed;
      warn(absl::StrCat("cannot save ", what, ": ",
                        save->result.status().ToString(),
                        "; its state is lost"));
    }
  }
  return out;
}

}  // namespace optimd
