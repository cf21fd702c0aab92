// The CPU reference AdamW step: the math every backend must reproduce.
//
// torch.optim.AdamW semantics (torch 1.13's single-tensor form), per element,
// all in fp32:
//   g  = grad * grad_mul           (grad_mul folds 1/grad_scale, the clip
//                                   coefficient and the sign for maximize)
//   p  = master or param
//   AdamW: p *= 1 - lr*wd          Adam: g += wd*p
//   m  = m*beta1 + (1-beta1)*g
//   v  = v*beta2 + (1-beta2)*g*g
//   vmax = max(vmax, v)            (amsgrad; the denominator then uses vmax)
//   p += -step_size * (m / (sqrt(v) / bc2_sqrt + eps))
// with step_size = lr / (1 - beta1^t), bc2_sqrt = sqrt(1 - beta2^t), computed
// in double and rounded to fp32 once per step (1 and 1 without bias
// correction). Low-precision values are widened exactly and rounded back to
// nearest-even, except a bf16 parameter with remainder, which is rounded so
// that the remainder rebuilds the master exactly (see core/layout.h).
// The float64 layout runs the same operations in double, with the double
// scalars unrounded, as torch steps float64 parameters.
//
// Functions here are pure and thread-compatible: callers split a tensor into
// disjoint element ranges and may run ranges on different threads.
#ifndef OPTIMD_KERNELS_ADAMW_ADAMW_CPU_H_
#define OPTIMD_KERNELS_ADAMW_ADAMW_CPU_H_

#include <cstdint>

#include "core/layout.h"
#include "core/step_types.h"
#include "kernels/cpu_optimizer.h"

namespace optimd {

// Per-step scalars of one group, already folded, in double; each kernel
// rounds them to its compute type once (fp32, or none for float64).
struct AdamWScalars {
  double lr = 0;
  double beta1 = 0;
  double beta2 = 0;
  double one_minus_beta1 = 0;
  double one_minus_beta2 = 0;
  double eps = 0;
  double weight_decay = 0;
  // 1 - lr * weight_decay (AdamW mode), else 1.
  double decay = 1;
  bool adamw = true;
  // lr / (1 - beta1^t).
  double step_size = 0;
  // sqrt(1 - beta2^t).
  double bc2_sqrt = 1;
  // (maximize ? -1 : 1) * clip_coef / grad_scale.
  double grad_mul = 1;
};

// Folds hyperparameters, the step number t (>= 1), the loss scale and the
// clip coefficient into AdamWScalars.
AdamWScalars MakeAdamWScalars(const OptimizerHyper& h, uint64_t t,
                              double grad_scale, double clip_coef);

// Applies one AdamW step to elements [begin, end) of a tensor.
void AdamWStepRange(const Layout& layout, const TensorPointers& t,
                    uint64_t begin, uint64_t end, const AdamWScalars& s);

// AdamW's CPU step as kernels/step_cpu.cc lists it: the two functions
// above behind the generic interface.
extern const CpuOptimizer kAdamWCpu;

}  // namespace optimd

#endif  // OPTIMD_KERNELS_ADAMW_ADAMW_CPU_H_
