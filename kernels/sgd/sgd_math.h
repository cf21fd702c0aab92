// One element of SGD's update (torch.optim.SGD), written once for the CPU
// reference and the CUDA kernel: the same operations in the same order in
// the layout's compute type (fp32, or float64 for float64 layouts; both
// backends built without FMA contraction), so the two give the same bits.
#ifndef OPTIMD_KERNELS_SGD_SGD_MATH_H_
#define OPTIMD_KERNELS_SGD_SGD_MATH_H_

#include "core/step_math.h"

namespace optimd {

// The step's folded scalars an element needs, in the compute type T.
template <class T>
struct SgdElementScalarsT {
  T grad_mul;      // loss scale, clip coefficient, maximize
  T weight_decay;  // added as weight_decay * p when not 0
  T momentum;
  T dampening_mul;  // 1 - dampening
  T neg_lr;
  bool nesterov;
};
using SgdElementScalars = SgdElementScalarsT<float>;

// g: the gradient as stored (converted to T); p: the weight; b: the
// momentum buffer as T (read unless `first`, the tensor's first step,
// which starts it from the gradient), updated in place with kMomentum.
// Returns the new weight.
template <bool kMomentum, class T>
OPTIMD_HOST_DEVICE inline T SgdElement(T g, T p, T& b, bool first,
                                       const SgdElementScalarsT<T>& s) {
  g = g * s.grad_mul;
  if (s.weight_decay != T(0)) g = g + s.weight_decay * p;
  if constexpr (kMomentum) {
    b = first ? g : b * s.momentum + s.dampening_mul * g;
    g = s.nesterov ? g + s.momentum * b : b;
  }
  return p + s.neg_lr * g;
}

}  // namespace optimd

#endif  // OPTIMD_KERNELS_SGD_SGD_MATH_H_
