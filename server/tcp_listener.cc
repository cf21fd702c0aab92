#include "server/tcp_listener.h"

#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace optimd {

namespace {

struct HostPort {
  std::string host;  // empty: every interface
  std::string port;
};

// Splits "host:port" / "[v6]:port" / ":port"; INVALID_ARGUMENT otherwise.
absl::StatusOr<HostPort> SplitAddress(const std::string& address) {
  const size_t colon = address.rfind(':');
  uint32_t port = 0;
  if (colon == std::string::npos ||
      !absl::SimpleAtoi(address.substr(colon + 1), &port) || port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--listen=", address,
        " is neither unix:/path nor host:port with a port from 0 to 65535"));
  }
  HostPort hp{address.substr(0, colon), absl::StrCat(port)};
  if (hp.host.size() >= 2 && hp.host.front() == '[' && hp.host.back() == ']') {
    hp.host = hp.host.substr(1, hp.host.size() - 2);
  }
  return hp;
}

uint16_t PortOf(const sockaddr_storage& addr) {
  return ntohs(addr.ss_family == AF_INET6
                   ? reinterpret_cast<const sockaddr_in6&>(addr).sin6_port
                   : reinterpret_cast<const sockaddr_in&>(addr).sin_port);
}

void SetPort(sockaddr* addr, uint16_t port) {
  if (addr->sa_family == AF_INET6) {
    reinterpret_cast<sockaddr_in6*>(addr)->sin6_port = htons(port);
  } else {
    reinterpret_cast<sockaddr_in*>(addr)->sin_port = htons(port);
  }
}

// A listening socket on `ai`; errno's text on failure.
absl::StatusOr<UniqueFd> ListenOn(const addrinfo& ai, bool v6_only) {
  UniqueFd fd(socket(ai.ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC,
                     ai.ai_protocol));
  const int one = 1;
  const int v6 = v6_only ? 1 : 0;
  if (!fd.valid() ||
      setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one)) != 0 ||
      (ai.ai_family == AF_INET6 &&
       setsockopt(fd.get(), IPPROTO_IPV6, IPV6_V6ONLY, &v6, sizeof(v6)) != 0) ||
      bind(fd.get(), ai.ai_addr, ai.ai_addrlen) != 0 ||
      listen(fd.get(), SOMAXCONN) != 0) {
    return absl::UnavailableError(std::strerror(errno));
  }
  return fd;
}

}  // namespace

absl::StatusOr<std::unique_ptr<TcpListener>> TcpListener::Bind(
    const std::string& address) {
  absl::StatusOr<HostPort> hp = SplitAddress(address);
  if (!hp.ok()) return hp.status();
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  if (const int err = getaddrinfo(hp->host.empty() ? nullptr : hp->host.c_str(),
                                  hp->port.c_str(), &hints, &found);
      err != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--listen=", address, ": cannot resolve '", hp->host,
                     "': ", gai_strerror(err)));
  }
  // Both families: each socket takes its own ([::] alone also takes IPv4).
  bool v4 = false, v6 = false;
  for (const addrinfo* ai = found; ai != nullptr; ai = ai->ai_next) {
    v4 |= ai->ai_family == AF_INET;
    v6 |= ai->ai_family == AF_INET6;
  }
  // As gRPC does, an address that cannot be bound (e.g. ::1 on a host
  // without IPv6) is skipped as long as another one is bound.
  std::vector<UniqueFd> listeners;
  uint16_t port = 0;
  absl::Status failed;
  for (addrinfo* ai = found; ai != nullptr; ai = ai->ai_next) {
    if (ai->ai_family != AF_INET && ai->ai_family != AF_INET6) continue;
    // Port 0: the first socket's pick, for every other address too.
    if (port != 0) SetPort(ai->ai_addr, port);
    absl::StatusOr<UniqueFd> fd = ListenOn(*ai, v4 && v6);
    if (!fd.ok()) {
      if (failed.ok()) failed = fd.status();
      continue;
    }
    sockaddr_storage bound{};
    socklen_t len = sizeof(bound);
    if (getsockname(fd->get(), reinterpret_cast<sockaddr*>(&bound), &len) ==
        0) {
      port = PortOf(bound);
    }
    listeners.push_back(*std::move(fd));
  }
  freeaddrinfo(found);
  if (listeners.empty()) {
    if (failed.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--listen=", address, ": '", hp->host, "' has no IP address"));
    }
    return absl::UnavailableError(
        absl::StrCat("cannot listen on ", address, ": ", failed.message()));
  }
  const std::string bound_address =
      absl::StrCat(address.substr(0, address.rfind(':') + 1), port);
  return std::unique_ptr<TcpListener>(
      new TcpListener(bound_address, std::move(listeners)));
}

absl::Status TcpListener::Start(
    grpc::experimental::ExternalConnectionAcceptor* acceptor) {
  return accept_loop_.Start(std::move(listeners_), [acceptor](int listener_fd,
                                                              int fd) {
    // gRPC owns the connection from here on: it runs the TLS handshake
    // with the server's credentials, or closes the connection when the
    // server has shut down.
    grpc::experimental::ExternalConnectionAcceptor::NewConnectionParameters p;
    p.listener_fd = listener_fd;
    p.fd = fd;
    acceptor->HandleNewConnection(&p);
  });
}

}  // namespace optimd
