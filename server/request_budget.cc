#include "server/request_budget.h"

#include "absl/strings/str_cat.h"

namespace optimd {

bool RequestBudget::TryReserve(uint64_t bytes, uint64_t cap, uint64_t own,
                               uint64_t* used) {
  *used = used_.load();
  for (;;) {
    if (cap != 0 && *used > own &&
        (*used + bytes > cap || *used + bytes < *used)) {
      return false;
    }
    if (used_.compare_exchange_weak(*used, *used + bytes)) return true;
  }
}

absl::Status RequestBudget::Reserve(uint64_t bytes) {
  uint64_t used = 0;
  if (TryReserve(bytes, limit_, 0, &used)) return absl::OkStatus();
  return absl::ResourceExhaustedError(absl::StrCat(
      "requests waiting for or running on the daemon's workers hold ", used,
      " bytes (parsed, with what they convert into), and this one (", bytes,
      " bytes) would pass --max_request_memory_bytes (", limit_,
      "); nothing was changed: retry later or send smaller requests"));
}

absl::Status RequestBudget::ReserveReply(uint64_t bytes, uint64_t own) {
  uint64_t used = 0;
  if (TryReserve(bytes, ReplyCap(), own, &used)) return absl::OkStatus();
  return NoReplyRoom(used, bytes);
}

absl::Status RequestBudget::CheckReplyRoom(uint64_t own) const {
  const uint64_t used = used_.load();
  if (ReplyCap() == 0 || used <= own || used < ReplyCap()) {
    return absl::OkStatus();
  }
  return NoReplyRoom(used, 0);
}

absl::Status RequestBudget::NoReplyRoom(uint64_t used, uint64_t bytes) const {
  return absl::ResourceExhaustedError(absl::StrCat(
      "requests and replies not yet read by their callers hold ", used,
      " bytes of the daemon's memory, and this reply",
      bytes == 0 ? "" : absl::StrCat(" (", bytes, " bytes)"),
      " would pass half of --max_request_memory_bytes (", limit_,
      "; the other half is kept for requests); nothing was changed: retry "
      "later, ask for less, or read the replies of calls already sent"));
}

void RequestBudget::Release(uint64_t bytes) { used_.fetch_sub(bytes); }

}  // namespace optimd
