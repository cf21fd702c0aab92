#include "backends/cuda/trainer_gone.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "backends/cuda/cuda_status.h"
#include "backends/cuda/device_memory.h"
#include "common/status_macros.h"

namespace optimd {
namespace {

// cuStreamWaitValue32's cyclic order (driver_fns.h WaitStepFlag).
bool AtLeast(uint32_t value, uint32_t wanted) {
  return static_cast<int32_t>(value - wanted) >= 0;
}

}  // namespace

absl::Status SyncBefore(RescueStream side, absl::Time deadline) {
  OPTIMD_RETURN_IF_CUDA_ERROR(cudaEventRecord(side.event, side.stream));
  while (true) {
    const cudaError_t e = cudaEventQuery(side.event);
    if (e == cudaSuccess) return absl::OkStatus();
    if (e != cudaErrorNotReady) return CudaError(e, "the rescue stream");
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(
          "the daemon's rescue stream did not finish its reads and writes "
          "of a gone trainer's step flags in time");
    }
    absl::SleepFor(absl::Microseconds(100));
  }
}

absl::StatusOr<std::unique_ptr<StepRescue>> StepRescue::Create() {
  OPTIMD_ASSIGN_OR_RETURN(StateStorage words,
                          PinnedHostAlloc(sizeof(cuda::AbandonedSteps)));
  std::memset(words.data(), 0, sizeof(cuda::AbandonedSteps));
  OPTIMD_ASSIGN_OR_RETURN(StateStorage read, PinnedHostAlloc(sizeof(uint32_t)));
  return std::unique_ptr<StepRescue>(
      new StepRescue(std::move(words), std::move(read)));
}

bool StepRescue::NoteWait(uint32_t* flags, std::shared_ptr<const void> keep,
                          uint32_t sequence, uint64_t ticket) {
  // Mappings let go of here end after the lock: an idle stream's mapping
  // is closed in this thread (mapping_reaper.h).
  std::vector<std::shared_ptr<const void>> dropped;
  MutexLock lock(&mu_);
  // Flags bound anew start at sequence 1 (Session::BindStepFlags).
  if (bindings_.empty() || flags != bindings_.back().flags || sequence == 1) {
    Binding b;
    b.flags = flags;
    b.base = ticket - (sequence - 1);
    bindings_.push_back(std::move(b));
    gone_ = false;
    while (bindings_.size() > kBindings) {
      dropped.push_back(std::move(bindings_.front().keep));
      bindings_.pop_front();
    }
  }
  Binding& b = bindings_.back();
  dropped.push_back(std::exchange(b.keep, std::move(keep)));
  b.sequence = sequence;
  b.ticket = std::max(b.ticket, ticket);
  // A step whose ready flag the trainer wrote before it died is whole.
  if (!gone_ || !b.ready_known || AtLeast(b.ready_seen, sequence)) {
    return false;
  }
  MarkLocked(b.base + b.ready_seen, b.ticket);
  std::atomic_thread_fence(std::memory_order_seq_cst);
  return true;
}

void StepRescue::MarkLocked(uint64_t first, uint64_t through) {
  if (static_cast<int64_t>(through - first) < 0) return;  // no step
  if (marked_) {
    first = std::min(first, first_);
    through = std::max(through, through_);
  }
  marked_ = true;
  first_ = first;
  through_ = through;
  const uint64_t range =
      (static_cast<uint64_t>(static_cast<uint32_t>(through)) << 32) |
      static_cast<uint32_t>(first);
  reinterpret_cast<volatile cuda::AbandonedSteps*>(words_.data())->range =
      range;
}

absl::StatusOr<uint32_t> StepRescue::ReadReadyLocked(const Binding& b,
                                                     RescueStream side,
                                                     absl::Time deadline) {
  OPTIMD_RETURN_IF_CUDA_ERROR(
      cudaMemcpyAsync(read_.data(), b.flags, sizeof(uint32_t),
                      cudaMemcpyDeviceToHost, side.stream));
  OPTIMD_RETURN_IF_ERROR(SyncBefore(side, deadline));
  return *reinterpret_cast<volatile uint32_t*>(read_.data());
}

absl::StatusOr<bool> StepRescue::Rescue(const DriverFns& driver,
                                        RescueStream side,
                                        absl::Time deadline) {
  MutexLock lock(&mu_);
  std::vector<const Binding*> waiting;
  for (Binding& b : bindings_) {
    OPTIMD_ASSIGN_OR_RETURN(const uint32_t ready,
                            ReadReadyLocked(b, side, deadline));
    if (!b.ready_known) {  // the trainer is gone: its last word
      b.ready_seen = ready;
      b.ready_known = true;
    }
    if (AtLeast(ready, b.sequence)) continue;
    MarkLocked(b.base + b.ready_seen, b.ticket);
    waiting.push_back(&b);
  }
  // Later waits on the newest flags (the gone trainer's steps still
  // queued) are the worker's to let through.
  gone_ = !bindings_.empty();
  if (waiting.empty()) return false;
  // The kernels of the steps let through read the words only after the
  // flags' writes below, which the driver issues after these stores.
  std::atomic_thread_fence(std::memory_order_seq_cst);
  for (const Binding* b : waiting) {
    OPTIMD_RETURN_IF_ERROR(
        WriteStepFlag(driver, side.stream, b->flags, b->sequence));
  }
  OPTIMD_RETURN_IF_ERROR(SyncBefore(side, deadline));
  return true;
}

}  // namespace optimd
