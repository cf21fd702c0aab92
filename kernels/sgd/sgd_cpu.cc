#include "kernels/sgd/sgd_cpu.h"

#include "core/step_math.h"
#include "kernels/cpu_layout.h"
#include "kernels/sgd/sgd_math.h"

namespace optimd {
namespace {

template <class P, class G, class M, MasterKind K, bool kMomentum>
void SgdKernel(const TensorPointers& t, uint64_t begin, uint64_t end,
               const SgdScalars& s) {
  const cpu::Weight<P, K> w(t);
  const auto* __restrict grad = static_cast<const typename G::T*>(t.grad);
  auto* __restrict buf = static_cast<typename M::T*>(t.state[0]);
  const SgdElementScalars e{s.grad_mul,      s.weight_decay, s.momentum,
                            s.dampening_mul, -s.lr,          s.nesterov};
  const bool first = s.first;
  for (uint64_t i = begin; i < end; ++i) {
    float b = 0.0f;
    if constexpr (kMomentum) {
      if (!first) b = M::Load(buf[i]);
    }
    const float p =
        SgdElement<kMomentum>(G::Load(grad[i]), w.Load(i), b, first, e);
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
  s.lr = static_cast<float>(h.lr);
  s.momentum = static_cast<float>(h.momentum);
  s.dampening_mul = static_cast<float>(1.0 - h.dampening);
  s.weight_decay = static_cast<float>(h.weight_decay);
  s.nesterov = h.nesterov;
  s.first = t == 1;
  s.grad_mul =
      static_cast<float>(GradMultiplier(grad_scale, clip_coef, h.maximize));
  return s;
}

void SgdStepRange(const Layout& layout, const TensorPointers& t, uint64_t begin,
                  uint64_t end, const SgdScalars& s) {
  if (begin >= end) return;
  SgdRange kernel{layout, t, begin, end, s};
  cpu::DispatchLayout(layout, kernel);
}

}  // namespace optimd
