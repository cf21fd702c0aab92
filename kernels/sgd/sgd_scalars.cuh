// SGD's step scalars on the device (see sgd_cpu.cc's MakeSgdScalars: the
// same arithmetic, rounded to float once; the float64 layout's unrounded),
// and SGD's part of the CUDA step (SgdCuda, listed by kernels/step_cuda.cu).
// Whether it is a tensor's first step is per tensor, derived by the
// update.
#ifndef OPTIMD_KERNELS_SGD_SGD_SCALARS_CUH_
#define OPTIMD_KERNELS_SGD_SGD_SCALARS_CUH_

#include "absl/status/status.h"
#include "core/layout.h"
#include "core/optimizer.h"
#include "kernels/cuda_step_types.h"
#include "kernels/sgd/sgd_cuda.h"

namespace optimd {
namespace cuda {

__device__ inline void MakeSgdScalars(const StepHyper& h, DeviceScalars* s) {
  s->neg_lr = -static_cast<float>(h.lr);
  s->momentum = static_cast<float>(h.momentum);
  s->dampening_mul = static_cast<float>(1.0 - h.dampening);
  s->l2 = static_cast<float>(h.weight_decay);
  s->nesterov = h.nesterov;
  s->lr = h.lr;
  s->l2_d = h.weight_decay;
  s->momentum_d = h.momentum;
  s->dampening_mul_d = 1.0 - h.dampening;
}

// SGD's part of the CUDA step, as kernels/step_cuda.cu lists it: its
// step scalars (in the step's prepare kernel, after skip, grad_mul and t)
// and the launch of its update.
struct SgdCuda {
  static constexpr OptimizerKind kKind = OptimizerKind::kSgd;
  __device__ static void MakeScalars(const StepHyper& h, DeviceScalars* s) {
    MakeSgdScalars(h, s);
  }
  static absl::Status Update(const OptimizerHyper& /*hyper*/,
                             const Layout& layout, const Work& work,
                             const DeviceScalars* scalars, Stream stream) {
    return LaunchSgd(layout, work, scalars, stream);
  }
};

}  // namespace cuda
}  // namespace optimd

#endif  // OPTIMD_KERNELS_SGD_SGD_SCALARS_CUH_
