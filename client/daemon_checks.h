// What the client checks of a daemon before it relies on it, and the
// diagnoses it gives when the daemon cannot be used: each names the cause
// and the fix, as the Python client's do (client/python/optimd/client.py).
//
// Stateless functions; thread-safe.
#ifndef OPTIMD_CLIENT_DAEMON_CHECKS_H_
#define OPTIMD_CLIENT_DAEMON_CHECKS_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"

namespace optimd {

// Refuses at once, saying why, a target that cannot reach a daemon:
//   - a bare socket path ("/run/optimd.sock", "x.sock"): without the unix:
//     prefix gRPC takes it for a TCP address, which the daemon serves over
//     TLS only; INVALID_ARGUMENT telling to write unix:<path>;
//   - a unix: socket file that does not exist: no daemon listens there, so
//     waiting for one is pointless; UNAVAILABLE naming the path;
//   - a socket this user may not open (the daemon creates it 0600):
//     UNAVAILABLE naming its owner and mode;
//   - a socket in a directory closed to this user (a service's runtime
//     directory, mode 0700): UNAVAILABLE naming that directory, its owner
//     and mode (not "does not exist", which is all stat() would say).
// OK for anything else (a TCP "host:port", a socket that may answer).
absl::Status CheckAddress(const std::string& target);

// The status of a call of an open session that found no daemon
// (UNAVAILABLE: killed, or stopped): says that the optimizer state it held
// is lost unless it was checkpointed or saved at a clean stop, and how to
// resume; `details` is gRPC's own message. Any other status is returned
// as it is.
absl::Status ExplainSessionStatus(const std::string& target,
                                  const absl::Status& status);

// FAILED_PRECONDITION naming both versions when the daemon at `target`,
// which says it is optimd `daemon_version` speaking `daemon_revision` of the
// API, is older than the `required` revision; OK otherwise. A daemon that
// leaves both fields empty predates them (0.2.0).
absl::Status CheckApiRevision(const std::string& target,
                              const std::string& daemon_version,
                              uint32_t daemon_revision, uint32_t required);

}  // namespace optimd

#endif  // OPTIMD_CLIENT_DAEMON_CHECKS_H_
