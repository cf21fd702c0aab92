#include "core/state_budget.h"

#include "absl/strings/str_cat.h"

namespace optimd {
namespace {

bool Fits(uint64_t limit, uint64_t used, uint64_t bytes) {
  return limit == 0 || (bytes <= limit && used <= limit - bytes);
}

void Subtract(uint64_t* used, uint64_t bytes) {
  *used -= bytes <= *used ? bytes : *used;
}

}  // namespace

absl::Status StateBudget::Reserve(uint64_t bytes, uint64_t metadata_bytes,
                                  const std::string& what) {
  MutexLock lock(&mu_);
  if (!Fits(metadata_limit_, metadata_used_, metadata_bytes)) {
    return absl::ResourceExhaustedError(absl::StrCat(
        what, " needs about ", metadata_bytes,
        " bytes of the daemon's memory for its tensors' names, aliases and "
        "shapes but only ",
        metadata_limit_ - metadata_used_,
        " of its --max_metadata_bytes=", metadata_limit_,
        " are free; use shorter names or fewer aliases, free other groups "
        "or raise the limit"));
  }
  if (!Fits(limit_, used_, bytes)) {
    return absl::ResourceExhaustedError(absl::StrCat(
        what, " needs ", bytes, " bytes of optimizer state but only ",
        limit_ - used_, " of the daemon's --max_state_bytes=", limit_,
        " are free; free other groups or raise the limit"));
  }
  used_ += bytes;
  metadata_used_ += metadata_bytes;
  return absl::OkStatus();
}

void StateBudget::Release(uint64_t bytes, uint64_t metadata_bytes) {
  MutexLock lock(&mu_);
  Subtract(&used_, bytes);
  Subtract(&metadata_used_, metadata_bytes);
}

uint64_t StateBudget::used() const {
  MutexLock lock(&mu_);
  return used_;
}

uint64_t StateBudget::metadata_used() const {
  MutexLock lock(&mu_);
  return metadata_used_;
}

}  // namespace optimd
