// The CUDA requantization of FP8 parameters after their masters' update:
// the same rules as the CPU reference (core/fp8_quantize.h), bit for bit.
// Plain C++: no CUDA headers.
#ifndef OPTIMD_KERNELS_FP8_CUDA_H_
#define OPTIMD_KERNELS_FP8_CUDA_H_

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/cuda_step_types.h"

namespace optimd {
namespace cuda {

// Requantizes every scaling unit of `tensors[0 .. count)` (device memory)
// from their masters, one warp per unit, `units` units in all, unless the
// step is skipped (scalars->skip) or the tensor has no gradient this step
// (`missed_now`: the plan's absent list, [0] its count; may be null).
absl::Status LaunchFp8Requantize(const DeviceFp8Tensor* tensors, uint32_t count,
                                 uint64_t units, const DeviceScalars* scalars,
                                 const uint32_t* absent, Stream stream);

}  // namespace cuda
}  // namespace optimd

#endif  // OPTIMD_KERNELS_FP8_CUDA_H_
