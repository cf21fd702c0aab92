#include "client/daemon_checks.h"

#include <pwd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/version.h"

namespace optimd {
namespace {

// "user alice (uid 1000)", or "user id 1000" when the uid has no name.
std::string Owner(uid_t uid) {
  passwd entry;
  passwd* found = nullptr;
  std::vector<char> buf(16384);
  if (getpwuid_r(uid, &entry, buf.data(), buf.size(), &found) == 0 &&
      found != nullptr) {
    return absl::StrCat("user ", found->pw_name, " (uid ", uid, ")");
  }
  return absl::StrCat("user id ", uid);
}

// Whether a daemon accepts connections on the Unix socket at `path`:
// false only when the file is there but nothing listens (ECONNREFUSED: a
// daemon that ended without removing it); true when that cannot be told.
bool SomeoneListens(const std::string& path) {
  sockaddr_un addr{};
  if (path.size() >= sizeof(addr.sun_path)) return true;
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.data(), path.size());
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return true;
  const bool refused = connect(fd, reinterpret_cast<const sockaddr*>(&addr),
                               sizeof(addr)) != 0 &&
                       errno == ECONNREFUSED;
  close(fd);
  return !refused;
}

// The first directory on `path` this process may not search (its x bit
// closed to it), or "" when there is none.
std::string ClosedDirectory(const std::string& path) {
  for (size_t slash = path.find('/', 1); slash != std::string::npos;
       slash = path.find('/', slash + 1)) {
    const std::string dir = path.substr(0, slash);
    if (access(dir.c_str(), X_OK) != 0 && errno == EACCES) return dir;
  }
  return "";
}

// The file system path of a unix: target ("unix:path" or
// "unix:///absolute/path", as gRPC reads them).
std::string SocketPath(const std::string& target) {
  std::string path = target.substr(5);
  if (absl::StartsWith(path, "//")) path = path.substr(2);
  return path;
}

}  // namespace

absl::Status CheckAddress(const std::string& target) {
  if (!absl::StartsWith(target, "unix:")) {
    if (absl::StartsWith(target, "/") || absl::EndsWith(target, ".sock")) {
      return absl::InvalidArgumentError(absl::StrCat(
          "'", target, "' looks like a socket path: write unix:", target,
          " (without the prefix it is a TCP address, which the daemon serves "
          "over TLS only)"));
    }
    return absl::OkStatus();
  }
  const std::string path = SocketPath(target);
  struct stat st;
  if (stat(path.c_str(), &st) != 0) {
    const int err = errno;
    if (err == ENOENT) {
      return absl::UnavailableError(absl::StrCat(
          "no optimd daemon at ", target, ": the socket file ", path,
          " does not exist, so no daemon listens there; start one with "
          "`optimd --listen=",
          target, "`"));
    }
    struct stat dir_st;
    const std::string dir = err == EACCES ? ClosedDirectory(path) : "";
    if (!dir.empty() && stat(dir.c_str(), &dir_st) == 0) {
      return absl::UnavailableError(absl::StrFormat(
          "the daemon socket %s is out of this user's reach: the directory "
          "%s on its path belongs to %s and is closed to this user (mode "
          "%o); run as that user, or start a daemon of your own on another "
          "socket (optimd --listen=unix:/path)",
          path, dir, Owner(dir_st.st_uid), dir_st.st_mode & 0777));
    }
    return absl::UnavailableError(absl::StrCat(
        "cannot reach the daemon socket ", path, ": ", std::strerror(err)));
  }
  // Connecting to a Unix socket needs write permission on its file.
  if (access(path.c_str(), R_OK | W_OK) != 0 && errno == EACCES) {
    return absl::UnavailableError(absl::StrFormat(
        "the daemon socket %s belongs to %s and only it may connect (mode "
        "%o); run as that user, or start a daemon of your own on another "
        "socket (optimd --listen=unix:/path)",
        path, Owner(st.st_uid), st.st_mode & 0777));
  }
  if (!SomeoneListens(path)) {
    return absl::UnavailableError(absl::StrCat(
        "no optimd daemon at ", target, ": the socket file ", path,
        " is there but nothing listens on it (a daemon that ended without "
        "removing it); start one with `optimd --listen=",
        target, "`, which replaces the stale file"));
  }
  return absl::OkStatus();
}

absl::Status ExplainSessionStatus(const std::string& target,
                                  const absl::Status& status) {
  if (status.code() != absl::StatusCode::kUnavailable) return status;
  return absl::UnavailableError(absl::StrCat(
      "the optimd daemon at ", target, " went away during the session (",
      status.message(),
      "): the optimizer state it held is lost unless it was checkpointed "
      "(SaveState) or saved at a clean stop (--save_dir); restart it and "
      "resume (CreateSession with resume, or LoadState)"));
}

absl::Status CheckApiRevision(const std::string& target,
                              const std::string& daemon_version,
                              uint32_t daemon_revision, uint32_t required) {
  if (daemon_revision >= required) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "the daemon at ", target, " is optimd ",
      daemon_version.empty() ? "older than 0.2.0" : daemon_version,
      " (API revision ", daemon_revision, "); this client, optimd ", kVersion,
      ", needs API revision ", required, " or later: upgrade the daemon"));
}

}  // namespace optimd
