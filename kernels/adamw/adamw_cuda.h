// The AdamW update kernel on CUDA (step 3 of kernels/step_cuda.h). Plain
// C++: no CUDA headers.
#ifndef OPTIMD_KERNELS_ADAMW_ADAMW_CUDA_H_
#define OPTIMD_KERNELS_ADAMW_ADAMW_CUDA_H_

#include "absl/status/status.h"
#include "core/layout.h"
#include "kernels/cuda_step_types.h"

namespace optimd {
namespace cuda {

// Updates the items of `work` with the scalars of a group (unless they
// say skip). `adamw`: decoupled weight decay (else Adam's L2), a template
// parameter of the kernel. `work` has a work block or a unit task
// (LaunchUpdate skips a launch of neither).
absl::Status LaunchAdamW(const Layout& layout, bool adamw, const Work& work,
                         const DeviceScalars* scalars, Stream stream);

}  // namespace cuda
}  // namespace optimd

#endif  // OPTIMD_KERNELS_ADAMW_ADAMW_CUDA_H_
