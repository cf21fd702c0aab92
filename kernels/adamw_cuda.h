// Launchers of the fused CUDA step kernels. Plain C++: no CUDA headers, so
// that host code including this file builds without nvcc. The __global__
// code is private to adamw_cuda.cu.
//
// A step of one session on one GPU is, all on one stream:
//   1. LaunchGradSumSquares per plan segment: each block writes the sum of
//      squares (double) of its chunks to partials[block].
//   2. LaunchReduceSums per group: sums the group's partials, in a fixed
//      order, into session_sums[group] (deterministic: no atomics).
//   3. LaunchPrepareStep per group: adds session_sums in order; if the total
//      is not finite the step is skipped; otherwise derives the clip
//      coefficient and, from the group's device-resident step counter, the
//      bias corrections, into the group's DeviceScalars.
//   4. LaunchAdamW per plan segment: unless skipped, updates its chunks.
//   5. LaunchCommitStep per group: advances the step counter unless
//      skipped, and records the step's norm and skipped flag.
// The host never waits for the GPU in between: the skip decision and the
// clip coefficient are read by the kernels from device memory.
#ifndef OPTIMD_KERNELS_ADAMW_CUDA_H_
#define OPTIMD_KERNELS_ADAMW_CUDA_H_

#include <cstdint>

#include "absl/status/status.h"
#include "core/layout.h"

struct CUstream_st;

namespace optimd {
namespace cuda {

using Stream = CUstream_st*;

// Device pointers of one tensor.
struct DeviceTensor {
  void* param;
  const void* grad;
  void* master;
  void* exp_avg;
  void* exp_avg_sq;
  void* max_exp_avg_sq;
};

// Elements [begin, end) of tensor `tensor`. `vector` is 1 when every stream
// of the tensor is 16-byte aligned at `begin`: the kernels then move 8
// elements per stream with 16-byte accesses, and the tail one by one.
struct DeviceChunk {
  uint32_t tensor;
  uint32_t vector;
  uint64_t begin;
  uint64_t end;
};

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
  uint64_t step;          // applied steps
  uint64_t skipped;       // skipped steps
  double last_sumsq;      // sum of squares of the last step's gradients
  int32_t last_skipped;   // 1 when the last step was skipped
  int32_t pad;
};

// One thread block's work: chunks [first, end) of the plan's chunk table.
// Small tensors share a block, so a launch over 1e5 small tensors keeps its
// blocks as full as over a few large ones.
struct DeviceBlock {
  uint32_t first;
  uint32_t end;
};

// Step scalars derived on the device once per group and step (see
// adamw_cpu.cc's MakeStepScalars: the same double arithmetic, rounded to
// float once); read by every block of the update.
struct DeviceScalars {
  float beta1, beta2, omb1, omb2, eps, decay, l2, bc2, neg_step, grad_mul;
  int32_t skip;
  int32_t pad;
};

constexpr int kThreadsPerBlock = 256;
constexpr int kElementsPerThread = 8;

// One partial sum per block: partials[b] for blocks[b].
absl::Status LaunchGradSumSquares(DType grad_dtype, const DeviceBlock* blocks,
                                  uint32_t num_blocks,
                                  const DeviceChunk* chunks,
                                  const DeviceTensor* tensors,
                                  double* partials, Stream stream);

absl::Status LaunchReduceSums(const double* partials, uint32_t count,
                              double* out, Stream stream);

// Derives the group's step scalars (or the skip flag) into *scalars.
absl::Status LaunchPrepareStep(const StepHyper& hyper,
                               const double* session_sums, uint32_t num_sums,
                               const DeviceGroupState* group,
                               DeviceScalars* scalars, Stream stream);

// `adamw`: decoupled weight decay (else Adam's L2), a template parameter of
// the kernel.
absl::Status LaunchAdamW(const Layout& layout, bool adamw,
                         const DeviceBlock* blocks, uint32_t num_blocks,
                         const DeviceChunk* chunks,
                         const DeviceTensor* tensors,
                         const DeviceScalars* scalars, Stream stream);

absl::Status LaunchCommitStep(const double* session_sums, uint32_t num_sums,
                              DeviceGroupState* group, Stream stream);

// dst[i] = src[i] converted (exact widening, or rounding to nearest even),
// for i < n. Used for master weights at registration and GetParams.
absl::Status LaunchConvert(DType src_dtype, const void* src, DType dst_dtype,
                           void* dst, uint64_t n, Stream stream);

}  // namespace cuda
}  // namespace optimd

#endif  // OPTIMD_KERNELS_ADAMW_CUDA_H_
