// The encode pass of FP8 parameters after their update: the same rules as
// the CPU reference (core/fp8_quantize.h), bit for bit. Plain C++: no CUDA
// headers.
#ifndef OPTIMD_KERNELS_FP8_CUDA_H_
#define OPTIMD_KERNELS_FP8_CUDA_H_

#include "absl/status/status.h"
#include "kernels/cuda_step_types.h"

namespace optimd {
namespace cuda {

// Writes the codes and scale inverses of the FP8 parameters of `work`'s
// items (one launch's, of one FP8 format) whose pass is not kFused, from
// their masters and the unit amax that the update took
// (DeviceFp8Tensor::amax), unless the step is skipped (scalars->skip).
// `recipe` is the launch's (its layout's fp8_recipe).
// Items without elements (no gradient this step) are left alone, as the
// CPU leaves them. The amax words must be zeroed before the update.
absl::Status LaunchFp8Encode(bool e5m2, Fp8Recipe recipe, const Work& work,
                             const DeviceScalars* scalars, Stream stream);

}  // namespace cuda
}  // namespace optimd

#endif  // OPTIMD_KERNELS_FP8_CUDA_H_
