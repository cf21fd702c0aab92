// The interface between sessions (core) and the memory and kernels of one
// backend (CPU reference or CUDA). A session calls it only from the device
// worker that owns the backend, so implementations need not be thread-safe
// except where a method says so.
#ifndef OPTIMD_CORE_BACKEND_H_
#define OPTIMD_CORE_BACKEND_H_

#include <atomic>
#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "core/buffer.h"
#include "core/group.h"
#include "core/rank_exchange.h"

namespace optimd {

// Bytes of memory the kernel can hand out without swapping (MemAvailable of
// /proc/meminfo); 0 if unknown.
uint64_t HostMemoryAvailable();

// RESOURCE_EXHAUSTED naming `what` when `bytes` of host memory, all of which
// will be touched, exceed HostMemoryAvailable(): better refused than an
// out-of-memory kill of the daemon.
absl::Status CheckHostMemory(uint64_t bytes, const std::string& what);

enum class BackendKind { kCpu, kCuda };

// Counters shared by the backend and the sessions; read by metrics.
struct Counters {
  std::atomic<uint64_t> plan_builds{0};
  std::atomic<uint64_t> plan_entry_updates{0};
  std::atomic<uint64_t> steps{0};
  std::atomic<uint64_t> skipped_steps{0};
};

struct StepOptions {
  // Gradients are divided by this (1 when <= 0).
  double grad_scale = 1.0;
  // Clip the global gradient norm to this; <= 0 disables clipping.
  double max_grad_norm = 0.0;
  // Wait for the step to complete and report its own outcome. Backends that
  // run steps asynchronously (CUDA) otherwise report the last completed
  // step's outcome; the CPU backend always completes the step.
  bool wait = false;
  // The trainer takes charge of non-finite gradients, as torch's optimizers
  // leave it to the trainer: a step is never skipped for them. Without
  // clipping the statistics pass is left out (4 fewer bytes read per fp32
  // parameter) and an inf or NaN reaches the update; with clipping a
  // non-finite norm gives torch's clip coefficient (ClipCoefficient: NaN or
  // 0). A session whose ranks agree on the statistics (exchange, or a CUDA
  // job) still skips: there a non-finite sum also stands for a failed rank.
  // False: a step with a non-finite gradient is skipped, nothing changes.
  bool assume_finite = false;
  // Step flags (StepRequest.step_flags): two uint32 in device memory, [0]
  // ready, [1] done; null without. The step waits for ready >= sequence
  // and writes done = sequence after its work.
  uint32_t* step_flags = nullptr;
  std::shared_ptr<const void> step_flags_mapping;  // keeps them mapped
  uint32_t sequence = 0;
  // 2, or 3 with a progress word ([2]), which a released step sets past
  // every stage, or 8: also the global-timer stamps of the step's start
  // and end on the device ([4..5] and [6..7], uint64; CUDA backend).
  uint32_t step_flag_words = 2;
  // The sequence follows the last one (Session::BindStepFlags accepted
  // it): the trainer's stream writes ready = sequence, so a released step
  // may wait for it.
  bool sequence_in_order = false;
  // Staged (StepRequest.staged; needs three step-flag words): the update
  // runs stage by stage (TensorEntry::stage) and writes step_flags[2] =
  // s + 1 after stage s.
  bool staged = false;
  // The ranks of the session's job agree on the statistics
  // (core/rank_exchange.h): the backend contributes this rank's sum of
  // squares and steps with the job's, giving up at the deadline with
  // nothing changed. Null: the session's own statistics. CPU backend only.
  RankExchange* exchange = nullptr;
  uint32_t rank = 0;
  absl::Time exchange_deadline;
  // ZeRO (SessionIdentity::shard_state): each group's tensor entries are
  // this rank's parts (TensorEntry::sharded); after the update the backend
  // gathers every rank's updated parts into the trainer's whole
  // parameters (TensorEntry::full_param): CPU through `exchange`, CUDA
  // through the job's communicator, so that the trainer reads no
  // parameter before every rank's part is written.
  bool gather_params = false;
  // Set to true by the backend once it contributed to the exchange (the
  // session contributes a non-finite sum for a step that failed before, so
  // that the other ranks skip that step instead of waiting for this one).
  bool* exchanged = nullptr;
  // Tensors whose parameters the trainer wrote before this step (a step's
  // buffer updates with param_written): the backend adopts them as
  // masters (AdoptWrittenParam) after the step's wait for the ready flag
  // and before the update, skipped step or not; ReleaseStep too, when the
  // step failed. Null or empty: none.
  const std::vector<const TensorEntry*>* written = nullptr;
};

struct StepOutcome {
  // False when no step of the session has completed yet (asynchronous
  // backends only); the fields below are then meaningless.
  bool known = true;
  // True when the outcome is of the step just requested.
  bool current = true;
  bool skipped = false;
  // L2 norm of the unscaled gradients before clipping, as
  // StepResponse.grad_norm says: NaN for a skipped step and for a step
  // without the statistics pass.
  double grad_norm = 0.0;
  // The session's totals as of the reported step.
  uint64_t steps_applied = 0;
  uint64_t steps_skipped = 0;
  // Device timing of the reported step, on backends that time their steps
  // (CUDA): how long the device's stream waited for the trainer's ready
  // flag once it reached the step, and how long the step's own work ran.
  // NaN where not timed. `timing_fresh`: the reported step was read by
  // this call (an asynchronous outcome can repeat an earlier one).
  double device_wait_seconds = std::numeric_limits<double>::quiet_NaN();
  double device_seconds = std::numeric_limits<double>::quiet_NaN();
  bool timing_fresh = false;
};

// Per-session backend state (the CUDA backend's interprocess events and
// counters). Opaque to core.
struct SessionContext {
  virtual ~SessionContext() = default;
};

class Backend {
 public:
  virtual ~Backend() = default;

  virtual BackendKind kind() const = 0;

  // True when state and trainer buffers are host memory the daemon can read
  // and write directly (checkpoints then need no staging copies).
  virtual bool HostAddressable() const { return false; }

  // Maps (or finds cached) a trainer buffer region; checks it against the
  // real segment or allocation. `what` names the tensor in errors.
  // Thread-safe.
  virtual absl::StatusOr<BufferRef> ResolveBuffer(const BufferHandle& handle,
                                                  uint64_t alignment,
                                                  const std::string& what) = 0;

  // Allocates zeroed state memory. Thread-safe.
  virtual absl::StatusOr<StateStorage> AllocateState(uint64_t bytes) = 0;

  // Initializes a new group's master weights from its parameters (moments
  // are already zero) and builds its plan.
  virtual absl::Status PrepareGroup(Group& group) = 0;

  // Points plan entries `entries` of `group` at their tensors' current
  // buffers (a gradient absent from a tensor leaves its entry out of steps)
  // in stream order: steps already queued use the old pointers, later ones
  // the new. Costs the host about the entries' size, not the group's.
  virtual absl::Status UpdatePlanEntries(
      Group& group, const std::vector<uint32_t>& entries) = 0;

  // Opens the backend side of a session. `ready_event` is the trainer's
  // interprocess event handle (may be empty); on success `done_event` holds
  // the handle of the event the daemon records after each step (empty when
  // the backend has none).
  virtual absl::StatusOr<std::unique_ptr<SessionContext>> OpenSession(
      int device, const std::string& ready_event, std::string* done_event) = 0;

  // One optimizer step over all `groups` of a session: gradient statistics
  // over every group first, then, unless skipped, the update of each group
  // with t = group->step + 1. Updates the groups' step counters to what is
  // known (on asynchronous backends: as of the last completed step).
  virtual absl::StatusOr<StepOutcome> Step(SessionContext* session,
                                           const std::vector<Group*>& groups,
                                           const StepOptions& options) = 0;

  // The sessions of one job agreeing on each step's statistics on the
  // device (CUDA: one NCCL communicator per job): `session` joins as `rank`
  // of `world_size`, with rank 0's `unique_id` (empty on rank 0: the
  // backend makes one). Returns the job's unique id, for the other ranks.
  // The join completes in the background; steps wait for it at most
  // `timeout`, and a step that waits longer than `timeout` for the other
  // ranks ends the job's communicator (DEADLINE_EXCEEDED). UNIMPLEMENTED
  // where the ranks meet in the daemon instead (core/rank_exchange.h).
  struct DeviceJob {
    uint32_t rank = 0;
    uint32_t world_size = 1;
    GradientSharding sharding = GradientSharding::kNone;
    // ZeRO (SessionIdentity::shard_state): every rank's sum of squares
    // counts (each covers its part), and steps gather the parts.
    bool shard_state = false;
    std::string unique_id;
    absl::Duration timeout = absl::Seconds(600);
  };
  virtual absl::StatusOr<std::string> JoinJob(SessionContext* session,
                                              const DeviceJob& job) {
    return absl::UnimplementedError(
        "this backend's ranks agree in the daemon, not on the device");
  }

  // A step with step flags that failed or was refused: writes done =
  // options.sequence (and the progress word, if any, past every stage) in
  // stream order, so that the trainer's stream goes on. With a progress
  // word or written parameters (options.written), and
  // options.sequence_in_order, first waits for ready = sequence: the
  // trainer's stream resets the progress word, and finishes its writes,
  // before it writes ready; then adopts the written parameters.
  virtual absl::Status ReleaseStep(SessionContext* session,
                                   const StepOptions& options) {
    return absl::OkStatus();
  }

  // Brings the groups' step counters up to date (the CUDA backend keeps
  // them on the device; this waits for queued steps). For state reads.
  virtual absl::Status SyncGroupCounters(const std::vector<Group*>& groups) {
    return absl::OkStatus();
  }

  // Sets a group's step counter (state loads), on the device too.
  virtual absl::Status SetGroupStep(Group& group, uint64_t step) {
    group.step = step;
    return absl::OkStatus();
  }

  // Writes master weights into the trainer's parameter buffers.
  virtual absl::Status WriteParams(Group& group) = 0;

  // The trainer wrote tensor `t`'s parameter (UpdateBuffers'
  // param_written; the trainer has finished writing before the call):
  // each element it changed becomes its fp32 master's value
  // (AdoptWrittenParamRange, kernels/master_cpu.h). In stream order after
  // the steps queued before it, and before the steps queued after it.
  virtual absl::Status AdoptWrittenParam(const TensorEntry& t) = 0;

  // Checks that the distinct mappings (BufferRef::mapping) a session uses are
  // still valid, e.g. that no shared-memory segment was shrunk under them.
  // Cheap, allocation-free; called before every step.
  virtual absl::Status CheckMappings(
      const std::vector<std::shared_ptr<const void>>& mappings) = 0;

  // The trainer of `session` is gone (its process ended): the session's
  // steps that wait on the device for the trainer's ready flag, which will
  // never come, are let through as skipped steps, so that the device's
  // other sessions go on; true when there were such steps. Thread-safe,
  // unlike the other methods: called from any thread, never waiting for
  // the device's worker or its stream. CPU steps never wait so.
  virtual absl::StatusOr<bool> AbandonSteps(SessionContext* session) {
    return false;
  }

  // The trainer of a session is gone and the session freed: removes what
  // of its buffers would otherwise outlive both sides (the CPU backend
  // unlinks the shared-memory segments that still carry their names;
  // CUDA allocations end with their process). Never fails.
  virtual void ForgetTrainerBuffers(
      const std::vector<std::shared_ptr<const void>>& mappings) {}

  // Copies between backend memory (state or trainer buffers) and host
  // memory. Synchronous. Used by state reads and writes, never per step.
  virtual absl::Status CopyToHost(const uint8_t* src, uint8_t* dst,
                                  uint64_t bytes) = 0;
  virtual absl::Status CopyFromHost(const uint8_t* src, uint8_t* dst,
                                    uint64_t bytes) = 0;

  // Host memory for staging and snapshots (pinned on the CUDA backend, so
  // device copies into it run at full speed).
  virtual absl::StatusOr<StateStorage> AllocateHostStaging(uint64_t bytes);

  Counters& counters() { return counters_; }

 private:
  Counters counters_;
};

}  // namespace optimd

#endif  // OPTIMD_CORE_BACKEND_H_
