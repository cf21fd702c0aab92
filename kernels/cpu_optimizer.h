// One optimizer's CPU step as generic code reaches it: the optimizer's
// folded step scalars held without naming their type, and the two
// functions of its folder (kernels/<optimizer>/<optimizer>_cpu.h) that make
// and apply them. Each optimizer defines one CpuOptimizer; the list of them
// is kernels/step_cpu.cc's, the one place that names every optimizer.
//
// Plain values: safe to copy and to read from any thread.
#ifndef OPTIMD_KERNELS_CPU_OPTIMIZER_H_
#define OPTIMD_KERNELS_CPU_OPTIMIZER_H_

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "core/layout.h"
#include "core/optimizer.h"
#include "core/step_types.h"

namespace optimd {

// The step scalars of one optimizer's step (of a group, or of one tensor
// whose own step count differs), folded once per step. `kind` names the
// optimizer that made them; the bytes are that optimizer's scalars struct
// (AdamWScalars, SgdScalars, ...), a trivially copyable value.
class OptimizerScalars {
 public:
  // Room for the largest optimizer's scalars struct.
  static constexpr size_t kBytes = 256;

  OptimizerKind kind() const { return kind_; }

  // Holds `s`, the scalars of optimizer `kind`.
  template <class S>
  void Hold(OptimizerKind kind, const S& s) {
    CheckType<S>();
    kind_ = kind;
    std::memcpy(bytes_, &s, sizeof(S));
  }

  // The scalars held, as the optimizer that made them reads them.
  template <class S>
  S As() const {
    CheckType<S>();
    S s;
    std::memcpy(&s, bytes_, sizeof(S));
    return s;
  }

 private:
  template <class S>
  static constexpr void CheckType() {
    static_assert(std::is_trivially_copyable_v<S>, "scalars are plain values");
    static_assert(sizeof(S) <= kBytes, "OptimizerScalars::kBytes too small");
    static_assert(alignof(S) <= alignof(double), "scalars align as doubles");
  }

  OptimizerKind kind_ = OptimizerKind::kAdamW;
  alignas(double) unsigned char bytes_[kBytes] = {};
};

// One optimizer's CPU step.
struct CpuOptimizer {
  OptimizerKind kind;
  // Folds `h`, the tensor's step number t (>= 1), the loss scale and the
  // clip coefficient into `out` (in double, rounded by the kernel once).
  void (*make_scalars)(const OptimizerHyper& h, uint64_t t, double grad_scale,
                       double clip_coef, OptimizerScalars* out);
  // Applies one step to elements [begin, end) of a tensor of `layout`
  // (whose optimizer is `kind`, as the scalars' is).
  void (*step_range)(const Layout& layout, const TensorPointers& t,
                     uint64_t begin, uint64_t end, const OptimizerScalars& s);
};

// The CpuOptimizer of an optimizer whose folder has the two typed
// functions: `kMake` folds its scalars struct S (the signature of
// CpuOptimizer::make_scalars, returning S) and `kStep` applies it. Each
// optimizer's row is then one line:
//   const CpuOptimizer kSgdCpu =
//       MakeCpuOptimizer<OptimizerKind::kSgd, SgdScalars, MakeSgdScalars,
//                        SgdStepRange>();
template <OptimizerKind K, class S,
          S (*kMake)(const OptimizerHyper&, uint64_t, double, double),
          void (*kStep)(const Layout&, const TensorPointers&, uint64_t,
                        uint64_t, const S&)>
constexpr CpuOptimizer MakeCpuOptimizer() {
  return CpuOptimizer{
      K,
      [](const OptimizerHyper& h, uint64_t t, double grad_scale,
         double clip_coef, OptimizerScalars* out) {
        out->Hold(K, kMake(h, t, grad_scale, clip_coef));
      },
      [](const Layout& layout, const TensorPointers& t, uint64_t begin,
         uint64_t end, const OptimizerScalars& s) {
        kStep(layout, t, begin, end, s.As<S>());
      },
  };
}

}  // namespace optimd

#endif  // OPTIMD_KERNELS_CPU_OPTIMIZER_H_
