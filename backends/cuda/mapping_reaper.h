// Ends the CUDA backend's mappings of trainer memory (CUDA IPC handles,
// VMM regions) once the device's stream has finished the work queued
// before they were let go, on a thread of its own. The thread that lets go
// of a mapping (the device worker, mid-step) so never waits for the
// stream, where other sessions' steps may wait for their trainers' ready
// flags or a job's collectives: a wait there could stall every session of
// the GPU, and, where the trainer's stream waits for this session's next
// step before it writes another session's ready flag, never end.
#ifndef OPTIMD_BACKENDS_CUDA_MAPPING_REAPER_H_
#define OPTIMD_BACKENDS_CUDA_MAPPING_REAPER_H_

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/time/time.h"
#include "common/mutex.h"

namespace optimd {

// Thread-safe. Mappings handed to it must not be used by work queued on
// the stream after they are handed over (they are let go: nothing uses
// them any more).
class MappingReaper {
 public:
  // How long the destructor waits for the stream before it leaves the
  // mappings still pending open (the process is ending).
  static constexpr absl::Duration kDrainBound = absl::Seconds(10);

  MappingReaper(int device, cudaStream_t stream);
  MappingReaper(const MappingReaper&) = delete;
  MappingReaper& operator=(const MappingReaper&) = delete;
  ~MappingReaper();

  // Runs `end` (a mapping's closing) once the work queued on the stream
  // now has finished: at once, in the caller, when the stream is idle;
  // else on the reaper's thread. Where the stream cannot be tracked (an
  // event cannot be recorded on it) the caller waits for it, as a last
  // resort.
  void Retire(std::function<void()> end) ABSL_LOCKS_EXCLUDED(mu_);

  // The stream is about to be destroyed (its backend ends): waits, as the
  // destructor does, for the mappings pending; those let go of later are
  // ended at once, by the caller.
  void StreamEnds() ABSL_LOCKS_EXCLUDED(mu_);

  // Mappings ended so far, and those waiting for the stream.
  uint64_t ended() const { return ended_.load(std::memory_order_acquire); }
  int pending() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Pending {
    cudaEvent_t event = nullptr;  // recorded when the mapping was let go
    std::function<void()> end;
  };
  void Loop() ABSL_LOCKS_EXCLUDED(mu_);
  // Runs `end` and counts it.
  void End(const std::function<void()>& end);
  // Waits up to kDrainBound for the queue to empty; gives up on it (the
  // thread leaves the rest) when it does not.
  void DrainLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Waits for `event`; false when the destructor gave up on the stream.
  bool AwaitEvent(cudaEvent_t event) ABSL_LOCKS_EXCLUDED(mu_);

  const int device_;
  const cudaStream_t stream_;
  std::atomic<uint64_t> ended_{0};

  mutable Mutex mu_;
  std::deque<Pending> queue_ ABSL_GUARDED_BY(mu_);  // oldest first
  bool stream_gone_ ABSL_GUARDED_BY(mu_) = false;   // StreamEnds
  bool stop_ ABSL_GUARDED_BY(mu_) = false;     // drain, then end the thread
  bool abandon_ ABSL_GUARDED_BY(mu_) = false;  // end it now

  std::thread thread_;  // last: starts once the members above exist
};

}  // namespace optimd

#endif  // OPTIMD_BACKENDS_CUDA_MAPPING_REAPER_H_
