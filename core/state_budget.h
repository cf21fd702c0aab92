// The daemon-wide limit on optimizer state bytes (--max_state_bytes).
#ifndef OPTIMD_CORE_STATE_BUDGET_H_
#define OPTIMD_CORE_STATE_BUDGET_H_

#include <cstdint>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "common/mutex.h"

namespace optimd {

// Thread-safe.
class StateBudget {
 public:
  // 0 means unlimited.
  explicit StateBudget(uint64_t limit) : limit_(limit) {}

  // Reserves `bytes` or fails with RESOURCE_EXHAUSTED, changing nothing.
  absl::Status Reserve(uint64_t bytes, const std::string& what)
      ABSL_LOCKS_EXCLUDED(mu_);
  void Release(uint64_t bytes) ABSL_LOCKS_EXCLUDED(mu_);
  uint64_t used() const ABSL_LOCKS_EXCLUDED(mu_);
  uint64_t limit() const { return limit_; }

 private:
  const uint64_t limit_;
  mutable Mutex mu_;
  uint64_t used_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace optimd

#endif  // OPTIMD_CORE_STATE_BUDGET_H_
