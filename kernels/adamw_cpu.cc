#include "kernels/adamw_cpu.h"

#include <algorithm>
#include <cmath>

namespace optimd {
namespace {

// Element codecs: storage type plus exact widen / round-to-nearest-even.
struct F32 {
  using T = float;
  static float Load(T x) { return x; }
  static T Store(float x) { return x; }
};
struct BF16 {
  using T = uint16_t;
  static float Load(T x) { return BFloat16ToFloat(x); }
  static T Store(float x) { return FloatToBFloat16(x); }
};
struct F16 {
  using T = uint16_t;
  static float Load(T x) { return HalfToFloat(x); }
  static T Store(float x) { return FloatToHalf(x); }
};

template <class P, class G, class M, MasterKind K, bool kAmsgrad, bool kAdamW>
void StepKernel(const TensorPointers& t, uint64_t begin, uint64_t end,
                const StepScalars& s) {
  auto* __restrict param = static_cast<typename P::T*>(t.param);
  const auto* __restrict grad = static_cast<const typename G::T*>(t.grad);
  auto* __restrict m = static_cast<typename M::T*>(t.exp_avg);
  auto* __restrict v = static_cast<typename M::T*>(t.exp_avg_sq);
  auto* __restrict vmax = static_cast<typename M::T*>(t.max_exp_avg_sq);
  float* __restrict master = static_cast<float*>(t.master);
  int16_t* __restrict rem = static_cast<int16_t*>(t.master);
  const float grad_mul = s.grad_mul, decay = s.decay;
  const float l2 = s.adamw ? 0.0f : s.weight_decay;
  const float b1 = s.beta1, b2 = s.beta2;
  const float omb1 = s.one_minus_beta1, omb2 = s.one_minus_beta2;
  const float eps = s.eps, bc2 = s.bc2_sqrt, neg_step = -s.step_size;
  for (uint64_t i = begin; i < end; ++i) {
    float g = G::Load(grad[i]) * grad_mul;
    float p;
    if constexpr (K == MasterKind::kFp32) {
      p = master[i];
    } else if constexpr (K == MasterKind::kRemainder) {
      p = ReconstructFromRemainder(param[i], rem[i]);
    } else {
      p = P::Load(param[i]);
    }
    if constexpr (kAdamW) {
      p = p * decay;
    } else {
      g = g + l2 * p;
    }
    float mi = M::Load(m[i]) * b1 + omb1 * g;
    float vi = M::Load(v[i]) * b2 + omb2 * g * g;
    m[i] = M::Store(mi);
    v[i] = M::Store(vi);
    float vd = vi;
    if constexpr (kAmsgrad) {
      vd = std::max(M::Load(vmax[i]), vi);
      vmax[i] = M::Store(vd);
    }
    const float denom = std::sqrt(vd) / bc2 + eps;
    p = p + neg_step * (mi / denom);
    if constexpr (K == MasterKind::kFp32) {
      master[i] = p;
      param[i] = P::Store(p);
    } else if constexpr (K == MasterKind::kRemainder) {
      uint16_t hi;
      int16_t r;
      SplitToRemainder(p, &hi, &r);
      param[i] = hi;
      rem[i] = r;
    } else {
      param[i] = P::Store(p);
    }
  }
}

template <class P, class G, class M, MasterKind K>
void DispatchAmsgrad(const Layout& l, const TensorPointers& t, uint64_t b,
                     uint64_t e, const StepScalars& s) {
  // Every branch is a template parameter so the inner loop has no control
  // flow and vectorizes.
  if (l.amsgrad) {
    if (s.adamw) {
      StepKernel<P, G, M, K, true, true>(t, b, e, s);
    } else {
      StepKernel<P, G, M, K, true, false>(t, b, e, s);
    }
  } else {
    if (s.adamw) {
      StepKernel<P, G, M, K, false, true>(t, b, e, s);
    } else {
      StepKernel<P, G, M, K, false, false>(t, b, e, s);
    }
  }
}

template <class P, class G, class M>
void DispatchMaster(const Layout& l, const TensorPointers& t, uint64_t b,
                    uint64_t e, const StepScalars& s) {
  switch (l.master) {
    case MasterKind::kNone:
      if constexpr (std::is_same_v<P, F32>) {
        DispatchAmsgrad<P, G, M, MasterKind::kNone>(l, t, b, e, s);
      }
      return;
    case MasterKind::kFp32:
      DispatchAmsgrad<P, G, M, MasterKind::kFp32>(l, t, b, e, s);
      return;
    case MasterKind::kRemainder:
      if constexpr (std::is_same_v<P, BF16>) {
        DispatchAmsgrad<P, G, M, MasterKind::kRemainder>(l, t, b, e, s);
      }
      return;
  }
}

template <class P, class G>
void DispatchMoment(const Layout& l, const TensorPointers& t, uint64_t b,
                    uint64_t e, const StepScalars& s) {
  if (l.moment_dtype == DType::kBFloat16) {
    DispatchMaster<P, G, BF16>(l, t, b, e, s);
  } else {
    DispatchMaster<P, G, F32>(l, t, b, e, s);
  }
}

template <class P>
void DispatchGrad(const Layout& l, const TensorPointers& t, uint64_t b,
                  uint64_t e, const StepScalars& s) {
  switch (l.grad_dtype) {
    case DType::kFloat32:
      return DispatchMoment<P, F32>(l, t, b, e, s);
    case DType::kBFloat16:
      return DispatchMoment<P, BF16>(l, t, b, e, s);
    case DType::kFloat16:
      return DispatchMoment<P, F16>(l, t, b, e, s);
  }
}

template <class G>
double SumSquares(const void* grad, uint64_t begin, uint64_t end) {
  const auto* g = static_cast<const typename G::T*>(grad);
  // Eight independent accumulators: the sum stays deterministic for a given
  // range and the loop vectorizes without reassociation flags.
  double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  uint64_t i = begin;
  for (; i + 8 <= end; i += 8) {
    for (int k = 0; k < 8; ++k) {
      const double x = G::Load(g[i + k]);
      acc[k] += x * x;
    }
  }
  for (; i < end; ++i) {
    const double x = G::Load(g[i]);
    acc[0] += x * x;
  }
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) +
         ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

float LoadParam(DType d, const void* p, uint64_t i) {
  switch (d) {
    case DType::kFloat32:
      return static_cast<const float*>(p)[i];
    case DType::kBFloat16:
      return BFloat16ToFloat(static_cast<const uint16_t*>(p)[i]);
    case DType::kFloat16:
      return HalfToFloat(static_cast<const uint16_t*>(p)[i]);
  }
  return 0;
}

void StoreParam(DType d, void* p, uint64_t i, float x) {
  switch (d) {
    case DType::kFloat32:
      static_cast<float*>(p)[i] = x;
      return;
    case DType::kBFloat16:
      static_cast<uint16_t*>(p)[i] = FloatToBFloat16(x);
      return;
    case DType::kFloat16:
      static_cast<uint16_t*>(p)[i] = FloatToHalf(x);
      return;
  }
}

}  // namespace

StepScalars MakeStepScalars(const AdamWHyper& h, uint64_t t, double grad_scale,
                            double clip_coef) {
  StepScalars s;
  s.lr = static_cast<float>(h.lr);
  s.beta1 = static_cast<float>(h.beta1);
  s.beta2 = static_cast<float>(h.beta2);
  s.one_minus_beta1 = static_cast<float>(1.0 - h.beta1);
  s.one_minus_beta2 = static_cast<float>(1.0 - h.beta2);
  s.eps = static_cast<float>(h.eps);
  s.weight_decay = static_cast<float>(h.weight_decay);
  s.adamw = h.adamw;
  s.decay = h.adamw ? static_cast<float>(1.0 - h.lr * h.weight_decay) : 1.0f;
  const double td = static_cast<double>(t);
  const double bc1 = h.bias_correction ? 1.0 - std::pow(h.beta1, td) : 1.0;
  const double bc2 = h.bias_correction ? 1.0 - std::pow(h.beta2, td) : 1.0;
  s.step_size = static_cast<float>(h.lr / bc1);
  s.bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  const double scale = grad_scale > 0 ? grad_scale : 1.0;
  double mul = clip_coef / scale;
  if (h.maximize) mul = -mul;
  s.grad_mul = static_cast<float>(mul);
  return s;
}

void AdamWStepRange(const Layout& layout, const TensorPointers& t,
                    uint64_t begin, uint64_t end, const StepScalars& s) {
  if (begin >= end) return;
  switch (layout.param_dtype) {
    case DType::kFloat32:
      return DispatchGrad<F32>(layout, t, begin, end, s);
    case DType::kBFloat16:
      return DispatchGrad<BF16>(layout, t, begin, end, s);
    case DType::kFloat16:
      return DispatchGrad<F16>(layout, t, begin, end, s);
  }
}

double GradSumSquaresRange(DType grad_dtype, const void* grad, uint64_t begin,
                           uint64_t end) {
  switch (grad_dtype) {
    case DType::kFloat32:
      return SumSquares<F32>(grad, begin, end);
    case DType::kBFloat16:
      return SumSquares<BF16>(grad, begin, end);
    case DType::kFloat16:
      return SumSquares<F16>(grad, begin, end);
  }
  return 0;
}

void InitMasterRange(const Layout& layout, const TensorPointers& t,
                     uint64_t begin, uint64_t end) {
  switch (layout.master) {
    case MasterKind::kNone:
      return;
    case MasterKind::kFp32: {
      float* master = static_cast<float*>(t.master);
      for (uint64_t i = begin; i < end; ++i) {
        master[i] = LoadParam(layout.param_dtype, t.param, i);
      }
      return;
    }
    case MasterKind::kRemainder:
      std::fill(static_cast<int16_t*>(t.master) + begin,
                static_cast<int16_t*>(t.master) + end, int16_t{0});
      return;
  }
}

void WriteParamFromMasterRange(const Layout& layout, const TensorPointers& t,
                               uint64_t begin, uint64_t end) {
  if (layout.master != MasterKind::kFp32) return;
  const float* master = static_cast<const float*>(t.master);
  for (uint64_t i = begin; i < end; ++i) {
    StoreParam(layout.param_dtype, t.param, i, master[i]);
  }
}

}  // namespace optimd
