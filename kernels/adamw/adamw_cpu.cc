#include "kernels/adamw/adamw_cpu.h"

#include <algorithm>
#include <cmath>

#include "core/block8.h"
#include "core/fp8_quantize.h"
#include "core/step_math.h"
#include "kernels/adamw/adamw_math.h"
#include "kernels/cpu_layout.h"

namespace optimd {
namespace {

// block8 scales per block: exp_avg's, then exp_avg_sq's (no amsgrad).
constexpr uint64_t kBlock8Slots = 2;

// What AdamWElement needs of the step's scalars, each rounded once to the
// compute type T.
template <class T = float>
AdamWElementScalarsT<T> ElementScalars(const AdamWScalars& s) {
  auto r = [](double x) { return static_cast<T>(x); };
  return AdamWElementScalarsT<T>{
      r(s.grad_mul),        r(s.decay), s.adamw ? T(0) : r(s.weight_decay),
      r(s.beta1),           r(s.beta2), r(s.one_minus_beta1),
      r(s.one_minus_beta2), r(s.eps),   -r(s.step_size)};
}

template <class P, class G, class M, MasterKind K, bool kAmsgrad, bool kAdamW>
void StepKernel(const TensorPointers& t, uint64_t begin, uint64_t end,
                const AdamWScalars& s) {
  using C = typename P::C;  // float, or double for the float64 layout
  const cpu::Weight<P, K> w(t);
  const auto* __restrict grad = static_cast<const typename G::T*>(t.grad);
  auto* __restrict m = static_cast<typename M::T*>(t.state[0]);
  auto* __restrict v = static_cast<typename M::T*>(t.state[1]);
  auto* __restrict vmax = static_cast<typename M::T*>(t.state[2]);
  const AdamWElementScalarsT<C> e = ElementScalars<C>(s);
  const C bc2 = static_cast<C>(s.bc2_sqrt);
  const auto div_bc2 = [bc2](C a) { return a / bc2; };
  for (uint64_t i = begin; i < end; ++i) {
    C mi = M::Load(m[i]), vi = M::Load(v[i]);
    C xi = kAmsgrad ? M::Load(vmax[i]) : C(0);
    const C p = AdamWElement<kAmsgrad, kAdamW>(
        static_cast<C>(G::Load(grad[i])), w.Load(i), mi, vi, xi, e, div_bc2);
    m[i] = M::Store(mi);
    v[i] = M::Store(vi);
    if constexpr (kAmsgrad) vmax[i] = M::Store(xi);
    w.Store(i, p);
  }
}

// AdamW over block8 moments (core/block8.h), [begin, end) starting on a
// block (plan items do). Per block: read both moments back, update each
// element with the same AdamWElement as every layout, then store the new
// moments quantized with scales from their new block maxima.
template <class P, class G, MasterKind K, bool kAdamW>
void StepBlock8(const TensorPointers& t, uint64_t begin, uint64_t end,
                const AdamWElementScalars& e, float bc2) {
  const cpu::Weight<P, K> w(t);
  const auto* __restrict grad = static_cast<const typename G::T*>(t.grad);
  auto* __restrict mq = static_cast<uint8_t*>(t.state[0]);
  auto* __restrict vq = static_cast<uint8_t*>(t.state[1]);
  auto* __restrict scales = static_cast<float*>(t.scales);
  const auto div_bc2 = [bc2](float a) { return a / bc2; };
  float m[kBlock8Elements], v[kBlock8Elements];
  for (uint64_t first = begin; first < end; first += kBlock8Elements) {
    const uint64_t n = std::min(kBlock8Elements, end - first);
    float* s = scales + (first / kBlock8Elements) * kBlock8Slots;
    float mmax = 0.0f, vmax = 0.0f;
    for (uint64_t j = 0; j < n; ++j) {
      const uint64_t i = first + j;
      m[j] = Block8Decode<true>(mq[i], s[0]);
      v[j] = Block8Decode<false>(vq[i], s[1]);
      float unused = 0.0f;
      w.Store(i, AdamWElement<false, kAdamW>(G::Load(grad[i]), w.Load(i), m[j],
                                             v[j], unused, e, div_bc2));
      mmax = Block8Max(mmax, m[j]);
      vmax = Block8Max(vmax, v[j]);
    }
    s[0] = Block8Scale(mmax);
    s[1] = Block8Scale(vmax);
    const Block8Multiplier km = Block8MultiplierOf(s[0]);
    const Block8Multiplier kv = Block8MultiplierOf(s[1]);
    for (uint64_t j = 0; j < n; ++j) {
      mq[first + j] = Block8Encode<true>(m[j], km);
      vq[first + j] = Block8Encode<false>(v[j], kv);
    }
  }
}

// AdamW over an FP8 parameter (P: cpu::E4M3 or cpu::E5M2), [begin, end)
// whole scaling units (plan items are). Unit by unit: the same element
// update as every layout on the unit's masters (StepKernel, which writes
// the master only for FP8), then the unit's requantization while its
// masters are in cache. A per-tensor-scaled tensor is one unit: its
// masters are read a second time, after its amax is known.
template <class P, class G, class M, bool kAmsgrad, bool kAdamW>
void StepFp8(const TensorPointers& t, uint64_t begin, uint64_t end,
             const AdamWScalars& s) {
  ForEachFp8Unit(t.fp8, begin, end, [&](const Fp8Unit& u) {
    ForEachFp8RowSpan(t.fp8, u, [&](uint64_t a, uint64_t b) {
      StepKernel<P, G, M, MasterKind::kFp32, kAmsgrad, kAdamW>(t, a, b, s);
    });
    QuantizeFp8Unit<P::kFormat>(t, u);
  });
}

// The AdamW kernel for one element range, instantiated by
// cpu::DispatchLayout; amsgrad and the decay mode are template parameters
// too.
struct AdamWRange {
  const Layout& layout;
  const TensorPointers& t;
  uint64_t begin, end;
  const AdamWScalars& s;
  static constexpr bool kTakesBlock8 = true;
  static constexpr bool kTakesFloat64 = true;
  static constexpr bool kTakesFp8 = true;

  template <class P, class G, class M, MasterKind K>
  void Run() {
    if constexpr (cpu::IsFp8Codec<P>::value) {
      // Dispatched with M = F32 or BF16 and K = kFp32 only (ResolveFp8Recipe).
      if (layout.amsgrad()) {
        if (s.adamw) return StepFp8<P, G, M, true, true>(t, begin, end, s);
        return StepFp8<P, G, M, true, false>(t, begin, end, s);
      }
      if (s.adamw) return StepFp8<P, G, M, false, true>(t, begin, end, s);
      return StepFp8<P, G, M, false, false>(t, begin, end, s);
    } else if constexpr (std::is_same_v<M, cpu::Block8>) {
      const AdamWElementScalars e = ElementScalars(s);
      const float bc2 = static_cast<float>(s.bc2_sqrt);
      if (s.adamw) return StepBlock8<P, G, K, true>(t, begin, end, e, bc2);
      return StepBlock8<P, G, K, false>(t, begin, end, e, bc2);
    } else if (layout.amsgrad()) {
      if (s.adamw) return StepKernel<P, G, M, K, true, true>(t, begin, end, s);
      return StepKernel<P, G, M, K, true, false>(t, begin, end, s);
    } else {
      if (s.adamw) return StepKernel<P, G, M, K, false, true>(t, begin, end, s);
      return StepKernel<P, G, M, K, false, false>(t, begin, end, s);
    }
  }
};

}  // namespace

AdamWScalars MakeAdamWScalars(const OptimizerHyper& h, uint64_t t,
                              double grad_scale, double clip_coef) {
  AdamWScalars s;
  s.lr = h.lr;
  s.beta1 = h.beta1;
  s.beta2 = h.beta2;
  s.one_minus_beta1 = 1.0 - h.beta1;
  s.one_minus_beta2 = 1.0 - h.beta2;
  s.eps = h.eps;
  s.weight_decay = h.weight_decay;
  s.adamw = h.adamw;
  s.decay = h.adamw ? 1.0 - h.lr * h.weight_decay : 1.0;
  const double bc1 = h.bias_correction ? 1.0 - BetaPower(h.beta1, t) : 1.0;
  const double bc2 = h.bias_correction ? 1.0 - BetaPower(h.beta2, t) : 1.0;
  s.step_size = h.lr / bc1;
  s.bc2_sqrt = std::sqrt(bc2);
  s.grad_mul = GradMultiplier(grad_scale, clip_coef, h.maximize);
  return s;
}

void AdamWStepRange(const Layout& layout, const TensorPointers& t,
                    uint64_t begin, uint64_t end, const AdamWScalars& s) {
  if (begin >= end) return;
  AdamWRange kernel{layout, t, begin, end, s};
  cpu::DispatchLayout(layout, kernel);
}

const CpuOptimizer kAdamWCpu =
    MakeCpuOptimizer<OptimizerKind::kAdamW, AdamWScalars, MakeAdamWScalars,
                     AdamWStepRange>();

}  // namespace optimd
