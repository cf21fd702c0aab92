// The daemon's Unix socket (--listen=unix:/path): the daemon owns the
// listening socket and its accept loop, and hands each connection to the
// gRPC server, instead of letting gRPC listen.
//
// Why: Debian's gRPC 1.51 stops accepting on a port for good once accept()
// has failed for lack of descriptors; the daemon's AcceptLoop survives it
// (see server/accept_loop.h).
//
// The socket file is created with mode 0600. "<path>.lock" is flock'd for
// the listener's lifetime, so of daemons started at the same moment on one
// socket exactly one goes on. Destroying the listener removes both files.
//
// Thread-safety: Claim, Start, Stop and the destructor are called from one
// thread; the accept loop runs on a thread of its own (AcceptLoop).
#ifndef OPTIMD_SERVER_UNIX_SOCKET_LISTENER_H_
#define OPTIMD_SERVER_UNIX_SOCKET_LISTENER_H_

#include <grpcpp/server.h>

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/unique_fd.h"
#include "server/accept_loop.h"

namespace optimd {

class UnixSocketListener {
 public:
  // Takes `path` for this daemon: locks "<path>.lock", removes a stale
  // socket file that a dead daemon left, and refuses a live socket
  // (ALREADY_EXISTS) or a file that is not a socket (FAILED_PRECONDITION).
  // Nothing listens yet.
  static absl::StatusOr<std::unique_ptr<UnixSocketListener>> Claim(
      const std::string& path);

  UnixSocketListener(const UnixSocketListener&) = delete;
  UnixSocketListener& operator=(const UnixSocketListener&) = delete;
  // Stops, then removes the socket file and the lock file while still
  // holding the lock (so no other daemon can have taken the path).
  ~UnixSocketListener();

  // Creates the socket file (0600), listens, and from now on hands every
  // connection to `server`, which must be started and outlive Stop().
  absl::Status Start(grpc::Server* server);

  // Stops accepting and joins the accept thread; connections already
  // handed over are the server's. Call before the server's Shutdown.
  // Idempotent.
  void Stop();

  const std::string& path() const { return path_; }

  // Connections closed unserved because descriptors had run out.
  uint64_t refused() const { return accept_loop_.refused(); }

 private:
  UnixSocketListener(std::string path, UniqueFd lock)
      : path_(std::move(path)), lock_(std::move(lock)), accept_loop_(path_) {}

  // Constant after construction.
  const std::string path_;
  const UniqueFd lock_;

  AcceptLoop accept_loop_;
};

}  // namespace optimd

#endif  // OPTIMD_SERVER_UNIX_SOCKET_LISTENER_H_
