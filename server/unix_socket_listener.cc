#include "server/unix_socket_listener.h"

#include <fcntl.h>
#include <grpcpp/server_posix.h>
#include <poll.h>
#include <pthread.h>
#include <sys/eventfd.h>
#include <sys/file.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
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

absl::Status ErrnoError(int err, const std::string& what) {
  return absl::InternalError(absl::StrCat(what, ": ", std::strerror(err)));
}

// The socket address of `path`; INVALID_ARGUMENT when it does not fit.
absl::StatusOr<sockaddr_un> SocketAddress(const std::string& path) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.empty() || path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(
        absl::StrCat("a Unix socket path must have 1 to ",
                     sizeof(addr.sun_path) - 1, " bytes: '", path, "'"));
  }
  std::memcpy(addr.sun_path, path.data(), path.size());
  return addr;
}

// Locks "<socket_path>.lock". The lock is re-checked against the path
// after locking: a daemon that is stopping unlinks its lock file, and a
// lock taken on that unlinked file would guard nothing.
absl::StatusOr<UniqueFd> LockSocketPath(const std::string& socket_path) {
  const std::string lock_path = socket_path + ".lock";
  for (int attempt = 0; attempt < 10; ++attempt) {
    UniqueFd fd(open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600));
    if (!fd.valid()) {
      return ErrnoError(errno,
                        absl::StrCat("cannot open the lock file ", lock_path));
    }
    if (flock(fd.get(), LOCK_EX | LOCK_NB) != 0) {
      if (errno == EWOULDBLOCK) {
        return absl::AlreadyExistsError(
            absl::StrCat("another daemon holds ", lock_path, " (it serves ",
                         socket_path, "); stop it or pass another --listen"));
      }
      return ErrnoError(errno, absl::StrCat("cannot lock ", lock_path));
    }
    struct stat locked, named;
    if (fstat(fd.get(), &locked) == 0 && stat(lock_path.c_str(), &named) == 0 &&
        locked.st_dev == named.st_dev && locked.st_ino == named.st_ino) {
      return fd;
    }
    // The file was replaced meanwhile: lock the new one.
  }
  return absl::UnavailableError(
      absl::StrCat("cannot lock ", lock_path, ": it keeps being replaced"));
}

// Removes a stale socket file left by a daemon that died; refuses a live
// one. Called with the socket's lock held.
absl::Status RemoveStaleSocket(const std::string& path,
                               const sockaddr_un& addr) {
  struct stat st;
  if (lstat(path.c_str(), &st) != 0) return absl::OkStatus();
  if (!S_ISSOCK(st.st_mode)) {
    return absl::FailedPreconditionError(absl::StrCat(
        path, " exists and is not a socket; refusing to replace it"));
  }
  UniqueFd probe(socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (probe.valid() &&
      connect(probe.get(), reinterpret_cast<const sockaddr*>(&addr),
              sizeof(addr)) == 0) {
    return absl::AlreadyExistsError(
        absl::StrCat("another daemon is listening on ", path,
                     "; stop it or pass another --listen"));
  }
  unlink(path.c_str());
  return absl::OkStatus();
}

std::string OpenFilesLimit() {
  rlimit limit{};
  if (getrlimit(RLIMIT_NOFILE, &limit) != 0) return "unknown";
  return limit.rlim_cur == RLIM_INFINITY ? std::string("unlimited")
                                         : absl::StrCat(limit.rlim_cur);
}

}  // namespace

absl::StatusOr<std::unique_ptr<UnixSocketListener>> UnixSocketListener::Claim(
    const std::string& path) {
  absl::StatusOr<sockaddr_un> addr = SocketAddress(path);
  if (!addr.ok()) return addr.status();
  absl::StatusOr<UniqueFd> lock = LockSocketPath(path);
  if (!lock.ok()) return lock.status();
  if (absl::Status s = RemoveStaleSocket(path, *addr); !s.ok()) return s;
  return std::unique_ptr<UnixSocketListener>(
      new UnixSocketListener(path, *std::move(lock)));
}

UnixSocketListener::~UnixSocketListener() {
  Stop();
  unlink(path_.c_str());
  unlink((path_ + ".lock").c_str());
}

absl::Status UnixSocketListener::Start(grpc::Server* server) {
  absl::StatusOr<sockaddr_un> addr = SocketAddress(path_);
  if (!addr.ok()) return addr.status();
  UniqueFd fd(socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (!fd.valid()) return ErrnoError(errno, "cannot create a socket");
  // The file is 0600 from the moment it exists: only the daemon's user
  // may connect.
  const mode_t old_umask = umask(0177);
  const int bound =
      bind(fd.get(), reinterpret_cast<const sockaddr*>(&*addr), sizeof(*addr));
  const int bind_error = errno;
  umask(old_umask);
  if (bound != 0) {
    return ErrnoError(bind_error, absl::StrCat("cannot bind ", path_));
  }
  chmod(path_.c_str(), 0600);
  if (listen(fd.get(), SOMAXCONN) != 0) {
    return ErrnoError(errno, absl::StrCat("cannot listen on ", path_));
  }
  wake_fd_.reset(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!wake_fd_.valid()) return ErrnoError(errno, "cannot create an eventfd");
  spare_fd_.reset(open("/dev/null", O_RDONLY | O_CLOEXEC));
  server_ = server;
  listen_fd_ = std::move(fd);
  accept_thread_ = std::thread([this] { AcceptLoop(); });
  pthread_setname_np(accept_thread_.native_handle(), "optimd-accept");
  return absl::OkStatus();
}

void UnixSocketListener::Stop() {
  if (!accept_thread_.joinable()) return;
  const uint64_t one = 1;
  // An eventfd's counter only fails to take a write when it would
  // overflow, which a single write cannot make it.
  (void)!write(wake_fd_.get(), &one, sizeof(one));
  accept_thread_.join();
  listen_fd_.reset();  // connections still waiting are refused
}

void UnixSocketListener::AcceptLoop() {
  int retry_ms = 0;  // > 0: accepting failed; try again after this long
  for (;;) {
    // While waiting to retry, only Stop may wake the loop: the listening
    // socket stays readable as long as connections wait.
    pollfd fds[2] = {{wake_fd_.get(), POLLIN, 0},
                     {listen_fd_.get(), POLLIN, 0}};
    const nfds_t watched = retry_ms > 0 ? 1 : 2;
    const int ready = poll(fds, watched, retry_ms > 0 ? retry_ms : -1);
    if (ready < 0 && errno != EINTR) {
      retry_ms = kMaxRetryWaitMs;  // ENOMEM: wait for memory
      continue;
    }
    if (fds[0].revents != 0) return;
    if (watched == 2 && fds[1].revents == 0) continue;
    retry_ms = AcceptWaiting()
                   ? 0
                   : std::min(kMaxRetryWaitMs, std::max(1, retry_ms * 2));
  }
}

bool UnixSocketListener::AcceptWaiting() {
  for (;;) {
    const int fd = accept4(listen_fd_.get(), nullptr, nullptr,
                           SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd >= 0) {
      if (exhausted_) {
        exhausted_ = false;
        log::Info(absl::StrCat("accepting connections on ", path_, " again; ",
                               refused(),
                               " refused in all while out of descriptors"));
      }
      // The server owns the connection from here on, and closes it.
      grpc::AddInsecureChannelFromFd(server_, fd);
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
          "; open files limit ", OpenFilesLimit(), "): connections to ", path_,
          " are closed unserved until descriptors come free"));
    }
    // accept() takes the new descriptor before it looks for a
    // connection, so it fails so even when none waits.
    switch (RefuseOne()) {
      case Refusal::kRefused:
        continue;
      case Refusal::kNoneWaiting:
        return true;
      case Refusal::kStillOut:
        return false;
    }
  }
}

UnixSocketListener::Refusal UnixSocketListener::RefuseOne() {
  if (!spare_fd_.valid()) {
    spare_fd_.reset(open("/dev/null", O_RDONLY | O_CLOEXEC));
    if (!spare_fd_.valid()) return Refusal::kStillOut;
  }
  spare_fd_.reset();
  int err = 0;
  {
    const UniqueFd refused(
        accept4(listen_fd_.get(), nullptr, nullptr, SOCK_CLOEXEC));
    err = refused.valid() ? 0 : errno;
    if (refused.valid()) refused_.fetch_add(1);
  }
  spare_fd_.reset(open("/dev/null", O_RDONLY | O_CLOEXEC));
  if (err == EAGAIN || err == EWOULDBLOCK) return Refusal::kNoneWaiting;
  if (err == EMFILE || err == ENFILE) return Refusal::kStillOut;
  return Refusal::kRefused;  // or gone meanwhile (ECONNABORTED, EINTR)
}

}  // namespace optimd
