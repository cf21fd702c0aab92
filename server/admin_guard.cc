#include "server/admin_guard.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/session_registry.h"

namespace optimd {

absl::StatusOr<std::string> AdminGuard::ReadTokenFile(const std::string& path) {
  const int fd = open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) {
    return absl::NotFoundError(absl::StrCat(
        "--admin_token_file ", path, " cannot be opened: ", strerror(errno)));
  }
  struct stat st;
  char buf[512];
  ssize_t n = -1;
  const bool statted = fstat(fd, &st) == 0;
  if (statted && S_ISREG(st.st_mode) && (st.st_mode & 077) == 0) {
    n = read(fd, buf, sizeof(buf));
  }
  close(fd);
  if (!statted || !S_ISREG(st.st_mode) || (st.st_mode & 077) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--admin_token_file ", path,
        " must be a regular file that only its owner can read (chmod 600)"));
  }
  const std::string token(
      absl::StripAsciiWhitespace(absl::string_view(buf, n < 0 ? 0 : n)));
  if (n < 0 || token.size() < 16 || token.size() > 256) {
    return absl::InvalidArgumentError(
        absl::StrCat("--admin_token_file ", path,
                     " must hold a token of 16 to 256 bytes (e.g. `openssl "
                     "rand -hex 16`)"));
  }
  return token;
}

namespace {

// "fd:<n>": a connection the daemon's own Unix socket listener accepted and
// handed to gRPC (UnixSocketListener); TCP peers are "ipv4:" or "ipv6:".
bool IsUnixPeer(const std::string& peer) {
  return absl::StartsWith(peer, "unix:") || absl::StartsWith(peer, "fd:");
}

}  // namespace

absl::Status AdminGuard::Check(const std::string& peer,
                               const std::string& sent_token,
                               const char* call) const {
  if (IsUnixPeer(peer)) return absl::OkStatus();
  if (!token_.empty() && SameSecret(sent_token, token_)) {
    return absl::OkStatus();
  }
  return absl::PermissionDeniedError(absl::StrCat(
      call,
      " is an admin call: over TCP it needs the token of the daemon's "
      "--admin_token_file in the ",
      kAdminMetadataKey, " metadata",
      token_.empty() ? " (this daemon has none: use its Unix socket)" : ""));
}

absl::Status AdminGuard::CheckSessionCaller(
    const std::string& peer, const std::string& sent_token) const {
  if (IsUnixPeer(peer) || tcp_clients_verified_) return absl::OkStatus();
  if (!token_.empty() && SameSecret(sent_token, token_)) {
    return absl::OkStatus();
  }
  return absl::PermissionDeniedError(absl::StrCat(
      "CreateSession over TCP needs a caller the daemon knows: start it with "
      "--tls_client_ca (clients present certificates), or send the token of "
      "its --admin_token_file in the ",
      kAdminMetadataKey, " metadata",
      token_.empty() ? " (this daemon has none)" : "",
      "; trainers on the daemon's node use its Unix socket"));
}

}  // namespace optimd
