#include "common/default_address.h"

#include <unistd.h>

#include <cstdlib>

#include "absl/strings/str_cat.h"

namespace optimd {

std::string DefaultAddress() {
  if (const char* a = std::getenv("OPTIMD_ADDRESS"); a != nullptr && *a) {
    return a;
  }
  if (const char* d = std::getenv("XDG_RUNTIME_DIR"); d != nullptr && *d) {
    return absl::StrCat("unix:", d, "/optimd.sock");
  }
  return absl::StrCat("unix:/tmp/optimd-", getuid(), ".sock");
}

}  // namespace optimd
