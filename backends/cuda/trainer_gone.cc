#include "backends/cuda/trainer_gone.h"

#include <atomic>
#include <cstring>
#include <utility>

#include "backends/cuda/cuda_status.h"
#include "backends/cuda/device_memory.h"
#include "common/status_macros.h"

namespace optimd {

absl::StatusOr<std::unique_ptr<StepRescue>> StepRescue::Create() {
  OPTIMD_ASSIGN_OR_RETURN(StateStorage words,
                          PinnedHostAlloc(sizeof(cuda::AbandonedSteps)));
  std::memset(words.data(), 0, sizeof(cuda::AbandonedSteps));
  OPTIMD_ASSIGN_OR_RETURN(StateStorage ready_read,
                          PinnedHostAlloc(sizeof(uint32_t)));
  return std::unique_ptr<StepRescue>(
      new StepRescue(std::move(words), std::move(ready_read)));
}

void StepRescue::NoteWait(uint32_t* flags, std::shared_ptr<const void> keep,
                          uint32_t sequence, uint64_t ticket) {
  MutexLock lock(&mu_);
  // Flags bound anew start at sequence 1 (Session::BindStepFlags).
  if (flags != flags_ || sequence == 1) ready_known_ = false;
  flags_ = flags;
  keep_ = std::move(keep);
  sequence_ = sequence;
  ticket_ = ticket;
}

absl::StatusOr<bool> StepRescue::Rescue(const DriverFns& driver,
                                        cudaStream_t side) {
  MutexLock lock(&mu_);
  if (flags_ == nullptr) return false;
  auto* ready = reinterpret_cast<volatile uint32_t*>(ready_read_.data());
  OPTIMD_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(ready_read_.data(), flags_,
                                              sizeof(uint32_t),
                                              cudaMemcpyDeviceToHost, side));
  OPTIMD_RETURN_IF_CUDA_ERROR(cudaStreamSynchronize(side));
  const uint32_t seen = *ready;
  // cuStreamWaitValue32's cyclic order (driver_fns.h WaitStepFlag).
  if (static_cast<int32_t>(seen - sequence_) >= 0) return false;
  if (!ready_known_) {
    ready_seen_ = seen;
    ready_known_ = true;
  }
  auto* words = reinterpret_cast<cuda::AbandonedSteps*>(words_.data());
  reinterpret_cast<volatile uint32_t&>(words->ready_seen) = ready_seen_;
  reinterpret_cast<volatile uint64_t&>(words->through_ticket) = ticket_;
  // The kernels of the steps let through read the words only after the
  // flag's write below, which the driver issues after these stores.
  std::atomic_thread_fence(std::memory_order_seq_cst);
  OPTIMD_RETURN_IF_ERROR(WriteStepFlag(driver, side, flags_, sequence_));
  OPTIMD_RETURN_IF_CUDA_ERROR(cudaStreamSynchronize(side));
  return true;
}

}  // namespace optimd
