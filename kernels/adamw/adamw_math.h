// One element of AdamW's (and Adam's) update, written once for the CPU
// reference and the CUDA kernel: the same operations in the same order in
// fp32 (both built without FMA contraction), so the two give the same bits.
#ifndef OPTIMD_KERNELS_ADAMW_ADAMW_MATH_H_
#define OPTIMD_KERNELS_ADAMW_ADAMW_MATH_H_

#include <cmath>

#include "core/step_math.h"

namespace optimd {

// The step's folded scalars an element needs.
struct AdamWElementScalars {
  float grad_mul;  // loss scale, clip coefficient, maximize
  float decay;     // AdamW: 1 - lr * weight_decay
  float l2;        // Adam: weight_decay
  float beta1, beta2, one_minus_beta1, one_minus_beta2;
  float eps;
  float neg_step;  // -lr / bias_correction1
};

// g: the gradient as stored (converted to float); p: the weight; m, v (and
// vmax with kAmsgrad): the moments as floats, updated in place. Returns the
// new weight. div(a) is a / sqrt(bias_correction2), correctly rounded (the
// CPU divides; CUDA multiplies by the reciprocal and corrects).
template <bool kAmsgrad, bool kAdamW, class DivBc2>
OPTIMD_HOST_DEVICE inline float AdamWElement(float g, float p, float& m,
                                             float& v, float& vmax,
                                             const AdamWElementScalars& s,
                                             DivBc2 div) {
  g = g * s.grad_mul;
  if constexpr (kAdamW) {
    p = p * s.decay;
  } else {
    g = g + s.l2 * p;
  }
  m = m * s.beta1 + s.one_minus_beta1 * g;
  v = v * s.beta2 + s.one_minus_beta2 * g * g;
  float vd = v;
  if constexpr (kAmsgrad) {
    vd = vmax < vd ? vd : vmax;  // std::max(vmax, v), NaN included
    vmax = vd;
  }
  const float denom = div(sqrtf(vd)) + s.eps;
  return p + s.neg_step * (m / denom);
}

}  // namespace optimd

#endif  // OPTIMD_KERNELS_ADAMW_ADAMW_MATH_H_
