// The ranks of one job agreeing on each step's gradient statistics on the
// device: one NCCL communicator per job, one rank per session. Each step
// all-reduces three doubles (the job's sum of squares, a count of ranks
// whose gradients are not finite, a count of ranks) on the backend's
// stream, between the statistics pass and the update, inside the step's
// graph: no host waits there.
//
// A rank that never joins, or stops stepping, would leave the others'
// streams waiting in NCCL forever: every host wait for such a step is
// bounded by the job's timeout, after which the communicator is ended
// (ncclCommAbort), its pending collectives return, and the session's later
// steps are refused with the reason.
#ifndef OPTIMD_BACKENDS_CUDA_NCCL_JOB_H_
#define OPTIMD_BACKENDS_CUDA_NCCL_JOB_H_

#include <cuda_runtime.h>
#include <nccl.h>

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
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
  // (sharded gradients); rank 0's only (replicated: every rank holds the
  // same gradient).
  bool contributes_norm() const;

  // Waits until every rank has joined and the connections are made (one
  // warm-up all-reduce on `stream`, outside any graph capture), at most
  // the job's timeout from Join; then DEADLINE_EXCEEDED, and the job ends.
  absl::Status AwaitReady(cudaStream_t stream);
  // Enqueues the all-reduce (sum) of values[0..2] in place on `stream`
  // (eagerly or into a graph being captured).
  absl::Status EnqueueAllReduce(double* values, cudaStream_t stream);
  // Waits for `event` (recorded after a step of this job); a wait longer
  // than the job's timeout ends the job (DEADLINE_EXCEEDED).
  absl::Status Wait(cudaEvent_t event);
  // Ends the communicator (its pending collectives return); later calls
  // fail with FAILED_PRECONDITION naming `why`.
  void Abort(const std::string& why);
  absl::Duration timeout() const { return job_.timeout; }
  uint32_t world_size() const { return job_.world_size; }

 private:
  NcclJob(int device, Backend::DeviceJob job) : device_(device), job_(job) {}
  // Polls the communicator until its last call is no longer in progress,
  // until `deadline`.
  absl::Status Settle(absl::Time deadline, const char* what);
  std::string Name() const;

  const int device_;
  const Backend::DeviceJob job_;
  std::string unique_id_;
  ncclComm_t comm_ = nullptr;
  absl::Time joined_;
  bool ready_ = false;
  absl::Status ended_;  // not OK once aborted
  double* warm_d_ = nullptr;
};

}  // namespace optimd

#endif  // OPTIMD_BACKENDS_CUDA_NCCL_JOB_H_
