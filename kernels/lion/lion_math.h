// One element of Lion's update, written once for the CPU reference and
// the CUDA kernel: the same operations in the same order in the layout's
// compute type (fp32, or float64 for float64 layouts; both backends built
// without FMA contraction), so the two give the same bits.
#ifndef OPTIMD_KERNELS_LION_LION_MATH_H_
#define OPTIMD_KERNELS_LION_LION_MATH_H_

#include "core/step_math.h"

namespace optimd {

// The step's folded scalars an element needs, in the compute type T.
template <class T>
struct LionElementScalarsT {
  T grad_mul;  // loss scale, clip coefficient, maximize
  T decay;     // 1 - lr * weight_decay
  T beta1, beta2, one_minus_beta1, one_minus_beta2;
  T neg_lr;
};
using LionElementScalars = LionElementScalarsT<float>;

// g: the gradient as stored (converted to T); p: the weight; m: the
// momentum as T, updated in place. Returns the new weight:
// p * decay - lr * sign(beta1 * m + (1 - beta1) * g).
template <class T>
OPTIMD_HOST_DEVICE inline T LionElement(T g, T p, T& m,
                                        const LionElementScalarsT<T>& s) {
  g = g * s.grad_mul;
  p = p * s.decay;
  const T c = m * s.beta1 + s.one_minus_beta1 * g;
  const T sign = (c > T(0) ? T(1) : T(0)) - (c < T(0) ? T(1) : T(0));
  m = m * s.beta2 + s.one_minus_beta2 * g;
  return p + s.neg_lr * sign;
}

}  // namespace optimd

#endif  // OPTIMD_KERNELS_LION_LION_MATH_H_
