// The ranks of one job agreeing on each step's gradient statistics on the
// device: one NCCL communicator per job, one rank per session. Each step
// all-reduces three doubles (the job's sum of squares, a count of ranks
// whose gradients are not finite, a count of ranks) on the backend's
// stream, between the statistics pass and the update, inside the step's
// graph: no host waits there.
//
// A rank that never joins, or stops stepping, would leave the others'
// streams waiting in NCCL forever: a watchdog thread follows every step
// of the job (Watch) and every host wait for one is bounded by the job's
// timeout, after which the communicator is ended (ncclCommAbort), its
// pending collectives return (the step they were in is skipped: not every
// rank's values are in), and the session's later steps are refused with
// the reason. With sharded state (ZeRO, core/state_shard.h) each step
// also broadcasts every rank's updated part of the parameters from its
// owner into the other ranks' parameters, after the step's graph, on the
// same stream. Thread-safe: the backend's worker steps, the watchdog ends.
#ifndef OPTIMD_BACKENDS_CUDA_NCCL_JOB_H_
#define OPTIMD_BACKENDS_CUDA_NCCL_JOB_H_

#include <cuda_runtime.h>
#include <nccl.h>

#include <deque>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/mutex.h"
#include "core/backend.h"

namespace optimd {

class NcclJob {
 public:
  // Starts joining (non-blocking): rank 0 without a unique id makes one.
  // INVALID_ARGUMENT for a unique id of the wrong size or a missing one on
  // another rank.
  static absl::StatusOr<std::unique_ptr<NcclJob>> Join(
      int device, const Backend::DeviceJob& job);
  ~NcclJob();
  NcclJob(const NcclJob&) = delete;
  NcclJob& operator=(const NcclJob&) = delete;

  const std::string& unique_id() const { return unique_id_; }
  // Whether this rank's sum of squares counts in the job's: every shard's
  // (sharded gradients, or sharded state: each rank sums its part); rank
  // 0's only (replicated: every rank holds the same gradient).
  bool contributes_norm() const;

  // Waits until every rank has joined and the connections are made (one
  // warm-up all-reduce on `stream`, outside any graph capture), at most
  // the job's timeout from Join; then DEADLINE_EXCEEDED, and the job ends.
  absl::Status AwaitReady(cudaStream_t stream) ABSL_LOCKS_EXCLUDED(mu_);

  // The communicator held for one step's launch: while a Lease lives the
  // job cannot end (Abort waits for it), so no NCCL call and no graph
  // launch meets a communicator that ncclCommAbort has freed.
  class ABSL_SCOPED_LOCKABLE Lease {
   public:
    explicit Lease(NcclJob& job) ABSL_EXCLUSIVE_LOCK_FUNCTION(job.mu_)
        : job_(job) {
      job_.mu_.Lock();
    }
    ~Lease() ABSL_UNLOCK_FUNCTION() { job_.mu_.Unlock(); }
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;

    // Not OK once the job has ended.
    absl::Status status() const;
    // Enqueues the all-reduce (sum) of values[0..2] in place on `stream`
    // (eagerly or into a graph being captured).
    absl::Status EnqueueAllReduce(double* values, cudaStream_t stream);
    // Enqueues on `stream` (eagerly, never into a graph: the trainer's
    // buffers may move between steps) the parameter gather of a step of
    // sharded state: for every rank r and every sharded tensor of `groups`
    // with elements in r's part, a broadcast of those elements of the
    // whole parameter from rank r, in NCCL groups of at most
    // kGatherOpsPerGroup. Every rank enqueues the same sequence, since
    // the ranks registered the same tensors.
    absl::Status EnqueueGather(const std::vector<Group*>& groups,
                               cudaStream_t stream);
    // Follows the step just enqueued on `stream`: if it has not completed
    // within the job's timeout, the watchdog ends the job.
    absl::Status Watch(cudaStream_t stream);

   private:
    NcclJob& job_;
  };
  // Waits for `event` (recorded after a step of this job); a wait longer
  // than the job's timeout ends the job (DEADLINE_EXCEEDED).
  absl::Status Wait(cudaEvent_t event);
  // Ends the communicator (its pending collectives return); later calls
  // fail with FAILED_PRECONDITION naming `why`.
  void Abort(const std::string& why) ABSL_LOCKS_EXCLUDED(mu_);
  absl::Duration timeout() const { return job_.timeout; }
  uint32_t world_size() const { return job_.world_size; }

 private:
  NcclJob(int device, Backend::DeviceJob job) : device_(device), job_(job) {}
  // Polls the communicator until its last call is no longer in progress,
  // until `deadline` (then the job ends).
  absl::Status SettleLocked(absl::Time deadline, const char* what)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status EnqueueAllReduceLocked(double* values, cudaStream_t stream)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status EnqueueGatherLocked(const std::vector<Group*>& groups,
                                   cudaStream_t stream)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Ends an NCCL group of the gather (settling a non-blocking one).
  absl::Status EndGatherGroupLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void AbortLocked(const std::string& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::string Name() const;
  // Not OK once the job has ended.
  absl::Status Ended() const ABSL_LOCKS_EXCLUDED(mu_);
  // The watchdog: ends the job when the oldest step it follows is late.
  void WatchSteps() ABSL_LOCKS_EXCLUDED(mu_);

  const int device_;
  const Backend::DeviceJob job_;
  std::string unique_id_;
  // Set at Join; used only under mu_ while the job has not ended;
  // ncclCommAbort'ed (and freed) once, by AbortLocked.
  ncclComm_t comm_ = nullptr;
  absl::Time joined_;
  bool ready_ = false;  // the worker's only
  double* warm_d_ = nullptr;

  mutable Mutex mu_;
  absl::Status ended_ ABSL_GUARDED_BY(mu_);
  // Steps followed: an event recorded after each, and when it was.
  std::deque<std::pair<cudaEvent_t, absl::Time>> pending_ ABSL_GUARDED_BY(mu_);
  std::vector<cudaEvent_t> spare_events_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread watchdog_;
};

}  // namespace optimd

#endif  // OPTIMD_BACKENDS_CUDA_NCCL_JOB_H_
