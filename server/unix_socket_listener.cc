#include "server/unix_socket_listener.h"

#include <grpcpp/server_posix.h>
#include <sys/socket.h>

#include <vector>

#include "server/socket_file.h"

namespace optimd {

absl::StatusOr<std::unique_ptr<UnixSocketListener>> UnixSocketListener::Claim(
    const std::string& path) {
  absl::StatusOr<sockaddr_un> addr = SocketFileAddress(path);
  if (!addr.ok()) return addr.status();
  absl::StatusOr<UniqueFd> lock = LockSocketFile(path);
  if (!lock.ok()) return lock.status();
  if (absl::Status s = RemoveStaleSocketFile(path, *addr, SOCK_STREAM);
      !s.ok()) {
    return s;
  }
  return std::unique_ptr<UnixSocketListener>(
      new UnixSocketListener(path, *std::move(lock)));
}

UnixSocketListener::~UnixSocketListener() {
  Stop();
  RemoveSocketFiles(path_);
}

absl::Status UnixSocketListener::Start(grpc::Server* server) {
  absl::StatusOr<UniqueFd> fd = ListenOnSocketFile(path_, SOCK_STREAM);
  if (!fd.ok()) return fd.status();
  std::vector<UniqueFd> listeners;
  listeners.push_back(*std::move(fd));
  // The server owns each connection from here on, and closes it.
  return accept_loop_.Start(std::move(listeners), [server](int, int conn) {
    grpc::AddInsecureChannelFromFd(server, conn);
  });
}

void UnixSocketListener::Stop() { accept_loop_.Stop(); }

}  // namespace optimd
