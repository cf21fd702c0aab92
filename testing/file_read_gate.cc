#include "testing/file_read_gate.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/fanotify.h>
#include <unistd.h>

#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace optimd {

absl::StatusOr<std::unique_ptr<FileReadGate>> FileReadGate::Create(
    const std::string& path) {
  UniqueFd fan(fanotify_init(FAN_CLASS_CONTENT | FAN_CLOEXEC | FAN_NONBLOCK,
                             O_RDONLY | O_LARGEFILE));
  if (!fan.valid()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "fanotify_init: ", std::strerror(errno),
        " (holding a file's reads needs CAP_SYS_ADMIN and a kernel with "
        "fanotify permission events)"));
  }
  if (fanotify_mark(fan.get(), FAN_MARK_ADD, FAN_ACCESS_PERM, AT_FDCWD,
                    path.c_str()) != 0) {
    const int err = errno;
    const std::string what =
        absl::StrCat("fanotify_mark ", path, ": ", std::strerror(err));
    // EINVAL: a kernel without permission events for reads.
    if (err == EINVAL || err == EPERM) {
      return absl::FailedPreconditionError(what);
    }
    return absl::InternalError(what);
  }
  return std::unique_ptr<FileReadGate>(new FileReadGate(std::move(fan)));
}

absl::Status FileReadGate::HoldNextRead(pid_t reader, absl::Duration timeout) {
  if (!fanotify_.valid()) {
    return absl::FailedPreconditionError("the gate was opened");
  }
  const absl::Time deadline = absl::Now() + timeout;
  alignas(fanotify_event_metadata) char buf[4096];
  while (true) {
    const int64_t left_ms = absl::ToInt64Milliseconds(deadline - absl::Now());
    if (left_ms <= 0) {
      return absl::DeadlineExceededError(
          absl::StrCat("process ", reader, " did not read the file within ",
                       absl::FormatDuration(timeout)));
    }
    pollfd p{fanotify_.get(), POLLIN, 0};
    if (poll(&p, 1, static_cast<int>(left_ms)) <= 0) continue;
    const ssize_t n = read(fanotify_.get(), buf, sizeof(buf));
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) continue;
    if (n < 0) {
      return absl::InternalError(
          absl::StrCat("reading fanotify events: ", std::strerror(errno)));
    }
    bool held = false;
    auto* e = reinterpret_cast<fanotify_event_metadata*>(buf);
    for (ssize_t len = n; FAN_EVENT_OK(e, len); e = FAN_EVENT_NEXT(e, len)) {
      if (e->fd < 0) continue;
      if (!held && e->pid == reader && (e->mask & FAN_ACCESS_PERM) != 0) {
        held_.push_back(e->fd);
        held = true;
      } else if (held && e->pid == reader) {
        held_.push_back(e->fd);  // held behind the first
      } else {
        Allow(e->fd);
      }
    }
    if (held) return absl::OkStatus();
  }
}

void FileReadGate::Allow(int event_fd) {
  fanotify_response r{event_fd, FAN_ALLOW};
  // A failed answer leaves the read to the kernel, which allows every
  // pending one when the fanotify descriptor closes.
  (void)!write(fanotify_.get(), &r, sizeof(r));
  close(event_fd);
}

void FileReadGate::Open() {
  if (!fanotify_.valid()) return;
  for (int fd : held_) Allow(fd);
  held_.clear();
  // Closing the descriptor removes the mark and allows the reads that
  // arrived meanwhile.
  fanotify_.reset();
}

}  // namespace optimd
