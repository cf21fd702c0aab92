// Driver entry points the CUDA runtime does not wrap, found once through
// cudaGetDriverEntryPointByVersion (the daemon links the runtime
// statically and never libcuda, so that it starts on machines without a
// driver), and the stream memory operations on a trainer's step flags
// built on them. Immutable once found; thread-safe.
#ifndef OPTIMD_BACKENDS_CUDA_DRIVER_FNS_H_
#define OPTIMD_BACKENDS_CUDA_DRIVER_FNS_H_

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "backends/cuda/ipc_mapping.h"
#include "backends/cuda/vmm_mapping.h"

namespace optimd {

using StreamValue32Fn = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t,
                                     unsigned int);

struct DriverFns {
  MemGetAddressRangeFn mem_get_address_range = nullptr;
  StreamValue32Fn stream_wait_value32 = nullptr;
  StreamValue32Fn stream_write_value32 = nullptr;
  VmmDriverFns vmm;
};

// Every entry point of DriverFns (the current device's driver);
// FAILED_PRECONDITION naming the first the driver lacks.
absl::StatusOr<DriverFns> FindDriverFns();

// Makes `stream` wait until the step flag `word` (trainer memory) is at
// least `value`, in cuStreamWaitValue32's cyclic order.
absl::Status WaitStepFlag(const DriverFns& driver, cudaStream_t stream,
                          uint32_t* word, uint32_t value);

// Writes `value` into the step flag `word` on `stream`, after a memory
// fence: the trainer's stream, once it sees the flag, sees everything the
// stream wrote before it.
absl::Status WriteStepFlag(const DriverFns& driver, cudaStream_t stream,
                           uint32_t* word, uint32_t value);

}  // namespace optimd

#endif  // OPTIMD_BACKENDS_CUDA_DRIVER_FNS_H_
