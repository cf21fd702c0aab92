// One CPU step for any optimizer: the folded scalars of a group's (or a
// tensor's) step, and the one dispatch from a tensor's layout to its
// optimizer's kernel. Backends call these and name no optimizer.
#ifndef OPTIMD_KERNELS_STEP_CPU_H_
#define OPTIMD_KERNELS_STEP_CPU_H_

#include <cstdint>

#include "core/layout.h"
#include "core/optimizer.h"
#include "core/step_types.h"
#include "kernels/adamw/adamw_cpu.h"
#include "kernels/lion/lion_cpu.h"
#include "kernels/sgd/sgd_cpu.h"

namespace optimd {

// The scalars of one step; only the member of `kind` is set.
struct OptimizerScalars {
  OptimizerKind kind = OptimizerKind::kAdamW;
  AdamWScalars adamw;
  SgdScalars sgd;
  LionScalars lion;
};

// Folds `h`, the tensor's step number t (>= 1), the loss scale and the
// clip coefficient for h.kind.
OptimizerScalars MakeOptimizerScalars(const OptimizerHyper& h, uint64_t t,
                                      double grad_scale, double clip_coef);

// Applies one step of the layout's optimizer to elements [begin, end).
// Aborts when `s` was made for another optimizer (a bug: a group's
// tensors share its optimizer).
void OptimizerStepRange(const Layout& layout, const TensorPointers& t,
                        uint64_t begin, uint64_t end,
                        const OptimizerScalars& s);

}  // namespace optimd

#endif  // OPTIMD_KERNELS_STEP_CPU_H_
