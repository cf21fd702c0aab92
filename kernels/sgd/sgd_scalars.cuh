// SGD's step scalars on the device (see sgd_cpu.cc's MakeSgdScalars: the
// same arithmetic, rounded to float once; the float64 layout's unrounded).
// Whether it is a tensor's first step is per tensor, derived by the
// update.
#ifndef OPTIMD_KERNELS_SGD_SGD_SCALARS_CUH_
#define OPTIMD_KERNELS_SGD_SGD_SCALARS_CUH_

#include "kernels/cuda_step_types.h"

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

}  // namespace cuda
}  // namespace optimd

#endif  // OPTIMD_KERNELS_SGD_SGD_SCALARS_CUH_
