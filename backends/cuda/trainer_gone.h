// Steps whose trainer died before its stream marked them ready. Such a step
// waits on the device's stream for a ready flag that nobody will write
// (cuStreamWaitValue32 on the trainer's step flags), and every session on
// the GPU waits behind it. StepRescue lets them through: it writes the
// ready flag itself, on a stream of its own, after marking the steps
// abandoned (kernels/cuda_step_types.h AbandonedSteps), so that their
// kernels skip them: their gradients may be incomplete, and the session
// keeps the state of its last whole step for a resume. In a job the skip
// is every rank's (the all-reduced non-finite flag).
//
// Thread-safe: the device's worker notes each wait, and any thread may
// rescue (the session reaper, an eviction), never waiting for the
// device's stream or its worker.
#ifndef OPTIMD_BACKENDS_CUDA_TRAINER_GONE_H_
#define OPTIMD_BACKENDS_CUDA_TRAINER_GONE_H_

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "backends/cuda/driver_fns.h"
#include "common/mutex.h"
#include "core/buffer.h"
#include "kernels/cuda_step_types.h"

namespace optimd {

class StepRescue {
 public:
  // The session's AbandonedSteps and a pinned word for reading the flag.
  static absl::StatusOr<std::unique_ptr<StepRescue>> Create();

  // What the step records point their kernels at.
  const volatile cuda::AbandonedSteps* words() const {
    return reinterpret_cast<const cuda::AbandonedSteps*>(words_.data());
  }

  // The device's worker, before it enqueues a wait for the ready flag
  // `flags[0]` >= `sequence` (a step, or a refused step's release) on
  // behalf of the session's step `ticket`; `keep` keeps the flags mapped.
  void NoteWait(uint32_t* flags, std::shared_ptr<const void> keep,
                uint32_t sequence, uint64_t ticket) ABSL_LOCKS_EXCLUDED(mu_);

  // The session's trainer is gone: if its newest wait is not satisfied,
  // marks the waiting steps abandoned and writes the ready flag on `side`
  // (a non-blocking stream of the session's GPU, current), and waits for
  // that write. True when it let steps through. Calling it again is
  // harmless: it acts only on waits noted since.
  absl::StatusOr<bool> Rescue(const DriverFns& driver, cudaStream_t side)
      ABSL_LOCKS_EXCLUDED(mu_);

 private:
  StepRescue(StateStorage words, StateStorage ready_read)
      : words_(std::move(words)), ready_read_(std::move(ready_read)) {}

  Mutex mu_;
  StateStorage words_;       // cuda::AbandonedSteps, pinned
  StateStorage ready_read_;  // uint32_t, pinned: the flag read back
  uint32_t* flags_ ABSL_GUARDED_BY(mu_) = nullptr;
  std::shared_ptr<const void> keep_ ABSL_GUARDED_BY(mu_);
  uint32_t sequence_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t ticket_ ABSL_GUARDED_BY(mu_) = 0;
  // The trainer's own last ready flag on these flags, once read: a later
  // read may see the rescue's write.
  bool ready_known_ ABSL_GUARDED_BY(mu_) = false;
  uint32_t ready_seen_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace optimd

#endif  // OPTIMD_BACKENDS_CUDA_TRAINER_GONE_H_
