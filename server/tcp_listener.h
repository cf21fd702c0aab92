// The daemon's TCP address (--listen=host:port, TLS only): the daemon owns
// the listening sockets and their accept loop (AcceptLoop, which survives
// running out of descriptors), and hands each connection to the gRPC server
// through an external connection acceptor registered with the server's TLS
// credentials. gRPC then runs the TLS handshake (and client certificate
// checks) on the connection exactly as on a port it accepted itself, and
// sees the TCP peer's address ("ipv4:..." / "ipv6:...").
//
// Why not let gRPC listen: Debian's gRPC 1.51 stops accepting on a port for
// good once accept() has failed for lack of descriptors (grpc/grpc#16058,
// #20418, #31080). Its AddInsecureChannelFromFd, which the Unix socket
// uses, takes no credentials; ServerBuilder's external connection acceptor
// (experimental in 1.51, there since 1.23) does.
//
// Thread-safety: Bind, Start, Stop and the destructor are called from one
// thread; the accept loop runs on a thread of its own.
#ifndef OPTIMD_SERVER_TCP_LISTENER_H_
#define OPTIMD_SERVER_TCP_LISTENER_H_

#include <grpcpp/server_builder.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/unique_fd.h"
#include "server/accept_loop.h"

namespace optimd {

class TcpListener {
 public:
  // Binds and listens on every address `address` ("host:port",
  // "[v6]:port", ":port" for every interface) resolves to, all on one port;
  // port 0 lets the kernel pick it. INVALID_ARGUMENT for an address that is
  // not host:port or does not resolve, UNAVAILABLE when it cannot be bound
  // (in use, not an address of this host). Nothing is accepted yet.
  static absl::StatusOr<std::unique_ptr<TcpListener>> Bind(
      const std::string& address);

  TcpListener(const TcpListener&) = delete;
  TcpListener& operator=(const TcpListener&) = delete;
  ~TcpListener() { Stop(); }

  // From now on hands every connection to `acceptor`, which must belong to
  // a started server and outlive Stop().
  absl::Status Start(grpc::experimental::ExternalConnectionAcceptor* acceptor);

  // Stops accepting and joins the accept thread; connections already
  // handed over are the server's. Call before the server's Shutdown.
  // Idempotent.
  void Stop() { accept_loop_.Stop(); }

  // `address` with the port actually bound (the kernel's pick for port 0).
  const std::string& address() const { return address_; }

  // Connections closed unserved because descriptors had run out.
  uint64_t refused() const { return accept_loop_.refused(); }

 private:
  TcpListener(std::string address, std::vector<UniqueFd> listeners)
      : address_(std::move(address)),
        listeners_(std::move(listeners)),
        accept_loop_(address_) {}

  // Constant after construction.
  const std::string address_;

  // Bound and listening; moved into the accept loop by Start.
  std::vector<UniqueFd> listeners_;
  AcceptLoop accept_loop_;
};

}  // namespace optimd

#endif  // OPTIMD_SERVER_TCP_LISTENER_H_
