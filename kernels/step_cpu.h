// One CPU step for any optimizer: the folded scalars of a group's (or a
// tensor's) step, and the one dispatch from a tensor's layout to its
// optimizer's kernel. Backends call these and name no optimizer; the
// optimizers are found in the list of step_cpu.cc (each one's CpuOptimizer,
// kernels/cpu_optimizer.h).
#ifndef OPTIMD_KERNELS_STEP_CPU_H_
#define OPTIMD_KERNELS_STEP_CPU_H_

#include <cstdint>

#include "core/layout.h"
#include "core/optimizer.h"
#include "core/step_types.h"
#include "kernels/cpu_optimizer.h"

namespace optimd {

// Folds `h`, the tensor's step number t (>= 1), the loss scale and the
// clip coefficient for h.kind. Aborts for an optimizer without a CPU
// kernel (a bug: the traits of core/optimizer.h and the list disagree).
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
