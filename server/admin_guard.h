// Who may make the daemon's admin calls (ListSessions, which shows every
// job id, and EvictSession): a caller over the daemon's Unix socket (it is
// created 0600, so the caller runs as the daemon's user or as root), or a
// caller that sends the admin token in the `x-optimd-admin` metadata. The
// token is read at start from --admin_token_file; over TCP without one,
// admin calls are refused.
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
  // No token: only Unix-socket callers are admins.
  AdminGuard() = default;
  explicit AdminGuard(std::string token) : token_(std::move(token)) {}

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

 private:
  std::string token_;
};

}  // namespace optimd

#endif  // OPTIMD_SERVER_ADMIN_GUARD_H_
