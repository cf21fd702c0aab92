// The daemon's own accept loop over its listening sockets (the Unix socket,
// or the TCP addresses): every accepted connection is handed to a callback
// that gives it to the gRPC server.
//
// Why the daemon accepts instead of gRPC: Debian's gRPC 1.51 stops
// accepting on a port for good once accept() has failed for lack of
// descriptors (grpc/grpc#16058, #20418, #31080), so a daemon that ran out
// of descriptors once was unreachable until restarted. This loop survives
// it. It keeps one spare descriptor; when accept() fails with EMFILE or
// ENFILE, it closes the spare, accepts the waiting connection and closes it
// at once (the client sees the connection closed and may retry), then takes
// the spare again. When even that fails (another thread took the freed
// descriptor), it waits, 1 ms doubling to 100 ms, and tries again. Connections
// are served again as soon as descriptors come free.
//
// Thread-safety: Start, Stop and the destructor are called from one
// thread; the loop runs on a thread of its own, the only one that touches
// the listening sockets once started. refused() may be read from any
// thread.
#ifndef OPTIMD_SERVER_ACCEPT_LOOP_H_
#define OPTIMD_SERVER_ACCEPT_LOOP_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "common/unique_fd.h"

namespace optimd {

class AcceptLoop {
 public:
  // Takes a connection just accepted (non-blocking, close-on-exec) from
  // listening socket `listener_fd`, and owns it from then on.
  using HandOver = std::function<void(int listener_fd, int fd)>;

  // `what` names the listener in log lines ("/run/optimd.sock",
  // "TCP 0.0.0.0:7000").
  explicit AcceptLoop(std::string what) : what_(std::move(what)) {}
  AcceptLoop(const AcceptLoop&) = delete;
  AcceptLoop& operator=(const AcceptLoop&) = delete;
  ~AcceptLoop() { Stop(); }

  // Starts accepting on `listeners` (listening, non-blocking sockets),
  // handing every connection to `hand_over` on the loop's thread.
  absl::Status Start(std::vector<UniqueFd> listeners, HandOver hand_over);

  // Stops accepting, joins the loop's thread and closes the listening
  // sockets (connections still waiting are refused). Idempotent.
  void Stop();

  // Connections closed unserved because descriptors had run out.
  uint64_t refused() const { return refused_.load(); }

 private:
  // The loop's body: until Stop, waits for connections (or, while out of
  // descriptors, for the next try) and accepts them.
  void Run();
  // Accepts every connection waiting on `listener`; false when descriptors
  // ran out and no connection could be refused, i.e. the loop must wait
  // before trying again.
  bool AcceptWaiting(int listener);
  // Out of descriptors: closes one connection waiting on `listener`
  // through the spare descriptor.
  enum class Refusal {
    kRefused,      // one connection closed (or it had gone): try again
    kNoneWaiting,  // no connection waits
    kStillOut,     // even the spare could not make room: wait
  };
  Refusal RefuseOne(int listener);

  // Constant after construction.
  const std::string what_;

  // Set by Start; read by the loop's thread only while it runs.
  std::vector<UniqueFd> listeners_;
  HandOver hand_over_;
  UniqueFd wake_fd_;  // an eventfd: written by Stop to end the loop
  std::thread thread_;

  // The loop thread's own.
  UniqueFd spare_fd_;
  bool exhausted_ = false;  // descriptors ran out; not yet accepted again

  std::atomic<uint64_t> refused_{0};
};

}  // namespace optimd

#endif  // OPTIMD_SERVER_ACCEPT_LOOP_H_
