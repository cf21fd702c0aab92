// CUDA runtime errors as absl::Status, and the one macro that checks every
// CUDA call. Only for files that already include cuda_runtime.h.
#ifndef OPTIMD_BACKENDS_CUDA_CUDA_STATUS_H_
#define OPTIMD_BACKENDS_CUDA_CUDA_STATUS_H_

#include <cuda_runtime.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace optimd {

inline absl::Status CudaError(cudaError_t e, const char* what) {
  return absl::InternalError(absl::StrCat(what,
                                          " failed: ", cudaGetErrorName(e),
                                          " (", cudaGetErrorString(e), ")"));
}

}  // namespace optimd

#define OPTIMD_RETURN_IF_CUDA_ERROR(expr)                    \
  do {                                                       \
    const cudaError_t optimd_cuda_error_ = (expr);           \
    if (optimd_cuda_error_ != cudaSuccess) {                 \
      return ::optimd::CudaError(optimd_cuda_error_, #expr); \
    }                                                        \
  } while (0)

#endif  // OPTIMD_BACKENDS_CUDA_CUDA_STATUS_H_
