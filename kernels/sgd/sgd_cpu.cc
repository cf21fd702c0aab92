#include "kernels/sgd/sgd_cpu.h"

#include "core/step_math.h"
#include "kernels/cpu_layout.h"
#include "kernels/sgd/sgd_math.h"

namespace optimd {
namespace {

// What SgdElement needs of the step's scalars, each rounded once to the
// compute type C.
template <class C>
SgdElementScalarsT<C> ElementScalars(const SgdScalars& s) {
  auto r = [](double x) { return static_cast<C>(x); };
  return SgdElementScalarsT<C>{r(s.grad_mul), r(s.weight_decay),
                               r(s.momentum), r(s.dampening_mul),
                               -r(s.lr),      s.nesterov};
}

template <class P, class G, class M, MasterKind K, bool kMomentum>
void SgdKernel(const TensorPointers& t, uint64_t begin, uint64_t end,
               const SgdScalars& s) {
  using C = typename P::C;  // float, or double for the float64 layout
  const cpu::Weight<P, K> w(t);
  const auto* __restrict grad = static_cast<const typename G::T*>(t.grad);
  auto* __restrict buf = static_cast<typename M::T*>(t.state[0]);
  const SgdElementScalarsT<C> e = ElementScalars<C>(s);
  const bool first = s.first;
  for (uint64_t i = begin; i < end; ++i) {
    C b = C(0);
    if constexpr (kMomentum) {
      if (!first) b = M::Load(buf[i]);
    }
    const C p = SgdElement<kMomentum>(static_cast<C>(G::Load(grad[i])),
                                      w.Load(i), b, first, e);
    if constexpr (kMomentum) buf[i] = M::Store(b);
    w.Store(i, p);
  }
}

// The SGD kernel for one element range, instantiated by cpu::DispatchLayout.
struct SgdRange {
  const Layout& layout;
  const TensorPointers& t;
  uint64_t begin, end;
  const SgdScalars& s;
  static constexpr bool kTakesFloat64 = true;

  template <class P, class G, class M, MasterKind K>
  void Run() {
    if (layout.state_slots == 0) {
      return SgdKernel<P, G, M, K, false>(t, begin, end, s);
    }
    return SgdKernel<P, G, M, K, true>(t, begin, end, s);
  }
};

}  // namespace

SgdScalars MakeSgdScalars(const OptimizerHyper& h, uint64_t t,
                          double grad_scale, double clip_coef) {
  SgdScalars s;
  s.lr = h.lr;
  s.momentum = h.momentum;
  s.dampening_mul = 1.0 - h.dampening;
  s.weight_decay = h.weight_decay;
  s.nesterov = h.nesterov;
  s.first = t == 1;
  s.grad_mul = GradMultiplier(grad_scale, clip_coef, h.maximize);
  return s;
}

void SgdStepRange(const Layout& layout, const TensorPointers& t, uint64_t begin,
                  uint64_t end, const SgdScalars& s) {
  if (begin >= end) return;
  SgdRange kernel{layout, t, begin, end, s};
  cpu::DispatchLayout(layout, kernel);
}

const CpuOptimizer kSgdCpu = MakeCpuOptimizer<OptimizerKind::kSgd, SgdScalars,
                                              MakeSgdScalars, SgdStepRange>();

}  // namespace optimd
