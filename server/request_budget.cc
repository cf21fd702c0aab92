#include "server/request_budget.h"

#include "absl/strings/str_cat.h"

namespace optimd {

bool RequestBudget::TryReserve(uint64_t bytes, uint64_t* used) {
  *used = used_.load();
  for (;;) {
    if (limit_ != 0 && *used != 0 &&
        (*used + bytes > limit_ || *used + bytes < *used)) {
      return false;
    }
    if (used_.compare_exchange_weak(*used, *used + bytes)) return true;
  }
}

absl::Status RequestBudget::Reserve(uint64_t bytes) {
  uint64_t used = 0;
  if (TryReserve(bytes, &used)) return absl::OkStatus();
  return absl::ResourceExhaustedError(absl::StrCat(
      "requests waiting for or running on the daemon's workers hold ", used,
      " bytes (parsed, with what they convert into), and this one (", bytes,
      " bytes) would pass --max_request_memory_bytes (", limit_,
      "); nothing was changed: retry later or send smaller requests"));
}

absl::Status RequestBudget::ReserveReply(uint64_t bytes) {
  uint64_t used = 0;
  if (TryReserve(bytes, &used)) return absl::OkStatus();
  return absl::ResourceExhaustedError(absl::StrCat(
      "requests and replies not yet read by their callers hold ", used,
      " bytes of the daemon's memory, and this reply (", bytes,
      " bytes) would pass --max_request_memory_bytes (", limit_,
      "); nothing was changed: retry later, ask for less, or read the "
      "replies of calls already sent"));
}

void RequestBudget::Release(uint64_t bytes) { used_.fetch_sub(bytes); }

}  // namespace optimd
