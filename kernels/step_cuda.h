// Launchers of one session's CUDA step, for every optimizer. Plain C++: no
// CUDA headers, so that host code including this file builds without nvcc.
// The __global__ code is private to step_cuda.cu and to each optimizer's
// kernels/<optimizer>/<optimizer>_cuda.cu.
//
// A step of one session on one GPU is, all on one stream:
//   1. LaunchGradSumSquares per plan launch of every group: one partial sum
//      of squares (double) per work block.
//   2. LaunchReduceSums, once: reduces each group's partials in a fixed
//      order (deterministic: no atomics), adds the groups' sums in order
//      into the session's total; then, for the ranks of a job, the job's
//      all-reduce of that total (backends/cuda/nccl_job.h); then
//      LaunchMakeScalars, once: if the job's total is not finite the step
//      is skipped; otherwise it derives the clip coefficient and, from each
//      group's device-resident step counter and optimizer, its step
//      scalars, into the group's DeviceScalars.
//   3. LaunchUpdate per plan launch of every group: unless skipped, updates
//      its items with the group's optimizer (kernels/<optimizer>/).
//   4. LaunchCommitSteps, once: advances the counters unless skipped,
//      records the step's norm and skipped flag, and writes them to the
//      step's record in pinned host memory.
// The host never waits for the GPU in between: the skip decision and the
// clip coefficient are read by the kernels from device memory. Per-step
// arguments travel in pinned host memory that the kernels read directly,
// so a step of one group with one layout is four launches.
#ifndef OPTIMD_KERNELS_STEP_CUDA_H_
#define OPTIMD_KERNELS_STEP_CUDA_H_

#include <cstdint>

#include "absl/status/status.h"
#include "core/layout.h"
#include "core/optimizer.h"
#include "kernels/cuda_step_types.h"

namespace optimd {
namespace cuda {

// One partial sum of squares per work block: partials[b] for blocks[b],
// each summed in a fixed order (the same total on every run of the same
// plan). The statistics pass reads one stream where the update reads four
// or more, so its work blocks are coarser (backends/cuda/device_plan.cc).
absl::Status LaunchGradSumSquares(DType grad_dtype, const Work& work,
                                  double* partials, Stream stream);

// The first half of step 2 for n groups. `args`: n GroupSteps in pinned
// host memory (device-accessible); copied to `scratch` (device memory, n
// GroupSteps) for the rest of the step. sums: device memory for n + 3
// doubles: each group's sum of squares, then the session's share of the
// job's total (0 unless `contributes`; 0 when not finite), 1 when the
// session's total is not finite (else 0), and 1 (the three summed across
// a job's ranks). Without `statistics` every sum is zero (nothing is skipped,
// nothing clipped).
absl::Status LaunchReduceSums(const GroupStep* args, GroupStep* scratch,
                              uint32_t n, bool statistics, bool contributes,
                              double* sums, Stream stream);
// The second half of step 2: each group's step scalars from the job's
// total in sums[n..n + 2] over `ranks` ranks (1 without a job): skipped
// when any rank's was not finite or not every rank's is in.
absl::Status LaunchMakeScalars(const GroupStep* scratch, uint32_t n,
                               const double* sums, uint32_t ranks,
                               Stream stream);

// Step 3 above: the update kernel of the group's optimizer (hyper.kind)
// for `layout` over `work`; an optimizer reads what its kernels take as
// template parameters from `hyper` (AdamW: decoupled decay or Adam's L2).
absl::Status LaunchUpdate(const OptimizerHyper& hyper, const Layout& layout,
                          const Work& work, const DeviceScalars* scalars,
                          Stream stream);

// Step 4 above (the job's total as LaunchMakeScalars reads it): advances
// each group's counters and `totals` (the session's)
// and its absent tensors' missed steps unless the step was skipped, and
// copies the counters to report[0] (totals) and report[1 + g] (pinned host
// memory, n + 1 entries).
absl::Status LaunchCommitSteps(const GroupStep* scratch, uint32_t n,
                               const double* sums, uint32_t ranks,
                               DeviceGroupState* totals,
                               DeviceGroupState* report, Stream stream);

// *word = value, once the work before it in `stream` is complete: a staged
// step's progress (StepRequest.staged), which the trainer's stream waits
// for with cuStreamWaitValue32. A kernel, not a stream memory operation, so
// that it is captured into the step graph like the updates around it.
absl::Status LaunchWriteProgress(uint32_t* word, uint32_t value, Stream stream);

// *where = the GPU's global timer (nanoseconds, the same clock in every
// context on the device) when `stream` reaches this kernel: the step's
// own stamps in 32-byte step flags (StepRequest.step_flags), which a
// trainer sets beside stamps of its own stream (bench/step_trace.py).
absl::Status LaunchStampGlobalTimer(uint64_t* where, Stream stream);

// dst[i] = src[i] converted (exact widening, or rounding to nearest even),
// for i < n. Used for master weights at registration and GetParams.
absl::Status LaunchConvert(DType src_dtype, const void* src, DType dst_dtype,
                           void* dst, uint64_t n, Stream stream);

// *skip = 1 when step `ticket` is among the `abandoned` steps (a gone
// trainer's: its writes may be partial), else 0: read once, after the
// step's wait for its ready flag, for the adopt kernels of that step
// (`abandoned` is in pinned host memory, which every block reading it
// would cross the bus for).
absl::Status LaunchNoteAbandoned(const volatile AbandonedSteps* abandoned,
                                 uint64_t ticket, uint32_t* skip,
                                 Stream stream);

// master[i] = param[i] widened where param[i] differs, bit for bit, from
// master[i] rounded to param_dtype (bf16, fp16 or fp32), for i < n: the
// trainer's writes into a parameter (AdoptWrittenParamRange's rule,
// kernels/master_cpu.h). With `skip` (device memory,
// LaunchNoteAbandoned's), nothing when *skip is non-zero.
absl::Status LaunchAdoptWritten(DType param_dtype, const void* param,
                                float* master, uint64_t n, Stream stream,
                                const uint32_t* skip = nullptr);

// A remainder layout's rule (AdoptWrittenParamRange): remainder[i] = 0
// where the bf16 param[i] is +-0 or +-inf, for i < n; `skip` as
// LaunchAdoptWritten's.
absl::Status LaunchAdoptWrittenRemainder(const void* param, void* remainder,
                                         uint64_t n, Stream stream,
                                         const uint32_t* skip = nullptr);

}  // namespace cuda
}  // namespace optimd

#endif  // OPTIMD_KERNELS_STEP_CUDA_H_
