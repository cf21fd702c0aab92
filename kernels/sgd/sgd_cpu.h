// The CPU reference SGD step (torch.optim.SGD semantics), per element, in
// fp32 (in double for the float64 layout, as torch steps float64
// parameters):
//   g = grad * grad_mul        (1/grad_scale, the clip coefficient and the
//                               sign for maximize, folded)
//   p = master or param
//   g = g + wd*p               (weight_decay != 0)
//   momentum != 0:
//     b = g at the tensor's first step, else b*momentum + (1-dampening)*g
//     g = nesterov ? g + momentum*b : b
//   p = p - lr*g
// The momentum buffer is stored in the group's moment dtype; the update
// uses its unrounded value. The scalars are folded in double and rounded
// once to the compute type (not at all for float64).
#ifndef OPTIMD_KERNELS_SGD_SGD_CPU_H_
#define OPTIMD_KERNELS_SGD_SGD_CPU_H_

#include <cstdint>

#include "core/layout.h"
#include "core/optimizer.h"
#include "core/step_types.h"
#include "kernels/cpu_optimizer.h"

namespace optimd {

// Per-step scalars of one group (or one tensor), already folded, in
// double; each kernel rounds them to its compute type once (fp32, or none
// for float64).
struct SgdScalars {
  double lr = 0;
  double momentum = 0;
  // 1 - dampening.
  double dampening_mul = 1;
  double weight_decay = 0;
  bool nesterov = false;
  // The tensor's first step: the momentum buffer starts as the gradient.
  bool first = false;
  // (maximize ? -1 : 1) * clip_coef / grad_scale.
  double grad_mul = 1;
};

// Folds hyperparameters, the tensor's step number t (>= 1), the loss scale
// and the clip coefficient.
SgdScalars MakeSgdScalars(const OptimizerHyper& h, uint64_t t,
                          double grad_scale, double clip_coef);

// Applies one SGD step to elements [begin, end) of a tensor.
void SgdStepRange(const Layout& layout, const TensorPointers& t, uint64_t begin,
                  uint64_t end, const SgdScalars& s);

// Sgd's CPU step as kernels/step_cpu.cc lists it: the two functions
// above behind the generic interface.
extern const CpuOptimizer kSgdCpu;

}  // namespace optimd

#endif  // OPTIMD_KERNELS_SGD_SGD_CPU_H_
