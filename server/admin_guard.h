// Who may make the daemon's admin calls (ListSessions, which shows every
// job id, and EvictSession), and who may open sessions over TCP. Callers
// over the daemon's Unix socket may do both (it is created 0600, so the
// caller runs as the daemon's user or as root). Over TCP, admin calls need
// the admin token in the `x-optimd-admin` metadata (read at start from
// --admin_token_file; without one they are refused), and CreateSession
// needs a caller the daemon knows: a verified client certificate
// (--tls_client_ca) or the admin token. An anonymous TLS client could
// otherwise open a session and make the daemon map the node's shared
// memory, or write and read checkpoints, as the daemon's user.
//
// Thread-safe: immutable after construction.
#ifndef OPTIMD_SERVER_ADMIN_GUARD_H_
#define OPTIMD_SERVER_ADMIN_GUARD_H_

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace optimd {

// The metadata key that carries the admin token.
inline constexpr char kAdminMetadataKey[] = "x-optimd-admin";

class AdminGuard {
 public:
  // No token, client certificates not checked: only Unix-socket callers
  // are admins or may open sessions.
  AdminGuard() = default;
  // `token` empty: no admin token. `tcp_clients_verified`: every TCP
  // client presented a certificate of the daemon's --tls_client_ca.
  AdminGuard(std::string token, bool tcp_clients_verified)
      : token_(std::move(token)), tcp_clients_verified_(tcp_clients_verified) {}

  // The token in `path`: a regular file that only its owner may read or
  // write (mode 0600 or stricter), 16 to 256 bytes once surrounding white
  // space is trimmed. INVALID_ARGUMENT or NOT_FOUND naming the file.
  static absl::StatusOr<std::string> ReadTokenFile(const std::string& path);

  // OK for an admin: `peer` (grpc's ServerContext::peer()) is a Unix
  // socket ("unix:..." or "fd:<n>", as the daemon's own listener hands its
  // connections over), or `sent_token` equals the token. PERMISSION_DENIED
  // naming `call` otherwise.
  absl::Status Check(const std::string& peer, const std::string& sent_token,
                     const char* call) const;

  // OK when the caller may open (or resume) a session: a Unix-socket peer,
  // any TCP peer when client certificates are verified, or a caller that
  // sends the admin token. PERMISSION_DENIED saying what is needed
  // otherwise.
  absl::Status CheckSessionCaller(const std::string& peer,
                                  const std::string& sent_token) const;

 private:
  std::string token_;
  bool tcp_clients_verified_ = false;
};

}  // namespace optimd

#endif  // OPTIMD_SERVER_ADMIN_GUARD_H_
