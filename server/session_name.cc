#include "server/session_name.h"

#include "absl/strings/str_cat.h"

namespace optimd {

std::string SessionName(const SessionIdentity& id) {
  return absl::StrCat("job '", id.job_id.substr(0, 200), "' rank ", id.rank);
}

}  // namespace optimd
