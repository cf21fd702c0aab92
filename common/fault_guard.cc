#include "common/fault_guard.h"

#include <signal.h>

#include <mutex>

#include "absl/strings/str_cat.h"

namespace optimd {
namespace fault_guard_internal {
namespace {

thread_local sigjmp_buf* tls_guard = nullptr;

void OnBusError(int sig, siginfo_t*, void*) {
  if (tls_guard != nullptr) siglongjmp(*tls_guard, 1);
  // Not a guarded access: die as the signal would have.
  signal(sig, SIG_DFL);
  raise(sig);
}

}  // namespace

sigjmp_buf*& InnermostGuard() { return tls_guard; }

void Install() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction sa = {};
    sa.sa_sigaction = OnBusError;
    sa.sa_flags = SA_SIGINFO | SA_NODEFER;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGBUS, &sa, nullptr);
  });
}

absl::Status FaultStatus(absl::string_view what) {
  return absl::FailedPreconditionError(absl::StrCat(
      what,
      ": a trainer's shared-memory segment shrank while the daemon "
      "was using it; re-register the buffers that live in it"));
}

}  // namespace fault_guard_internal
}  // namespace optimd
