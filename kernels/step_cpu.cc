#include "kernels/step_cpu.h"

#include <cstdio>
#include <cstdlib>
#include <string>

#include "kernels/adamw/adamw_cpu.h"
#include "kernels/lion/lion_cpu.h"
#include "kernels/sgd/sgd_cpu.h"

namespace optimd {
namespace {

// Every optimizer's CPU step, one line each (kernels/<optimizer>/).
constexpr const CpuOptimizer* kCpuOptimizers[] = {
    &kAdamWCpu,
    &kSgdCpu,
    &kLionCpu,
};

const CpuOptimizer* CpuOptimizerOf(OptimizerKind kind) {
  for (const CpuOptimizer* o : kCpuOptimizers) {
    if (o->kind == kind) return o;
  }
  return nullptr;
}

}  // namespace

OptimizerScalars MakeOptimizerScalars(const OptimizerHyper& h, uint64_t t,
                                      double grad_scale, double clip_coef) {
  const CpuOptimizer* o = CpuOptimizerOf(h.kind);
  if (o == nullptr) {
    std::fprintf(stderr, "optimd: no CPU kernel for optimizer %d\n",
                 static_cast<int>(h.kind));
    std::abort();
  }
  OptimizerScalars s;
  o->make_scalars(h, t, grad_scale, clip_coef, &s);
  return s;
}

void OptimizerStepRange(const Layout& layout, const TensorPointers& t,
                        uint64_t begin, uint64_t end,
                        const OptimizerScalars& s) {
  const CpuOptimizer* o = CpuOptimizerOf(s.kind());
  if (o != nullptr && layout.optimizer == s.kind()) {
    return o->step_range(layout, t, begin, end, s);
  }
  std::fprintf(stderr, "optimd: step scalars of %s for a %s layout\n",
               std::string(OptimizerName(s.kind())).c_str(),
               layout.DebugString().c_str());
  std::abort();
}

}  // namespace optimd
