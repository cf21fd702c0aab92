// Survives a trainer that shrinks its shared-memory segment while the
// daemon touches it: the access faults with SIGBUS, which would kill the
// daemon. Code that reads or writes trainer memory runs under
// GuardMemoryFaults; a fault then returns an error instead.
//
// Thread-safe: the guard is per thread. The guarded function must not take
// locks or own resources with destructors (a fault leaves it by
// siglongjmp). Allocation-free unless a fault happens.
#ifndef OPTIMD_COMMON_FAULT_GUARD_H_
#define OPTIMD_COMMON_FAULT_GUARD_H_

#include <setjmp.h>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace optimd {
namespace fault_guard_internal {

// This thread's innermost guard.
sigjmp_buf*& InnermostGuard();
// Installs the SIGBUS handler once per process.
void Install();
absl::Status FaultStatus(absl::string_view what);

}  // namespace fault_guard_internal

// Runs `fn()`. FAILED_PRECONDITION naming `what` if it hit a memory fault
// (SIGBUS) in a mapping that shrank under it.
template <typename Fn>
absl::Status GuardMemoryFaults(Fn&& fn, absl::string_view what) {
  fault_guard_internal::Install();
  sigjmp_buf buf;
  sigjmp_buf* const outer = fault_guard_internal::InnermostGuard();
  if (sigsetjmp(buf, 1) != 0) {
    fault_guard_internal::InnermostGuard() = outer;
    return fault_guard_internal::FaultStatus(what);
  }
  fault_guard_internal::InnermostGuard() = &buf;
  fn();
  fault_guard_internal::InnermostGuard() = outer;
  return absl::OkStatus();
}

}  // namespace optimd

#endif  // OPTIMD_COMMON_FAULT_GUARD_H_
