// AdamW's step scalars on the device (see adamw_cpu.cc's MakeAdamWScalars:
// the same double arithmetic, rounded to float once), and AdamW's part of
// the CUDA step (AdamWCuda, listed by kernels/step_cuda.cu). Included by
// the step's prepare kernel and by the AdamW update (for tensors that
// missed steps).
#ifndef OPTIMD_KERNELS_ADAMW_ADAMW_SCALARS_CUH_
#define OPTIMD_KERNELS_ADAMW_ADAMW_SCALARS_CUH_

#include <cstdint>

#include "absl/status/status.h"
#include "core/layout.h"
#include "core/optimizer.h"
#include "core/step_math.h"
#include "kernels/adamw/adamw_cuda.h"
#include "kernels/cuda_step_types.h"

namespace optimd {
namespace cuda {

// The scalars that depend on the step number t.
struct BiasScalars {
  float neg_step, bc2, rbc2;
};
__device__ inline BiasScalars MakeBias(double lr, double beta1, double beta2,
                                       bool bias_correction,
                                       uint64_t step_number) {
  const double bc1 =
      bias_correction ? 1.0 - BetaPower(beta1, step_number) : 1.0;
  const double bc2 =
      bias_correction ? 1.0 - BetaPower(beta2, step_number) : 1.0;
  BiasScalars b;
  b.bc2 = static_cast<float>(sqrt(bc2));
  b.rbc2 = __fdiv_rn(1.0f, b.bc2);
  b.neg_step = -static_cast<float>(lr / bc1);
  return b;
}

// The float64 layout's scalars that depend on the step number: the CPU
// reference's unrounded doubles (MakeAdamWScalars, ElementScalars<double>).
struct BiasScalars64 {
  double neg_step, bc2;
};
__device__ inline BiasScalars64 MakeBias64(double lr, double beta1,
                                           double beta2, bool bias_correction,
                                           uint64_t step_number) {
  const double bc1 =
      bias_correction ? 1.0 - BetaPower(beta1, step_number) : 1.0;
  const double bc2 =
      bias_correction ? 1.0 - BetaPower(beta2, step_number) : 1.0;
  return BiasScalars64{-(lr / bc1), sqrt(bc2)};
}

// AdamW's fields of `s` for step number `t` (skip, grad_mul and t are
// the caller's).
__device__ inline void MakeAdamWScalars(const StepHyper& h, uint64_t t,
                                        DeviceScalars* s) {
  const BiasScalars b = MakeBias(h.lr, h.beta1, h.beta2, h.bias_correction, t);
  s->lr = h.lr;
  s->beta1_d = h.beta1;
  s->beta2_d = h.beta2;
  s->bias_correction = h.bias_correction;
  s->beta1 = static_cast<float>(h.beta1);
  s->beta2 = static_cast<float>(h.beta2);
  s->omb1 = static_cast<float>(1.0 - h.beta1);
  s->omb2 = static_cast<float>(1.0 - h.beta2);
  s->eps = static_cast<float>(h.eps);
  s->decay = h.adamw ? static_cast<float>(1.0 - h.lr * h.weight_decay) : 1.0f;
  s->l2 = h.adamw ? 0.0f : static_cast<float>(h.weight_decay);
  s->eps_d = h.eps;
  s->decay_d = h.adamw ? 1.0 - h.lr * h.weight_decay : 1.0;
  s->l2_d = h.adamw ? 0.0 : h.weight_decay;
  s->bc2 = b.bc2;
  s->rbc2 = b.rbc2;
  s->neg_step = b.neg_step;
}

// AdamW's part of the CUDA step, as kernels/step_cuda.cu lists it: its
// step scalars (in the step's prepare kernel, after skip, grad_mul and t)
// and the launch of its update.
struct AdamWCuda {
  static constexpr OptimizerKind kKind = OptimizerKind::kAdamW;
  __device__ static void MakeScalars(const StepHyper& h, DeviceScalars* s) {
    MakeAdamWScalars(h, s->t, s);
  }
  static absl::Status Update(const OptimizerHyper& hyper, const Layout& layout,
                             const Work& work, const DeviceScalars* scalars,
                             Stream stream) {
    return LaunchAdamW(layout, hyper.adamw, work, scalars, stream);
  }
};

}  // namespace cuda
}  // namespace optimd

#endif  // OPTIMD_KERNELS_ADAMW_ADAMW_SCALARS_CUH_
