// The daemon-wide limits on what sessions hold: optimizer state bytes
// (--max_state_bytes) and the host memory of their bookkeeping — tensor
// names, aliases, shapes and entries (--max_metadata_bytes, estimated by
// core/metadata_bytes.h).
#ifndef OPTIMD_CORE_STATE_BUDGET_H_
#define OPTIMD_CORE_STATE_BUDGET_H_

#include <cstdint>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "common/mutex.h"

namespace optimd {

// --max_metadata_bytes' default: about three sessions at the cap of
// kMaxTensorsPerSession steppable tensors with short names (or two and a
// snapshot of one), far beyond any model, while a client cannot grow the
// daemon without bound through names and aliases.
inline constexpr uint64_t kDefaultMetadataLimit = uint64_t{4} << 30;

// Thread-safe.
class StateBudget {
 public:
  // 0 means unlimited, for either.
  explicit StateBudget(uint64_t limit,
                       uint64_t metadata_limit = kDefaultMetadataLimit)
      : limit_(limit), metadata_limit_(metadata_limit) {}

  // Reserves `bytes` of optimizer state and `metadata_bytes` of metadata
  // together, or fails with RESOURCE_EXHAUSTED naming the limit passed
  // (metadata's first), changing nothing.
  absl::Status Reserve(uint64_t bytes, uint64_t metadata_bytes,
                       const std::string& what) ABSL_LOCKS_EXCLUDED(mu_);
  // Gives back what Reserve took.
  void Release(uint64_t bytes, uint64_t metadata_bytes)
      ABSL_LOCKS_EXCLUDED(mu_);
  uint64_t used() const ABSL_LOCKS_EXCLUDED(mu_);
  uint64_t limit() const { return limit_; }
  uint64_t metadata_used() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  const uint64_t limit_;
  const uint64_t metadata_limit_;
  mutable Mutex mu_;
  uint64_t used_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t metadata_used_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace optimd

#endif  // OPTIMD_CORE_STATE_BUDGET_H_
