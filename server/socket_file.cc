#include "server/socket_file.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace optimd {

namespace {

absl::Status ErrnoError(int err, const std::string& what) {
  return absl::InternalError(absl::StrCat(what, ": ", std::strerror(err)));
}

}  // namespace

absl::StatusOr<sockaddr_un> SocketFileAddress(const std::string& path) {
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

// The lock is re-checked against the path after locking: a daemon that is
// stopping unlinks its lock file, and a lock taken on that unlinked file
// would guard nothing.
absl::StatusOr<UniqueFd> LockSocketFile(const std::string& socket_path) {
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

absl::Status RemoveStaleSocketFile(const std::string& path,
                                   const sockaddr_un& addr, int type) {
  struct stat st;
  if (lstat(path.c_str(), &st) != 0) return absl::OkStatus();
  if (!S_ISSOCK(st.st_mode)) {
    return absl::FailedPreconditionError(absl::StrCat(
        path, " exists and is not a socket; refusing to replace it"));
  }
  UniqueFd probe(socket(AF_UNIX, type | SOCK_CLOEXEC, 0));
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

absl::StatusOr<UniqueFd> ListenOnSocketFile(const std::string& path, int type) {
  absl::StatusOr<sockaddr_un> addr = SocketFileAddress(path);
  if (!addr.ok()) return addr.status();
  UniqueFd fd(socket(AF_UNIX, type | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (!fd.valid()) return ErrnoError(errno, "cannot create a socket");
  const mode_t old_umask = umask(0177);
  const int bound =
      bind(fd.get(), reinterpret_cast<const sockaddr*>(&*addr), sizeof(*addr));
  const int bind_error = errno;
  umask(old_umask);
  if (bound != 0) {
    return ErrnoError(bind_error, absl::StrCat("cannot bind ", path));
  }
  chmod(path.c_str(), 0600);
  if (listen(fd.get(), SOMAXCONN) != 0) {
    return ErrnoError(errno, absl::StrCat("cannot listen on ", path));
  }
  return fd;
}

void RemoveSocketFiles(const std::string& path) {
  unlink(path.c_str());
  unlink((path + ".lock").c_str());
}

}  // namespace optimd
