#include "kernels/step_cpu.h"

#include <cstdio>
#include <cstdlib>

namespace optimd {

OptimizerScalars MakeOptimizerScalars(const OptimizerHyper& h, uint64_t t,
                                      double grad_scale, double clip_coef) {
  OptimizerScalars s;
  s.kind = h.kind;
  switch (h.kind) {
    case OptimizerKind::kAdamW:
      s.adamw = MakeAdamWScalars(h, t, grad_scale, clip_coef);
      break;
    case OptimizerKind::kSgd:
      s.sgd = MakeSgdScalars(h, t, grad_scale, clip_coef);
      break;
    case OptimizerKind::kLion:
      s.lion = MakeLionScalars(h, grad_scale, clip_coef);
      break;
  }
  return s;
}

void OptimizerStepRange(const Layout& layout, const TensorPointers& t,
                        uint64_t begin, uint64_t end,
                        const OptimizerScalars& s) {
  if (layout.optimizer == s.kind) {
    switch (s.kind) {
      case OptimizerKind::kAdamW:
        return AdamWStepRange(layout, t, begin, end, s.adamw);
      case OptimizerKind::kSgd:
        return SgdStepRange(layout, t, begin, end, s.sgd);
      case OptimizerKind::kLion:
        return LionStepRange(layout, t, begin, end, s.lion);
    }
  }
  std::fprintf(stderr, "optimd: step scalars of %s for a %s layout\n",
               std::string(OptimizerName(s.kind)).c_str(),
               layout.DebugString().c_str());
  std::abort();
}

}  // namespace optimd
