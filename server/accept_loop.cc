#include "server/accept_loop.h"

#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "server/log.h"

namespace optimd {

namespace {

// The longest wait between tries while descriptors are exhausted.
constexpr int kMaxRetryWaitMs = 100;

std::string OpenFilesLimit() {
  rlimit limit{};
  if (getrlimit(RLIMIT_NOFILE, &limit) != 0) return "unknown";
  return limit.rlim_cur == RLIM_INFINITY ? std::string("unlimited")
                                         : absl::StrCat(limit.rlim_cur);
}

}  // namespace

absl::Status AcceptLoop::Start(std::vector<UniqueFd> listeners,
                               HandOver hand_over) {
  wake_fd_.reset(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!wake_fd_.valid()) {
    return absl::InternalError(
        absl::StrCat("cannot create an eventfd: ", std::strerror(errno)));
  }
  spare_fd_.reset(open("/dev/null", O_RDONLY | O_CLOEXEC));
  listeners_ = std::move(listeners);
  hand_over_ = std::move(hand_over);
  thread_ = std::thread([this] { Run(); });
  pthread_setname_np(thread_.native_handle(), "optimd-accept");
  return absl::OkStatus();
}

void AcceptLoop::Stop() {
  if (!thread_.joinable()) return;
  const uint64_t one = 1;
  // An eventfd's counter only fails to take a write when it would
  // overflow, which a single write cannot make it.
  (void)!write(wake_fd_.get(), &one, sizeof(one));
  thread_.join();
  listeners_.clear();  // connections still waiting are refused
}

void AcceptLoop::Run() {
  std::vector<pollfd> fds(1 + listeners_.size());
  fds[0] = {wake_fd_.get(), POLLIN, 0};
  for (size_t i = 0; i < listeners_.size(); ++i) {
    fds[1 + i] = {listeners_[i].get(), POLLIN, 0};
  }
  int retry_ms = 0;  // > 0: accepting failed; try again after this long
  for (;;) {
    // While waiting to retry, only Stop may wake the loop: a listening
    // socket stays readable as long as connections wait.
    const nfds_t watched = retry_ms > 0 ? 1 : fds.size();
    for (pollfd& p : fds) p.revents = 0;
    const int ready = poll(fds.data(), watched, retry_ms > 0 ? retry_ms : -1);
    if (ready < 0 && errno != EINTR) {
      retry_ms = kMaxRetryWaitMs;  // ENOMEM: wait for memory
      continue;
    }
    if (fds[0].revents != 0) return;
    if (ready < 0) continue;  // EINTR
    bool out = false;
    for (size_t i = 1; i < fds.size(); ++i) {
      // After a wait every listener is tried again.
      if (watched == 1 || fds[i].revents != 0) {
        out = !AcceptWaiting(fds[i].fd) || out;
      }
    }
    retry_ms = out ? std::min(kMaxRetryWaitMs, std::max(1, retry_ms * 2)) : 0;
  }
}

bool AcceptLoop::AcceptWaiting(int listener) {
  for (;;) {
    const int fd =
        accept4(listener, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd >= 0) {
      if (exhausted_) {
        exhausted_ = false;
        log::Info(absl::StrCat("accepting connections on ", what_, " again; ",
                               refused(),
                               " refused in all while out of descriptors"));
      }
      hand_over_(listener, fd);  // which owns the connection from here on
      continue;
    }
    const int err = errno;
    if (err == EAGAIN || err == EWOULDBLOCK) return true;
    // The waiting connection was closed meanwhile, or a signal came.
    if (err == EINTR || err == ECONNABORTED) continue;
    if (err != EMFILE && err != ENFILE) return false;  // ENOBUFS, ENOMEM
    if (!exhausted_) {
      exhausted_ = true;
      log::Warn(absl::StrCat(
          "out of file descriptors (", std::strerror(err),
          "; open files limit ", OpenFilesLimit(), "): connections to ", what_,
          " are closed unserved until descriptors come free"));
    }
    // accept() takes the new descriptor before it looks for a
    // connection, so it fails so even when none waits.
    switch (RefuseOne(listener)) {
      case Refusal::kRefused:
        continue;
      case Refusal::kNoneWaiting:
        return true;
      case Refusal::kStillOut:
        return false;
    }
  }
}

AcceptLoop::Refusal AcceptLoop::RefuseOne(int listener) {
  if (!spare_fd_.valid()) {
    spare_fd_.reset(open("/dev/null", O_RDONLY | O_CLOEXEC));
    if (!spare_fd_.valid()) return Refusal::kStillOut;
  }
  spare_fd_.reset();
  int err = 0;
  {
    const UniqueFd refused(accept4(listener, nullptr, nullptr, SOCK_CLOEXEC));
    err = refused.valid() ? 0 : errno;
    if (refused.valid()) refused_.fetch_add(1);
  }
  spare_fd_.reset(open("/dev/null", O_RDONLY | O_CLOEXEC));
  if (err == EAGAIN || err == EWOULDBLOCK) return Refusal::kNoneWaiting;
  if (err == EMFILE || err == ENFILE) return Refusal::kStillOut;
  return Refusal::kRefused;  // or gone meanwhile (ECONNABORTED, EINTR)
}

}  // namespace optimd
