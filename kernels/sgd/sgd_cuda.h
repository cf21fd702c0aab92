// The SGD update kernel on CUDA (step 3 of kernels/step_cuda.h). Plain
// C++: no CUDA headers.
#ifndef OPTIMD_KERNELS_SGD_SGD_CUDA_H_
#define OPTIMD_KERNELS_SGD_SGD_CUDA_H_

#include "absl/status/status.h"
#include "core/layout.h"
#include "kernels/cuda_step_types.h"

namespace optimd {
namespace cuda {

// Updates the items of `work` with the scalars of a group (unless they
// say skip); a layout without state slots is SGD without momentum.
absl::Status LaunchSgd(const Layout& layout, const Work& work,
                       const DeviceScalars* scalars, Stream stream);

}  // namespace cuda
}  // namespace optimd

#endif  // OPTIMD_KERNELS_SGD_SGD_CUDA_H_
