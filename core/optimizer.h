// The optimizer as a concept: which optimizer a group runs, its
// hyperparameters, and its traits (the named state slots each tensor holds,
// the validation of its hyperparameters). Everything that walks a tensor's
// state (allocation, state reads and writes, checkpoints) iterates over the
// slots named here instead of naming one optimizer's buffers; the math of
// each optimizer lives in kernels/.
#ifndef OPTIMD_CORE_OPTIMIZER_H_
#define OPTIMD_CORE_OPTIMIZER_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace optimd {

// The optimizers the daemon runs, one row each of core/optimizer.cc's
// traits. Numbers are stable: checkpoints name the optimizer, and the
// API's OptimizerKind (proto/optimd/v1/optimd.proto) numbers each one
// this value plus 1 (0 is its UNSPECIFIED, read as AdamW).
enum class OptimizerKind : uint8_t {
  // torch.optim.AdamW / Adam (Hyperparameters.mode picks the decay).
  kAdamW = 0,
  // torch.optim.SGD: momentum, dampening, nesterov, weight decay, maximize.
  kSgd = 1,
  // Lion (Chen et al., 2023, "Symbolic Discovery of Optimization
  // Algorithms"): the sign of an interpolated momentum.
  kLion = 2,
};

// "adamw", "sgd", "lion": the name in checkpoints and errors.
absl::string_view OptimizerName(OptimizerKind kind);
// The kind named `name`; INVALID_ARGUMENT for an unknown name.
absl::StatusOr<OptimizerKind> OptimizerFromName(absl::string_view name);
// The kind numbered `number` (OptimizerKind's value), or nullopt for a
// number no optimizer has.
std::optional<OptimizerKind> OptimizerFromNumber(int number);
// "adamw, sgd, lion": the known optimizers' names, for errors.
std::string KnownOptimizerNames();

// A group's hyperparameters, for every optimizer; each optimizer reads the
// fields its traits name and ignores the others.
struct OptimizerHyper {
  OptimizerKind kind = OptimizerKind::kAdamW;
  double lr = 1e-3;
  // AdamW: the moments' coefficients. Lion: beta1 interpolates the update's
  // sign, beta2 the momentum.
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;  // AdamW only
  double weight_decay = 1e-2;
  bool adamw = true;            // AdamW only: decoupled decay (else Adam)
  bool bias_correction = true;  // AdamW only
  bool maximize = false;
  bool amsgrad = false;   // AdamW only
  double momentum = 0;    // SGD only
  double dampening = 0;   // SGD only
  bool nesterov = false;  // SGD only
};

// The most state slots any optimizer keeps per tensor (AdamW with amsgrad:
// exp_avg, exp_avg_sq, max_exp_avg_sq).
inline constexpr int kMaxStateSlots = 3;

// Number of state slots (each of the group's moment dtype) a tensor of a
// group with `h` holds: AdamW 2 (3 with amsgrad), SGD 1 with momentum and 0
// without, Lion 1.
int StateSlotCount(const OptimizerHyper& h);

// The name of state slot `slot` of `kind`, as torch's state dicts and the
// daemon's checkpoints call it: AdamW exp_avg, exp_avg_sq, max_exp_avg_sq;
// SGD momentum_buffer; Lion exp_avg.
absl::string_view StateSlotName(OptimizerKind kind, int slot);

// Why a group with `h` cannot hold block8 moments (core/block8.h), or
// nullptr when it can: only optimizers whose kernels take them (AdamW,
// without amsgrad, whose running maximum has no 8-bit form).
const char* Block8Refusal(const OptimizerHyper& h);

// Why the kernels of `kind` cannot step FP8 parameters (core/fp8_recipe.h),
// or nullptr when they can: AdamW's can.
const char* Fp8Refusal(OptimizerKind kind);

// Whether the kernels of `kind` step float64 parameters (the float64
// layout, core/layout.h): AdamW's, SGD's and Lion's do.
bool TakesFloat64(OptimizerKind kind);

// Every optimizer's state slot names, each once, in table order.
std::vector<std::string> AllStateSlotNames();

// The slot of `kind` named `name` among the first `count` slots, or -1.
int StateSlotIndex(OptimizerKind kind, int count, absl::string_view name);

// Checks `h` against its optimizer's rules (torch's own: lr and weight
// decay finite and >= 0 for every optimizer; then each optimizer's row:
// AdamW betas in [0, 1) and eps finite and >= 0, SGD momentum finite and
// >= 0, dampening finite, nesterov needs momentum > 0 and dampening 0,
// Lion betas in [0, 1)). INVALID_ARGUMENT naming `where` and the value
// otherwise.
absl::Status CheckHyperparameters(const OptimizerHyper& h,
                                  const std::string& where);

}  // namespace optimd

#endif  // OPTIMD_CORE_OPTIMIZER_H_
