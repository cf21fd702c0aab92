// Launchers of the fused CUDA step kernels. Plain C++: no CUDA headers, so
// that host code including this file builds without nvcc. The __global__
// code is private to adamw_cuda.cu.
//
// A step of one session on one GPU is, all on one stream:
//   1. LaunchGradSumSquares per plan launch of every group: one partial sum
//      of squares (double) per work block.
//   2. LaunchPrepareSteps, once: reduces each group's partials in a fixed
//      order (deterministic: no atomics), adds the groups' sums in order; if
//      the total is not finite the step is skipped; otherwise derives the
//      clip coefficient and, from each group's device-resident step counter,
//      its bias corrections, into the group's DeviceScalars.
//   3. LaunchAdamW per plan launch of every group: unless skipped, updates
//      its chunks.
//   4. LaunchCommitSteps, once: advances the counters unless skipped,
//      records the step's norm and skipped flag, and writes them to the
//      step's report slot in pinned host memory.
// The host never waits for the GPU in between: the skip decision and the
// clip coefficient are read by the kernels from device memory. Per-step
// arguments travel in pinned host memory that the kernels read directly,
// so a step of one group with one layout is four launches.
#ifndef OPTIMD_KERNELS_ADAMW_ADAMW_CUDA_H_
#define OPTIMD_KERNELS_ADAMW_ADAMW_CUDA_H_

#include <cstdint>

#include "absl/status/status.h"
#include "core/layout.h"

struct CUstream_st;

namespace optimd {
namespace cuda {

using Stream = CUstream_st*;

// Elements [begin, end) of one tensor, with the tensor's stream pointers
// (nullptr where the layout has no such stream), so that a kernel reaches
// the data through one descriptor. The chunk's first `tiles` * 256
// elements form tiles: 256 consecutive elements that one warp updates with
// fully coalesced 8- or 16-byte accesses (a chunk has tiles only when every
// stream is 16-byte aligned at `begin`). The rest are scalar elements,
// updated one per thread.
struct DeviceChunk {
  void* param;
  const void* grad;
  void* master;
  void* exp_avg;
  void* exp_avg_sq;
  void* max_exp_avg_sq;
  uint64_t begin;
  uint64_t end;
  uint32_t tiles;
  uint32_t entry;  // the plan entry (tensor) the chunk belongs to
  uint32_t pad[2];
};
static_assert(sizeof(DeviceChunk) % 16 == 0, "copied in 16-byte pieces");

constexpr uint32_t kTileElements = 256;

// One work block, one thread block's work: chunks [first, end) of the
// plan's chunk table, at most kMaxChunksPerBlock of them, walked as one
// flattened space of `tiles` tiles and one of `scalars` scalar elements.
// Small tensors share a work block, so a launch over 1e5 small tensors
// keeps its threads as busy as over a few large ones.
struct DeviceBlock {
  uint32_t first;
  uint32_t end;
  uint32_t tiles;
  uint32_t scalars;
};
constexpr uint32_t kMaxChunksPerBlock = 32;

// Hyperparameters of a group for one step, passed by value at launch.
struct StepHyper {
  double lr;
  double beta1;
  double beta2;
  double eps;
  double weight_decay;
  double grad_scale;     // >= 1 effective; <= 0 means 1
  double max_grad_norm;  // <= 0: no clipping
  int32_t adamw;
  int32_t bias_correction;
  int32_t maximize;
};

// The device-resident per-group counters.
// Also used for a session's totals (step = applied steps).
struct DeviceGroupState {
  uint64_t step;         // applied steps
  uint64_t skipped;      // skipped steps
  double last_sumsq;     // sum of squares of the last step's gradients
  int32_t last_skipped;  // 1 when the last step was skipped
  int32_t pad;
};

// Step scalars derived on the device once per group and step (see
// adamw_cpu.cc's MakeAdamWScalars: the same double arithmetic, rounded to
// float once); read by every block of the update.
// rbc2 is 1/bc2 rounded to nearest: dividing by bc2 then takes three
// operations and stays correctly rounded (kernels/cuda_math.cuh).
// The inputs of the bias corrections ride along, so that the update can
// derive them for a tensor whose own step count is lower (it missed steps
// without a gradient: Work::missed) with the same arithmetic.
struct DeviceScalars {
  float beta1, beta2, omb1, omb2, eps, decay, l2, bc2, rbc2, neg_step, grad_mul;
  int32_t skip;
  double lr, beta1_d, beta2_d;
  uint64_t t;  // the group's step number (applied steps + 1)
  int32_t bias_correction;
  int32_t pad;
};

constexpr int kThreadsPerBlock = 256;

// Work of one launch: one thread block per work block.
struct Work {
  const DeviceBlock* blocks;
  uint32_t num_blocks;
  const DeviceChunk* chunks;
  // Per plan entry, the group's applied steps in which the tensor had no
  // gradient (its own step number is t - missed[entry]).
  const uint32_t* missed;
};

// One partial sum of squares per work block: partials[b] for blocks[b],
// each summed in a fixed order (the same total on every run of the same
// plan). The statistics pass reads one stream where the update reads four
// or more, so its work blocks are coarser (cuda_backend.cc).
absl::Status LaunchGradSumSquares(DType grad_dtype, const Work& work,
                                  double* partials, Stream stream);

// One group's step arguments, written by the host into pinned memory.
struct alignas(16) GroupStep {
  StepHyper hyper;
  const double* partials;  // the group's partial sums of squares
  uint32_t num_partials;
  uint32_t pad;
  DeviceGroupState* state;  // the group's device-resident counters
  DeviceScalars* scalars;   // out: the group's step scalars
  // The plan entries without a gradient this step: absent[0] entries,
  // listed from absent[1]; an applied step adds one to their `missed`.
  const uint32_t* absent;
  uint32_t* missed;
};
static_assert(sizeof(GroupStep) % 16 == 0, "copied in 16-byte pieces");

// Step 2 above for n >= 1 groups. `args`: n GroupSteps in pinned host
// memory (device-accessible); copied to `scratch` (device memory, n
// GroupSteps) for step 4. sums: device memory for n doubles. Without
// `statistics` every sum is zero (nothing is skipped, nothing clipped).
absl::Status LaunchPrepareSteps(const GroupStep* args, GroupStep* scratch,
                                uint32_t n, bool statistics, double* sums,
                                Stream stream);

// Step 4 above: advances each group's counters and `totals` (the session's)
// and its absent tensors' missed steps unless the step was skipped, and
// copies the counters to report[0] (totals) and report[1 + g] (pinned host
// memory, n + 1 entries).
absl::Status LaunchCommitSteps(const GroupStep* scratch, uint32_t n,
                               const double* sums, DeviceGroupState* totals,
                               DeviceGroupState* report, Stream stream);

// `adamw`: decoupled weight decay (else Adam's L2), a template parameter of
// the kernel.
absl::Status LaunchAdamW(const Layout& layout, bool adamw, const Work& work,
                         const DeviceScalars* scalars, Stream stream);

// *word = value, once the work before it in `stream` is complete: a staged
// step's progress (StepRequest.staged), which the trainer's stream waits
// for with cuStreamWaitValue32. A kernel, not a stream memory operation, so
// that it is captured into the step graph like the updates around it.
absl::Status LaunchWriteProgress(uint32_t* word, uint32_t value, Stream stream);

// dst[i] = src[i] converted (exact widening, or rounding to nearest even),
// for i < n. Used for master weights at registration and GetParams.
absl::Status LaunchConvert(DType src_dtype, const void* src, DType dst_dtype,
                           void* dst, uint64_t n, Stream stream);

}  // namespace cuda
}  // namespace optimd

#endif  // OPTIMD_KERNELS_ADAMW_ADAMW_CUDA_H_
