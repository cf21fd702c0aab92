// Steps whose trainer died before its stream marked them ready. Such a step
// waits on the device's stream for a ready flag that nobody will write
// (cuStreamWaitValue32 on the trainer's step flags), and every session on
// the GPU waits behind it. StepRescue lets them through: it writes the
// ready flag itself, on a stream of its own, after marking the steps
// abandoned (kernels/cuda_step_types.h AbandonedSteps), so that their
// kernels skip them: their gradients may be incomplete, and the session
// keeps the state of its last whole step for a resume. In a job the skip
// is every rank's (the all-reduced non-finite flag). Once it has rescued,
// later waits on the same flags (steps of the dead trainer still queued)
// are let through by the device's worker itself (NoteWait).
//
// Thread-safe: the device's worker notes each wait, and any thread may
// rescue (the session reaper, an eviction, a resume), never waiting for
// the device's stream or its worker, nor longer than its deadline.
#ifndef OPTIMD_BACKENDS_CUDA_TRAINER_GONE_H_
#define OPTIMD_BACKENDS_CUDA_TRAINER_GONE_H_

#include <cuda_runtime.h>

#include <cstdint>
#include <deque>
#include <memory>
#include <utility>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "backends/cuda/driver_fns.h"
#include "common/mutex.h"
#include "core/buffer.h"
#include "kernels/cuda_step_types.h"

namespace optimd {

// A non-blocking stream of the session's GPU for rescues, with an event
// to wait on it against a deadline.
struct RescueStream {
  cudaStream_t stream = nullptr;
  cudaEvent_t event = nullptr;
};

class StepRescue {
 public:
  // The session's AbandonedSteps and a pinned word for reading flags.
  static absl::StatusOr<std::unique_ptr<StepRescue>> Create();

  // What the step records point their kernels at.
  const volatile cuda::AbandonedSteps* words() const {
    return reinterpret_cast<const cuda::AbandonedSteps*>(words_.data());
  }

  // The device's worker, before it enqueues a wait for the ready flag
  // `flags[0]` >= `sequence` (a step, or a refused step's release) on
  // behalf of the session's step `ticket`; `keep` keeps the flags mapped.
  // True when the trainer of these flags is known gone (a rescue ran on
  // them): the step is marked abandoned, and the caller writes the ready
  // flag itself before the wait.
  bool NoteWait(uint32_t* flags, std::shared_ptr<const void> keep,
                uint32_t sequence, uint64_t ticket) ABSL_LOCKS_EXCLUDED(mu_);

  // The session's trainer is gone: for each of the flags it bound lately
  // whose newest wait is not satisfied, marks the waiting steps abandoned
  // and writes the ready flag on `side`, waiting for that at most until
  // `deadline` (DEADLINE_EXCEEDED then). True when it let steps through.
  // Calling it again is harmless: it acts only on waits noted since.
  absl::StatusOr<bool> Rescue(const DriverFns& driver, RescueStream side,
                              absl::Time deadline) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  // One binding of step flags (Session::BindStepFlags): its steps have
  // tickets base + sequence - 1.
  struct Binding {
    uint32_t* flags = nullptr;
    std::shared_ptr<const void> keep;
    uint64_t base = 0;
    uint32_t sequence = 0;  // the newest wait's
    uint64_t ticket = 0;    // the newest wait's step
    // The trainer's own last ready flag, once a rescue read it (a later
    // read may see the rescue's write).
    bool ready_known = false;
    uint32_t ready_seen = 0;
  };
  // Bindings kept: a broken step stream binds anew, and a step on the
  // flags before may still wait.
  static constexpr size_t kBindings = 4;

  StepRescue(StateStorage words, StateStorage read)
      : words_(std::move(words)), read_(std::move(read)) {}

  // Widens the abandoned range to [first, through] (every rescued range
  // stays covered until its steps have run: skipping more is the safe
  // side).
  void MarkLocked(uint64_t first, uint64_t through)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Binding b's ready flag, read on `side` by `deadline`.
  absl::StatusOr<uint32_t> ReadReadyLocked(const Binding& b, RescueStream side,
                                           absl::Time deadline)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  Mutex mu_;
  StateStorage words_;  // cuda::AbandonedSteps, pinned
  StateStorage read_;   // uint32_t, pinned: a flag read back
  std::deque<Binding> bindings_ ABSL_GUARDED_BY(mu_);  // newest last
  bool gone_ ABSL_GUARDED_BY(mu_) = false;  // since the newest binding
  bool marked_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t first_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t through_ ABSL_GUARDED_BY(mu_) = 0;
};

// Waits for `side`'s work so far, polling until `deadline`.
absl::Status SyncBefore(RescueStream side, absl::Time deadline);

}  // namespace optimd

#endif  // OPTIMD_BACKENDS_CUDA_TRAINER_GONE_H_
