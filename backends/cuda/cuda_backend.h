// The CUDA backend: trainer buffers are CUDA IPC allocations, state lives in
// the GPU's memory, and steps run each optimizer's fused kernels
// (kernels/step_cuda.h) on one stream per device, ordered with the
// trainer's stream by step flags or interprocess events. The Backend here
// puts the package's pieces in order (backends/cuda/BUILD lists them).
// Plain C++ header: the daemon includes it without CUDA headers.
#ifndef OPTIMD_BACKENDS_CUDA_CUDA_BACKEND_H_
#define OPTIMD_BACKENDS_CUDA_CUDA_BACKEND_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "common/fd_store.h"
#include "core/backend.h"

namespace optimd {

struct CudaBackendOptions {
  // Elements per item of a plan (about one work block, one thread block of
  // the update): a multiple of 256 (one tile), at most 2^26. 4K measured
  // fastest on the H200 among 4K-32K (bench/RESULTS.md).
  uint64_t item_elements = 1 << 12;
  // Completed-step records kept for asynchronous replies.
  int step_records = 8;
  // Launch each step as a CUDA graph captured once per step record and
  // group configuration (one host call instead of one per kernel).
  bool use_graphs = true;
  // Wait for each step's completion blocking in the driver, not spinning:
  // a spinning waiter takes a CPU the trainer's host may need (measured in
  // bench/RESULTS.md; off by default until measured further).
  bool blocking_sync = false;
  // Descriptors of trainer memory made with cuMemCreate, passed over the
  // daemon's descriptor socket (cuda_vmm buffers); null: none are taken.
  // Outlives the backend.
  const FdStore* fd_store = nullptr;
};

// Number of usable CUDA devices. 0, with the reason in *why, when there is
// no driver or no GPU (the daemon then falls back to the CPU backend).
int CudaDeviceCount(std::string* why);

// A backend for CUDA device `device`. Its methods must be called from one
// thread at a time (the device's worker).
absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(
    int device, const CudaBackendOptions& options);

}  // namespace optimd

#endif  // OPTIMD_BACKENDS_CUDA_CUDA_BACKEND_H_
