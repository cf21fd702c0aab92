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

// FAILED_PRECONDITION naming both versions when the daemon at `target`,
// which says it is optimd `daemon_version` speaking `daemon_revision` of the
// API, is older than the `required` revision; OK otherwise. A daemon that
// leaves both fields empty predates them (0.2.0).
absl::Status CheckApiRevision(const std::string& target,
                              const std::string& daemon_version,
                              uint32_t daemon_revision, uint32_t required);

}  // namespace optimd

#endif  // OPTIMD_CLIENT_DAEMON_CHECKS_H_
