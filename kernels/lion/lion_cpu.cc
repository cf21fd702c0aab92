#include "kernels/lion/lion_cpu.h"

#include "core/step_math.h"
#include "kernels/cpu_layout.h"
#include "kernels/lion/lion_math.h"

namespace optimd {
namespace {

template <class P, class G, class M, MasterKind K>
void LionKernel(const TensorPointers& t, uint64_t begin, uint64_t end,
                const LionScalars& s) {
  const cpu::Weight<P, K> w(t);
  const auto* __restrict grad = static_cast<const typename G::T*>(t.grad);
  auto* __restrict m = static_cast<typename M::T*>(t.state[0]);
  const LionElementScalars e{s.grad_mul, s.decay,           s.beta1,
                             s.beta2,    s.one_minus_beta1, s.one_minus_beta2,
                             -s.lr};
  for (uint64_t i = begin; i < end; ++i) {
    float mi = M::Load(m[i]);
    const float p = LionElement(G::Load(grad[i]), w.Load(i), mi, e);
    m[i] = M::Store(mi);
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
