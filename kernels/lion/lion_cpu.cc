#include "kernels/lion/lion_cpu.h"

#include "core/step_math.h"
#include "kernels/cpu_layout.h"

namespace optimd {
namespace {

template <class P, class G, class M, MasterKind K>
void LionKernel(const TensorPointers& t, uint64_t begin, uint64_t end,
                const LionScalars& s) {
  const cpu::Weight<P, K> w(t);
  const auto* __restrict grad = static_cast<const typename G::T*>(t.grad);
  auto* __restrict m = static_cast<typename M::T*>(t.state[0]);
  const float grad_mul = s.grad_mul, decay = s.decay, neg_lr = -s.lr;
  const float b1 = s.beta1, b2 = s.beta2;
  const float omb1 = s.one_minus_beta1, omb2 = s.one_minus_beta2;
  for (uint64_t i = begin; i < end; ++i) {
    const float g = G::Load(grad[i]) * grad_mul;
    float p = w.Load(i) * decay;
    const float mi = M::Load(m[i]);
    const float c = mi * b1 + omb1 * g;
    const float sign = (c > 0.0f ? 1.0f : 0.0f) - (c < 0.0f ? 1.0f : 0.0f);
    p = p + neg_lr * sign;
    m[i] = M::Store(mi * b2 + omb2 * g);
    w.Store(i, p);
  }
}

// The Lion kernel for one element range, instantiated by
// cpu::DispatchLayout.
struct LionRange {
  const TensorPointers& t;
  uint64_t begin, end;
  const LionScalars& s;

  template <class P, class G, class M, MasterKind K>
  void Run() {
    LionKernel<P, G, M, K>(t, begin, end, s);
  }
};

}  // namespace

LionScalars MakeLionScalars(const OptimizerHyper& h, double grad_scale,
                            double clip_coef) {
  LionScalars s;
  s.lr = static_cast<float>(h.lr);
  s.beta1 = static_cast<float>(h.beta1);
  s.beta2 = static_cast<float>(h.beta2);
  s.one_minus_beta1 = static_cast<float>(1.0 - h.beta1);
  s.one_minus_beta2 = static_cast<float>(1.0 - h.beta2);
  s.decay = static_cast<float>(1.0 - h.lr * h.weight_decay);
  s.grad_mul =
      static_cast<float>(GradMultiplier(grad_scale, clip_coef, h.maximize));
  return s;
}

void LionStepRange(const Layout& layout, const TensorPointers& t,
                   uint64_t begin, uint64_t end, const LionScalars& s) {
  if (begin >= end) return;
  LionRange kernel{t, begin, end, s};
  cpu::DispatchLayout(layout, kernel);
}

}  // namespace optimd
