#include "server/unix_socket_listener.h"

#include <fcntl.h>
#include <grpcpp/server_posix.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"

namespace optimd {

namespace {

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
  std::vector<UniqueFd> listeners;
  listeners.push_back(std::move(fd));
  // The server owns each connection from here on, and closes it.
  return accept_loop_.Start(std::move(listeners), [server](int, int conn) {
    grpc::AddInsecureChannelFromFd(server, conn);
  });
}

void UnixSocketListener::Stop() { accept_loop_.Stop(); }

}  // namespace optimd
