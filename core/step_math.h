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

// A double-double number: the unevaluated sum hi + lo, |lo| <= ulp(hi)/2.
struct DoubleDouble {
  double hi, lo;
};

// a * b exactly, as a double-double, by Dekker's product (Veltkamp's
// splitting: no fused multiply-add needed, so the host and the device,
// both built without FMA contraction, give the same bits). For |a|, |b|
// <= 1 and products above 2^-969 (below that the low parts lose bits,
// which no bias correction can see).
OPTIMD_HOST_DEVICE inline DoubleDouble ExactProduct(double a, double b) {
  const double split = 134217729.0;  // 2^27 + 1
  const double ca = split * a, cb = split * b;
  const double ah = ca - (ca - a), al = a - ah;
  const double bh = cb - (cb - b), bl = b - bh;
  const double p = a * b;
  return {p, ((ah * bh - p) + ah * bl + al * bh) + al * bl};
}

// x * y in double-double arithmetic (relative error about 2^-104).
OPTIMD_HOST_DEVICE inline DoubleDouble DoubleDoubleProduct(DoubleDouble x,
                                                           DoubleDouble y) {
  const DoubleDouble p = ExactProduct(x.hi, y.hi);
  const double lo = p.lo + (x.hi * y.lo + x.lo * y.hi);
  const double hi = p.hi + lo;
  return {hi, lo - (hi - p.hi)};
}

// Whether a bf16 parameter value the trainer wrote (its bits) clears its
// remainder in a remainder layout (the parameter is its fp32 master's high
// half): +-0 and +-inf, which with a negative remainder would read back as
// a NaN master and a finite one (AdoptWrittenParamRange).
OPTIMD_HOST_DEVICE inline bool WrittenBf16ClearsRemainder(unsigned short bits) {
  const unsigned short magnitude = bits & 0x7fffu;
  return magnitude == 0 || magnitude == 0x7f80u;
}

// beta^t (0 <= beta <= 1) for a bias correction: repeated squaring in
// double-double, rounded to double once. Its error stays far below half an
// ulp for any t that matters, so it is the correctly rounded power (what
// torch's `beta ** step` gives) except in rare near-ties; and it is the
// same IEEE operations in the same order on the host and the device, so
// both backends derive the same bits (the host's pow and CUDA's differ in
// the last bit for some arguments, which float64 layouts would show).
OPTIMD_HOST_DEVICE inline double BetaPower(double beta, unsigned long long t) {
  DoubleDouble result{1.0, 0.0};
  DoubleDouble square{beta, 0.0};
  while (t != 0) {
    if (t & 1) result = DoubleDoubleProduct(result, square);
    t >>= 1;
    if (t != 0) square = DoubleDoubleProduct(square, square);
  }
  return result.hi + result.lo;
}

}  // namespace optimd

#endif  // OPTIMD_CORE_STEP_MATH_H_
