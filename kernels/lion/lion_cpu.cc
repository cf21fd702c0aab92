#include "kernels/lion/lion_cpu.h"

#include "core/step_math.h"
#include "kernels/cpu_layout.h"
#include "kernels/lion/lion_math.h"

namespace optimd {
namespace {

// What LionElement needs of the step's scalars, each rounded once to the
// compute type C.
template <class C>
LionElementScalarsT<C> ElementScalars(const LionScalars& s) {
  auto r = [](double x) { return static_cast<C>(x); };
  return LionElementScalarsT<C>{
      r(s.grad_mul),        r(s.decay),           r(s.beta1), r(s.beta2),
      r(s.one_minus_beta1), r(s.one_minus_beta2), -r(s.lr)};
}

template <class P, class G, class M, MasterKind K>
void LionKernel(const TensorPointers& t, uint64_t begin, uint64_t end,
                const LionScalars& s) {
  using C = typename P::C;  // float, or double for the float64 layout
  const cpu::Weight<P, K> w(t);
  const auto* __restrict grad = static_cast<const typename G::T*>(t.grad);
  auto* __restrict m = static_cast<typename M::T*>(t.state[0]);
  const LionElementScalarsT<C> e = ElementScalars<C>(s);
  for (uint64_t i = begin; i < end; ++i) {
    C mi = M::Load(m[i]);
    const C p = LionElement(static_cast<C>(G::Load(grad[i])), w.Load(i), mi, e);
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
  static constexpr bool kTakesFloat64 = true;

  template <class P, class G, class M, MasterKind K>
  void Run() {
    LionKernel<P, G, M, K>(t, begin, end, s);
  }
};

}  // namespace

LionScalars MakeLionScalars(const OptimizerHyper& h, uint64_t /*t*/,
                            double grad_scale, double clip_coef) {
  LionScalars s;
  s.lr = h.lr;
  s.beta1 = h.beta1;
  s.beta2 = h.beta2;
  s.one_minus_beta1 = 1.0 - h.beta1;
  s.one_minus_beta2 = 1.0 - h.beta2;
  s.decay = 1.0 - h.lr * h.weight_decay;
  s.grad_mul = GradMultiplier(grad_scale, clip_coef, h.maximize);
  return s;
}

void LionStepRange(const Layout& layout, const TensorPointers& t,
                   uint64_t begin, uint64_t end, const LionScalars& s) {
  if (begin >= end) return;
  LionRange kernel{t, begin, end, s};
  cpu::DispatchLayout(layout, kernel);
}

const CpuOptimizer kLionCpu =
    MakeCpuOptimizer<OptimizerKind::kLion, LionScalars, MakeLionScalars,
                     LionStepRange>();

}  // namespace optimd
