// Lion's step scalars on the device (see lion_cpu.cc's MakeLionScalars: the
// same double arithmetic, rounded to float once; the float64 layout's
// unrounded), and Lion's part of the CUDA step (LionCuda, listed by
// kernels/step_cuda.cu).
#ifndef OPTIMD_KERNELS_LION_LION_SCALARS_CUH_
#define OPTIMD_KERNELS_LION_LION_SCALARS_CUH_

#include "absl/status/status.h"
#include "core/layout.h"
#include "core/optimizer.h"
#include "kernels/cuda_step_types.h"
#include "kernels/lion/lion_cuda.h"

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

// Lion's part of the CUDA step, as kernels/step_cuda.cu lists it: its
// step scalars (in the step's prepare kernel, after skip, grad_mul and t)
// and the launch of its update.
struct LionCuda {
  static constexpr OptimizerKind kKind = OptimizerKind::kLion;
  __device__ static void MakeScalars(const StepHyper& h, DeviceScalars* s) {
    MakeLionScalars(h, s);
  }
  static absl::Status Update(const OptimizerHyper& /*hyper*/,
                             const Layout& layout, const Work& work,
                             const DeviceScalars* scalars, Stream stream) {
    return LaunchLion(layout, work, scalars, stream);
  }
};

}  // namespace cuda
}  // namespace optimd

#endif  // OPTIMD_KERNELS_LION_LION_SCALARS_CUH_
