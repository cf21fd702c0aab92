// One element of SGD's update (torch.optim.SGD), written once for the CPU
// reference and the CUDA kernel: the same fp32 operations in the same
// order (both built without FMA contraction), so the two give the same
// bits.
#ifndef OPTIMD_KERNELS_SGD_SGD_MATH_H_
#define OPTIMD_KERNELS_SGD_SGD_MATH_H_

#include "core/step_math.h"

namespace optimd {

// The step's folded scalars an element needs.
struct SgdElementScalars {
  float grad_mul;      // loss scale, clip coefficient, maximize
  float weight_decay;  // added as weight_decay * p when not 0
  float momentum;
  float dampening_mul;  // 1 - dampening
  float neg_lr;
  bool nesterov;
};

// g: the gradient as stored (converted to float); p: the weight; b: the
// momentum buffer as a float (read unless `first`, the tensor's first
// step, which starts it from the gradient), updated in place with
// kMomentum. Returns the new weight.
template <bool kMomentum>
OPTIMD_HOST_DEVICE inline float SgdElement(float g, float p, float& b,
                                           bool first,
                                           const SgdElementScalars& s) {
  g = g * s.grad_mul;
  if (s.weight_decay != 0.0f) g = g + s.weight_decay * p;
  if constexpr (kMomentum) {
    b = first ? g : b * s.momentum + s.dampening_mul * g;
    g = s.nesterov ? g + s.momentum * b : b;
  }
  return p + s.neg_lr * g;
}

}  // namespace optimd

#endif  // OPTIMD_KERNELS_SGD_SGD_MATH_H_
