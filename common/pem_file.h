// Reading PEM files (TLS certificates and keys) for the daemon and clients.
#ifndef OPTIMD_COMMON_PEM_FILE_H_
#define OPTIMD_COMMON_PEM_FILE_H_

#include <string>

#include "absl/status/statusor.h"

namespace optimd {

// The contents of the PEM file `path` (a certificate or key, `what` in
// errors): NOT_FOUND if it cannot be read, INVALID_ARGUMENT if not PEM.
absl::StatusOr<std::string> ReadPemFile(const std::string& what,
                                        const std::string& path);

}  // namespace optimd

#endif  // OPTIMD_COMMON_PEM_FILE_H_
