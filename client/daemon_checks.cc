#include "client/daemon_checks.h"

#include "absl/strings/str_cat.h"
#include "common/version.h"

namespace optimd {

absl::Status CheckApiRevision(const std::string& target,
                              const std::string& daemon_version,
                              uint32_t daemon_revision, uint32_t required) {
  if (daemon_revision >= required) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "the daemon at ", target, " is optimd ",
      daemon_version.empty() ? "older than 0.2.0" : daemon_version,
      " (API revision ", daemon_revision, "); this client, optimd ", kVersion,
      ", needs API revision ", required, " or later: upgrade the daemon"));
}

}  // namespace optimd
