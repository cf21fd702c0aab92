// A step's kernels in their order on one stream (kernels/step_cuda.h):
// the statistics pass over every group, the sums reduced, for a job's
// ranks the all-reduce of the job's total, the step scalars, the updates
// (all at once, or stage by stage writing the progress word), and the
// commit of the counters into the step's record. Enqueued eagerly or into
// a graph being captured (step_graph.h): the same calls either way. Not
// thread-safe: the device's worker enqueues.
#ifndef OPTIMD_BACKENDS_CUDA_STEP_KERNELS_H_
#define OPTIMD_BACKENDS_CUDA_STEP_KERNELS_H_

#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "backends/cuda/cuda_session.h"
#include "backends/cuda/nccl_job.h"
#include "core/buffer.h"
#include "core/group.h"

namespace optimd {

// A progress word's value past every stage (the trainer's waits compare
// with cuStreamWaitValue32's cyclic >=, so values stay below 2^31).
constexpr uint32_t kPastEveryStage = 0x7FFFFFFF;

// The backend's per-step scratch in device memory: per group of the
// stepping session its sum of squares (then the job's total, non-finite
// and rank counts) and a device copy of its arguments. `generation`
// changes whenever the memory is reallocated, which makes graphs bound to
// the old memory stale (RefreshGraphKey).
struct StepScratch {
  StateStorage sums_d, steps_d;
  uint32_t capacity = 0;  // groups
  uint64_t generation = 0;
};

// Reallocates `scratch` on GPU `device` for at least `groups` groups, if
// it holds fewer; the device's stream must be idle.
absl::Status GrowStepScratch(int device, uint32_t groups, StepScratch& scratch);

// Enqueues on `stream` the kernels of a step of `groups` of session `s`
// with `record`'s arguments, writing its outcome into the record:
// `statistics` runs the statistics pass; with `progress`, the updates
// stage by stage, writing *progress = stage + 1 after each (past every
// stage after the last); with `lease` (a job's session), the ranks'
// all-reduce.
absl::Status EnqueueStepKernels(const CudaSession& s,
                                const std::vector<Group*>& groups,
                                const StepRecord& record,
                                const StepScratch& scratch, bool statistics,
                                uint32_t* progress, NcclJob::Lease* lease,
                                cudaStream_t stream);

}  // namespace optimd

#endif  // OPTIMD_BACKENDS_CUDA_STEP_KERNELS_H_
