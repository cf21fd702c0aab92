#include "kernels/sgd/sgd_cpu.h"

#include "core/step_math.h"
#include "kernels/cpu_layout.h"

namespace optimd {
namespace {

template <class P, class G, class M, MasterKind K, bool kMomentum,
          bool kNesterov>
void SgdKernel(const TensorPointers& t, uint64_t begin, uint64_t end,
               const SgdScalars& s) {
  const cpu::Weight<P, K> w(t);
  const auto* __restrict grad = static_cast<const typename G::T*>(t.grad);
  auto* __restrict buf = static_cast<typename M::T*>(t.state[0]);
  const float grad_mul = s.grad_mul, wd = s.weight_decay;
  const bool decay = s.weight_decay != 0, first = s.first;
  const float mom = s.momentum, damp = s.dampening_mul, neg_lr = -s.lr;
  for (uint64_t i = begin; i < end; ++i) {
    float g = G::Load(grad[i]) * grad_mul;
    float p = w.Load(i);
    if (decay) g = g + wd * p;
    if constexpr (kMomentum) {
      const float b = first ? g : M::Load(buf[i]) * mom + damp * g;
      buf[i] = M::Store(b);
      if constexpr (kNesterov) {
        g = g + mom * b;
      } else {
        g = b;
      }
    }
    p = p + neg_lr * g;
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
      return SgdKernel<P, G, M, K, false, false>(t, begin, end, s);
    }
    if (s.nesterov) return SgdKernel<P, G, M, K, true, true>(t, begin, end, s);
    return SgdKernel<P, G, M, K, true, false>(t, begin, end, s);
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
