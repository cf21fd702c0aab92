// The step arithmetic every optimizer and backend shares, written once:
// the loss scale's convention, the gradient multiplier, the clip
// coefficient. Host-device functions, so that CUDA code can use them too.
#ifndef OPTIMD_CORE_STEP_MATH_H_
#define OPTIMD_CORE_STEP_MATH_H_

#if defined(__CUDACC__)
#define OPTIMD_HOST_DEVICE __host__ __device__
#else
#define OPTIMD_HOST_DEVICE
#endif

namespace optimd {

// The loss scale gradients are divided by: `grad_scale`, or 1 when it is
// 0 or negative (none).
OPTIMD_HOST_DEVICE inline double EffectiveGradScale(double grad_scale) {
  return grad_scale > 0 ? grad_scale : 1.0;
}

// What every optimizer multiplies each gradient element by: the clip
// coefficient over the loss scale, negated to maximize. In double; kernels
// round it to fp32 once per step.
OPTIMD_HOST_DEVICE inline double GradMultiplier(double grad_scale,
                                                double clip_coef,
                                                bool maximize) {
  const double mul = clip_coef / EffectiveGradScale(grad_scale);
  return maximize ? -mul : mul;
}

// torch.nn.utils.clip_grad_norm_'s coefficient for a gradient of norm
// `norm`: max_norm / (norm + 1e-6), at most 1; 1 when max_norm <= 0. As
// torch.clamp does, a NaN norm gives NaN (every gradient becomes NaN) and
// an infinite one 0 (finite elements become 0, infinite ones NaN).
OPTIMD_HOST_DEVICE inline double ClipCoefficient(double max_norm, double norm) {
  if (max_norm <= 0) return 1.0;
  const double coef = max_norm / (norm + 1e-6);
  return coef >= 1.0 ? 1.0 : coef;
}

}  // namespace optimd

#endif  // OPTIMD_CORE_STEP_MATH_H_
