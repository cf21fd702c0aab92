// The CPU backend: trainer buffers are POSIX shared-memory segments, state
// lives in the daemon's heap, and steps run the reference kernels of
// kernels/adamw/adamw_cpu.h over a thread pool. The embedded default, and the
// reference every other backend is checked against.
#ifndef OPTIMD_BACKENDS_CPU_CPU_BACKEND_H_
#define OPTIMD_BACKENDS_CPU_CPU_BACKEND_H_

#include <atomic>
#include <memory>

#include "backends/cpu/shm_segment.h"
#include "common/mutex.h"
#include "common/thread_pool.h"
#include "core/backend.h"

namespace optimd {

class CpuBackend final : public Backend {
 public:
  struct Options {
    // Worker threads for steps; 0 means one per hardware thread.
    int threads = 0;
    // Elements per work item of a plan.
    uint64_t item_elements = 1 << 16;
    // Trainers' shared-memory segments open at most (SegmentCache).
    int64_t max_open_segments = SegmentCache::kDefaultMaxOpen;
  };

  explicit CpuBackend(const Options& options);

  BackendKind kind() const override { return BackendKind::kCpu; }
  bool HostAddressable() const override { return true; }
  absl::StatusOr<BufferRef> ResolveBuffer(const BufferHandle& handle,
                                          uint64_t alignment,
                                          const std::string& what) override;
  absl::StatusOr<StateStorage> AllocateState(uint64_t bytes) override;
  absl::Status PrepareGroup(Group& group) override;
  void ForgetTrainerBuffers(
      const std::vector<std::shared_ptr<const void>>& mappings) override;
  absl::Status UpdatePlanEntries(Group& group,
                                 const std::vector<uint32_t>& entries) override;
  absl::StatusOr<std::unique_ptr<SessionContext>> OpenSession(
      int device, const std::string& ready_event,
      std::string* done_event) override;
  absl::StatusOr<StepOutcome> Step(SessionContext* session,
                                   const std::vector<Group*>& groups,
                                   const StepOptions& options) override;
  absl::Status WriteParams(Group& group) override;
  absl::Status AdoptWrittenParam(const TensorEntry& t) override;
  absl::Status CheckMappings(
      const std::vector<std::shared_ptr<const void>>& mappings) override;

  absl::Status CopyToHost(const uint8_t* src, uint8_t* dst,
                          uint64_t bytes) override;
  absl::Status CopyFromHost(const uint8_t* src, uint8_t* dst,
                            uint64_t bytes) override;

  const SegmentCache& segments() const { return segments_; }

 private:
  // The sum of squares of every gradient of `groups` (non-finite when an
  // element is); sets fault_ when a trainer's segment faulted.
  double SumSquares(const std::vector<Group*>& groups)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(pool_mu_);
  // One update of every group with the session's scale and clip
  // coefficient; sets fault_ when a trainer's segment faulted.
  void Update(const std::vector<Group*>& groups, double scale, double clip)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(pool_mu_);
  // The statistics pass of a step, and the job's sum of squares when the
  // session's ranks exchange them (waiting without holding pool_mu_).
  absl::StatusOr<double> Statistics(const std::vector<Group*>& groups,
                                    const StepOptions& options)
      ABSL_LOCKS_EXCLUDED(pool_mu_);
  // ZeRO (StepOptions::gather_params): publishes this rank's updated parts
  // through the exchange and copies every other rank's into the trainer's
  // whole parameters (core/rank_exchange.h: Gather); `failed` (this
  // rank's update failed) makes every rank's gather fail instead.
  absl::Status GatherParams(const std::vector<Group*>& groups,
                            const StepOptions& options, bool failed)
      ABSL_LOCKS_EXCLUDED(pool_mu_);

  const Options options_;
  SegmentCache segments_;
  // Steps of sessions whose ranks exchange statistics run on threads of
  // their own (the daemon's per-session workers), so the pool, the partial
  // sums and the fault flag are used under this lock; a step waiting for
  // other ranks does not hold it.
  Mutex pool_mu_;
  ThreadPool pool_;
  // Per-worker partial sums, reused across steps (no allocation per step).
  std::vector<double> partial_sums_ ABSL_GUARDED_BY(pool_mu_);
  // Set by a worker whose access faulted (a segment shrank mid-step).
  std::atomic<bool> fault_{false};
};

}  // namespace optimd

#endif  // OPTIMD_BACKENDS_CPU_CPU_BACKEND_H_
