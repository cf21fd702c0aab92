// A session's step records (cuda_session.h), the reports of its steps: a
// record filled with a step's arguments before the step is enqueued,
// recycled once its earlier step has completed, and read for the reply
// (the step's own outcome, or the newest completed one), and the key that
// tells when the records' step graphs are stale. Not thread-safe: used
// only by the device's worker.
#ifndef OPTIMD_BACKENDS_CUDA_STEP_RECORDS_H_
#define OPTIMD_BACKENDS_CUDA_STEP_RECORDS_H_

#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "backends/cuda/cuda_session.h"
#include "core/backend.h"
#include "core/group.h"

namespace optimd {

// The outcome in a completed `record` of session `s`, into *out and s.last;
// the groups' step counters from it when it was a step of `groups`.
absl::Status ReadRecord(CudaSession& s, StepRecord& record,
                        const std::vector<Group*>& groups, StepOutcome* out);

// Drops the step graphs of `s` when the groups, the backend's scratch
// memory (`scratch_generation`), the statistics flag or the progress word
// changed (compared in place: no allocation on a step that keeps them).
void RefreshGraphKey(CudaSession& s, const std::vector<Group*>& groups,
                     bool statistics, uint64_t scratch_generation,
                     uint32_t* progress);

// The record's memory (grown to hold `groups`, dropping its graph then) and
// every group's arguments. `apply_nonfinite`: a non-finite gradient norm
// does not skip the step (StepOptions::assume_finite, no job). `ticket`:
// the session's number of the step, which `abandoned` (the session's
// StepRescue::words) compares.
absl::Status FillRecord(StepRecord& record, const std::vector<Group*>& groups,
                        const StepOptions& options, bool apply_nonfinite,
                        uint64_t ticket,
                        const volatile cuda::AbandonedSteps* abandoned);

// Waits for `event`, recorded after a step of `s` (bounded by the job's
// timeout for a job's session: NcclJob::Wait).
absl::Status WaitForStep(const CudaSession& s, cudaEvent_t event);

// Makes `record` free for the next step: waits for its earlier step and
// reads it if no newer one has been read (a failed launch's never is).
absl::Status RecycleRecord(CudaSession& s, StepRecord& record,
                           const std::vector<Group*>& groups);

// The outcome a step reply reports for step `seq`, held in `record`: with
// `wait`, that step's own (a host wait); else the newest completed step's
// (`current` when that is step `seq`), reading the records completed since
// the last read in stream order.
absl::StatusOr<StepOutcome> ReadOutcome(CudaSession& s, StepRecord& record,
                                        const std::vector<Group*>& groups,
                                        bool wait, uint64_t seq);

}  // namespace optimd

#endif  // OPTIMD_BACKENDS_CUDA_STEP_RECORDS_H_
