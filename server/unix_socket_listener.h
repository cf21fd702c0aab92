// The daemon's Unix socket (--listen=unix:/path): the daemon owns the
// listening socket and its accept loop, and hands each connection to the
// gRPC server, instead of letting gRPC listen.
//
// Why: Debian's gRPC 1.51 stops accepting on a port for good once accept()
// has failed for lack of descriptors (grpc/grpc#16058, #20418, #31080), so
// a daemon that ran out of descriptors once was unreachable until
// restarted. This loop survives it. It keeps one spare descriptor; when
// accept() fails with EMFILE or ENFILE, it closes the spare, accepts the
// waiting connection and closes it at once (the client sees the
// connection closed and may retry), then takes the spare again. When even
// that fails (another thread took the freed slot), it waits, 1 ms doubling
// to 100 ms, and tries again. Connections are served again as soon as
// descriptors come free.
//
// The socket file is created with mode 0600. "<path>.lock" is flock'd for
// the listener's lifetime, so of daemons started at the same moment on one
// socket exactly one goes on. Destroying the listener removes both files.
//
// Thread-safety: Claim, Start, Stop and the destructor are called from one
// thread; the accept loop runs on a thread of its own, the only one that
// touches the listening socket once started.
#ifndef OPTIMD_SERVER_UNIX_SOCKET_LISTENER_H_
#define OPTIMD_SERVER_UNIX_SOCKET_LISTENER_H_

#include <grpcpp/server.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/unique_fd.h"

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
  uint64_t refused() const { return refused_.load(); }

 private:
  UnixSocketListener(std::string path, UniqueFd lock)
      : path_(std::move(path)), lock_(std::move(lock)) {}

  // The accept thread's body: until Stop, waits for connections (or, while
  // out of descriptors, for the next try) and accepts them.
  void AcceptLoop();
  // Accepts every waiting connection; false when descriptors ran out and
  // no connection could be refused, i.e. the loop must wait before trying
  // again.
  bool AcceptWaiting();
  // Out of descriptors: closes one waiting connection through the spare
  // descriptor.
  enum class Refusal {
    kRefused,      // one connection closed (or it had gone): try again
    kNoneWaiting,  // no connection waits
    kStillOut,     // even the spare could not make room: wait
  };
  Refusal RefuseOne();

  // Constant after construction.
  const std::string path_;
  const UniqueFd lock_;

  // Set by Start; read by the accept thread only while it runs.
  grpc::Server* server_ = nullptr;
  UniqueFd listen_fd_;
  UniqueFd wake_fd_;  // an eventfd: written by Stop to end the loop
  std::thread accept_thread_;

  // The accept thread's own.
  UniqueFd spare_fd_;
  bool exhausted_ = false;  // descriptors ran out; not yet accepted again

  std::atomic<uint64_t> refused_{0};
};

}  // namespace optimd

#endif  // OPTIMD_SERVER_UNIX_SOCKET_LISTENER_H_
