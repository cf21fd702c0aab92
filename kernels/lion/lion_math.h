// One element of Lion's update, written once for the CPU reference and
// the CUDA kernel: the same fp32 operations in the same order (both built
// without FMA contraction), so the two give the same bits.
#ifndef OPTIMD_KERNELS_LION_LION_MATH_H_
#define OPTIMD_KERNELS_LION_LION_MATH_H_

#include "core/step_math.h"

namespace optimd {

// The step's folded scalars an element needs.
struct LionElementScalars {
  float grad_mul;  // loss scale, clip coefficient, maximize
  float decay;     // 1 - lr * weight_decay
  float beta1, beta2, one_minus_beta1, one_minus_beta2;
  float neg_lr;
};

// g: the gradient as stored (converted to float); p: the weight; m: the
// momentum as a float, updated in place. Returns the new weight:
// p * decay - lr * sign(beta1 * m + (1 - beta1) * g).
OPTIMD_HOST_DEVICE inline float LionElement(float g, float p, float& m,
                                            const LionElementScalars& s) {
  g = g * s.grad_mul;
  p = p * s.decay;
  const float c = m * s.beta1 + s.one_minus_beta1 * g;
  const float sign = (c > 0.0f ? 1.0f : 0.0f) - (c < 0.0f ? 1.0f : 0.0f);
  m = m * s.beta2 + s.one_minus_beta2 * g;
  return p + s.neg_lr * sign;
}

}  // namespace optimd

#endif  // OPTIMD_KERNELS_LION_LION_MATH_H_
