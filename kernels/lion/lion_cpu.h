// The CPU reference Lion step (Chen et al., 2023, "Symbolic Discovery of
// Optimization Algorithms", Algorithm 2), per element, in fp32 (in double
// for the float64 layout):
//   g = grad * grad_mul        (1/grad_scale, the clip coefficient and the
//                               sign for maximize, folded)
//   p = master or param
//   p = p * (1 - lr*wd)        (decoupled weight decay)
//   c = m*beta1 + (1-beta1)*g
//   p = p - lr*sign(c)         (sign(0) = 0)
//   m = m*beta2 + (1-beta2)*g
// The momentum m ("exp_avg") is stored in the group's moment dtype. The
// scalars are folded in double and rounded once to the compute type (not
// at all for float64).
#ifndef OPTIMD_KERNELS_LION_LION_CPU_H_
#define OPTIMD_KERNELS_LION_LION_CPU_H_

#include <cstdint>

#include "core/layout.h"
#include "core/optimizer.h"
#include "core/step_types.h"
#include "kernels/cpu_optimizer.h"

namespace optimd {

// Per-step scalars of one group, already folded, in double; each kernel
// rounds them to its compute type once (fp32, or none for float64).
struct LionScalars {
  double lr = 0;
  double beta1 = 0;
  double beta2 = 0;
  double one_minus_beta1 = 0;
  double one_minus_beta2 = 0;
  // 1 - lr * weight_decay.
  double decay = 1;
  // (maximize ? -1 : 1) * clip_coef / grad_scale.
  double grad_mul = 1;
};

// Folds hyperparameters, the loss scale and the clip coefficient. Lion has
// no bias correction: the step number t is taken (as every optimizer's
// MakeScalars takes it) and does not enter.
LionScalars MakeLionScalars(const OptimizerHyper& h, uint64_t t,
                            double grad_scale, double clip_coef);

// Applies one Lion step to elements [begin, end) of a tensor.
void LionStepRange(const Layout& layout, const TensorPointers& t,
                   uint64_t begin, uint64_t end, const LionScalars& s);

// Lion's CPU step as kernels/step_cpu.cc lists it: the two functions
// above behind the generic interface.
extern const CpuOptimizer kLionCpu;

}  // namespace optimd

#endif  // OPTIMD_KERNELS_LION_LION_CPU_H_
