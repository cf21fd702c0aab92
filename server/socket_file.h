// The file of a Unix socket the daemon listens on: its address, the lock
// that makes one daemon its owner, the removal of a stale file a dead
// daemon left, and its creation with mode 0600. The gRPC socket
// (UnixSocketListener) and the descriptor socket (FdSocket) claim their
// paths the same way through these.
//
// A path is claimed in two steps: LockSocketFile takes "<path>.lock"
// (flock), then RemoveStaleSocketFile removes a socket file nobody listens
// on. Whoever holds the lock removes the socket file and then the lock file
// (still holding it) when done, so that no other daemon can have taken the
// path meanwhile.
//
// Thread-safety: the functions keep no state; they change the process's
// umask for the moment of a bind (ListenOnSocketFile), which other threads
// creating files at that moment would see.
#ifndef OPTIMD_SERVER_SOCKET_FILE_H_
#define OPTIMD_SERVER_SOCKET_FILE_H_

#include <sys/un.h>

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/unique_fd.h"

namespace optimd {

// The socket address of `path`; INVALID_ARGUMENT when it does not fit.
absl::StatusOr<sockaddr_un> SocketFileAddress(const std::string& path);

// Locks "<socket_path>.lock" for the caller, who holds the lock as long as
// it keeps the descriptor returned. ALREADY_EXISTS when another process
// holds it.
absl::StatusOr<UniqueFd> LockSocketFile(const std::string& socket_path);

// Removes the socket file at `path` when nothing listens on it (a dead
// daemon's); ALREADY_EXISTS when something does, FAILED_PRECONDITION when
// the file is not a socket. `type` is the socket type the caller will
// listen with (SOCK_STREAM, SOCK_SEQPACKET): a probe of another type would
// be refused by a live listener and take it for a dead one. Call with the
// path's lock held.
absl::Status RemoveStaleSocketFile(const std::string& path,
                                   const sockaddr_un& addr, int type);

// Creates the socket file at `path` (mode 0600 from the moment it exists:
// only the daemon's user may connect) and listens on it: a non-blocking,
// close-on-exec socket of `type`.
absl::StatusOr<UniqueFd> ListenOnSocketFile(const std::string& path, int type);

// Removes the socket file at `path`, then "<path>.lock"; call while still
// holding the lock.
void RemoveSocketFiles(const std::string& path);

}  // namespace optimd

#endif  // OPTIMD_SERVER_SOCKET_FILE_H_
