// Launchers of the fused CUDA step kernels. Plain C++: no CUDA headers, so
// that host code including this file builds without nvcc. The __global__
// code is private to adamw_cuda.cu.
//
// A step of one session on one GPU is, all on one stream:
//   1. LaunchGradSumSquares per plan segment: one block per chunk writes the
//      chunk's sum of squares (double) to partials[chunk].
//   2. LaunchReduceSums per group: sums the group's partials, in a fixed
//      order, into session_sums[group] (deterministic: no atomics).
//   3. LaunchAdamW per plan segment: every block first adds session_sums in
//      order; if the total is not finite the step is skipped (the block
//      returns); otherwise it derives the clip coefficient and, from the
//      group's device-resident step counter, the bias corrections, and
//      updates its chunk.
//   4. LaunchCommitStep per group: advances the step counter unless
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

// One block's work: elements [begin, end) of tensor `tensor`. `vector` is 1
// when every stream of the tensor is aligned for 4-element vector accesses
// at `begin` (16 bytes for fp32 streams).
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

constexpr int kThreadsPerBlock = 256;
constexpr int kElementsPerThread = 4;

absl::Status LaunchGradSumSquares(DType grad_dtype, const DeviceChunk* chunks,
                                  uint32_t num_chunks,
                                  const DeviceTensor* tensors,
                                  double* partials, Stream stream);

absl::Status LaunchReduceSums(const double* partials, uint32_t count,
                              double* out, Stream stream);

absl::Status LaunchAdamW(const Layout& layout, const DeviceChunk* chunks,
                         uint32_t num_chunks, const DeviceTensor* tensors,
                         const StepHyper& hyper, const double* session_sums,
                         uint32_t num_sums, const DeviceGroupState* group,
                         Stream stream);

absl::Status LaunchCommitStep(const double* session_sums, uint32_t num_sums,
                              DeviceGroupState* group, Stream stream);

// dst[i] = src[i] converted (exact widening, or rounding to nearest even),
// for i < n. Used for master weights at registration and GetParams.
absl::Status LaunchConvert(DType src_dtype, const void* src, DType dst_dtype,
                           void* dst, uint64_t n, Stream stream);

}  // namespace cuda
}  // namespace optimd

#endif  // OPTIMD_KERNELS_ADAMW_CUDA_H_
