// Lion's step scalars on the device (see lion_cpu.cc's MakeLionScalars: the
// same double arithmetic, rounded to float once; the float64 layout's
// unrounded).
#ifndef OPTIMD_KERNELS_LION_LION_SCALARS_CUH_
#define OPTIMD_KERNELS_LION_LION_SCALARS_CUH_

#include "kernels/cuda_step_types.h"

namespace optimd {
namespace cuda {

__device__ inline void MakeLionScalars(const StepHyper& h, DeviceScalars* s) {
  s->neg_lr = -static_cast<float>(h.lr);
  s->beta1 = static_cast<float>(h.beta1);
  s->beta2 = static_cast<float>(h.beta2);
  s->omb1 = static_cast<float>(1.0 - h.beta1);
  s->omb2 = static_cast<float>(1.0 - h.beta2);
  s->decay = static_cast<float>(1.0 - h.lr * h.weight_decay);
  s->lr = h.lr;
  s->beta1_d = h.beta1;
  s->beta2_d = h.beta2;
  s->decay_d = 1.0 - h.lr * h.weight_decay;
}

}  // namespace cuda
}  // namespace optimd

#endif  // OPTIMD_KERNELS_LION_LION_SCALARS_CUH_
