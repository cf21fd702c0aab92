// One element of AdamW's (and Adam's) update, written once for the CPU
// reference and the CUDA kernel: the same operations in the same order in
// the layout's compute type (fp32, or float64 for float64 layouts; both
// backends built without FMA contraction), so the two give the same bits.
#ifndef OPTIMD_KERNELS_ADAMW_ADAMW_MATH_H_
#define OPTIMD_KERNELS_ADAMW_ADAMW_MATH_H_

#include <cmath>

#include "core/step_math.h"

namespace optimd {

// The step's folded scalars an element needs, in the compute type T.
template <class T>
struct AdamWElementScalarsT {
  T grad_mul;  // loss scale, clip coefficient, maximize
  T decay;     // AdamW: 1 - lr * weight_decay
  T l2;        // Adam: weight_decay
  T beta1, beta2, one_minus_beta1, one_minus_beta2;
  T eps;
  T neg_step;  // -lr / bias_correction1
};
using AdamWElementScalars = AdamWElementScalarsT<float>;

// IEEE square root, correctly rounded in each compute type.
OPTIMD_HOST_DEVICE inline float AdamWSqrt(float x) { return sqrtf(x); }
OPTIMD_HOST_DEVICE inline double AdamWSqrt(double x) { return sqrt(x); }

// The first half of an element's update: g (the gradient as stored,
// converted to T) scaled, the weight p decayed (AdamW) or g given the L2
// term (Adam), and the moments m and v updated in place. Returns the
// decayed weight.
template <bool kAdamW, class T>
OPTIMD_HOST_DEVICE inline T AdamWMoments(T g, T p, T& m, T& v,
                                         const AdamWElementScalarsT<T>& s) {
  g = g * s.grad_mul;
  if constexpr (kAdamW) {
    p = p * s.decay;
  } else {
    g = g + s.l2 * p;
  }
  m = m * s.beta1 + s.one_minus_beta1 * g;
  v = v * s.beta2 + s.one_minus_beta2 * g * g;
  return p;
}

// The second half: the new weight from the decayed weight p, the new m and
// root, the square root of the second moment the step divides by.
// div(a) is a / sqrt(bias_correction2), correctly rounded (the CPU
// divides; CUDA multiplies fp32 by the reciprocal and corrects).
template <class T, class DivBc2>
OPTIMD_HOST_DEVICE inline T AdamWApply(T p, T m, T root,
                                       const AdamWElementScalarsT<T>& s,
                                       DivBc2 div) {
  const T denom = div(root) + s.eps;
  return p + s.neg_step * (m / denom);
}

// g: the gradient as stored (converted to T); p: the weight; m, v (and
// vmax with kAmsgrad): the moments as T, updated in place. Returns the
// new weight.
template <bool kAmsgrad, bool kAdamW, class T, class DivBc2>
OPTIMD_HOST_DEVICE inline T AdamWElement(T g, T p, T& m, T& v, T& vmax,
                                         const AdamWElementScalarsT<T>& s,
                                         DivBc2 div) {
  p = AdamWMoments<kAdamW>(g, p, m, v, s);
  T vd = v;
  if constexpr (kAmsgrad) {
    vd = vmax < vd ? vd : vmax;  // std::max(vmax, v), NaN included
    vmax = vd;
  }
  return AdamWApply(p, m, AdamWSqrt(vd), s, div);
}

}  // namespace optimd

#endif  // OPTIMD_KERNELS_ADAMW_ADAMW_MATH_H_
