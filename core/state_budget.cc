#include "core/state_budget.h"

#include "absl/strings/str_cat.h"

namespace optimd {

absl::Status StateBudget::Reserve(uint64_t bytes, const std::string& what) {
  MutexLock lock(&mu_);
  if (limit_ != 0 && (bytes > limit_ || used_ > limit_ - bytes)) {
    return absl::ResourceExhaustedError(absl::StrCat(
        what, " needs ", bytes, " bytes of optimizer state but only ",
        limit_ - used_, " of the daemon's --max_state_bytes=", limit_,
        " are free; free other groups or raise the limit"));
  }
  used_ += bytes;
  return absl::OkStatus();
}

void StateBudget::Release(uint64_t bytes) {
  MutexLock lock(&mu_);
  used_ -= bytes <= used_ ? bytes : used_;
}

uint64_t StateBudget::used() const {
  MutexLock lock(&mu_);
  return used_;
}

}  // namespace optimd
