#include "core/optimizer.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace optimd {
namespace {

// Reports a hyperparameter that fails its rule, naming `where`.
absl::Status Bad(const std::string& where, absl::string_view what, double v) {
  return absl::InvalidArgumentError(
      absl::StrCat(where, ": invalid ", what, ": ", v));
}

// The kernels take the hyperparameters as fp32: each must be finite there
// too (an lr of 1e308 would become inf and every parameter NaN).
bool Fp32Finite(double v) {
  return std::isfinite(v) && std::isfinite(static_cast<float>(v));
}

// beta1 and beta2 in [0, 1) (AdamW's moments, Lion's interpolations).
absl::Status CheckBetas(const OptimizerHyper& h, const std::string& where) {
  if (!(h.beta1 >= 0 && h.beta1 < 1)) {
    return Bad(where, "beta1 (need 0 <= beta1 < 1)", h.beta1);
  }
  if (!(h.beta2 >= 0 && h.beta2 < 1)) {
    return Bad(where, "beta2 (need 0 <= beta2 < 1)", h.beta2);
  }
  return absl::OkStatus();
}

// Each optimizer's own rules, after the ones every optimizer shares (lr
// and weight_decay): torch's argument checks.
absl::Status CheckAdamW(const OptimizerHyper& h, const std::string& where) {
  OPTIMD_RETURN_IF_ERROR(CheckBetas(h, where));
  if (!Fp32Finite(h.eps) || h.eps < 0) return Bad(where, "eps", h.eps);
  return absl::OkStatus();
}

absl::Status CheckSgd(const OptimizerHyper& h, const std::string& where) {
  if (!Fp32Finite(h.momentum) || h.momentum < 0) {
    return Bad(where, "momentum", h.momentum);
  }
  if (!Fp32Finite(h.dampening)) return Bad(where, "dampening", h.dampening);
  if (h.nesterov && (h.momentum <= 0 || h.dampening != 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ": nesterov momentum requires a momentum and zero dampening"));
  }
  return absl::OkStatus();
}

absl::Status CheckLion(const OptimizerHyper& h, const std::string& where) {
  return CheckBetas(h, where);
}

// Each optimizer's traits; a new optimizer adds one row (and its kernels,
// kernels/<optimizer>/).
struct Traits {
  OptimizerKind kind;
  const char* name;
  // Its state slots, in slot order ("" past the last).
  const char* slots[kMaxStateSlots];
  // How many of them a tensor of a group with `h` holds.
  int (*slot_count)(const OptimizerHyper& h);
  // Why its kernels cannot take block8 moments for `h`; nullptr if they can.
  const char* (*block8_refusal)(const OptimizerHyper& h);
  // Whether its kernels step the float64 layout.
  bool takes_float64;
  // Why its kernels cannot step FP8 parameters (core/fp8_recipe.h);
  // nullptr if they can.
  const char* fp8_refusal;
  // Its own hyperparameter rules (CheckHyperparameters).
  absl::Status (*check)(const OptimizerHyper& h, const std::string& where);
};

constexpr const char* kNoBlock8Kernel =
    "block8 moments are for AdamW/Adam only";
constexpr const char* kNoFp8Kernel = "FP8 parameters are stepped by AdamW only";

constexpr Traits kOptimizers[] = {
    {OptimizerKind::kAdamW,
     "adamw",
     {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"},
     [](const OptimizerHyper& h) { return h.amsgrad ? 3 : 2; },
     [](const OptimizerHyper& h) -> const char* {
       return h.amsgrad ? "block8 moments do not support amsgrad (its "
                          "running maximum has no 8-bit form)"
                        : nullptr;
     },
     true,
     nullptr,
     CheckAdamW},
    {OptimizerKind::kSgd,
     "sgd",
     {"momentum_buffer", "", ""},
     [](const OptimizerHyper& h) { return h.momentum != 0 ? 1 : 0; },
     [](const OptimizerHyper&) { return kNoBlock8Kernel; },
     true,
     kNoFp8Kernel,
     CheckSgd},
    {OptimizerKind::kLion,
     "lion",
     {"exp_avg", "", ""},
     [](const OptimizerHyper&) { return 1; },
     [](const OptimizerHyper&) { return kNoBlock8Kernel; },
     true,
     kNoFp8Kernel,
     CheckLion},
};

const Traits* TraitsOf(OptimizerKind kind) {
  for (const Traits& t : kOptimizers) {
    if (t.kind == kind) return &t;
  }
  return nullptr;
}

}  // namespace

absl::string_view OptimizerName(OptimizerKind kind) {
  const Traits* t = TraitsOf(kind);
  return t != nullptr ? t->name : "unknown";
}

absl::StatusOr<OptimizerKind> OptimizerFromName(absl::string_view name) {
  for (const Traits& t : kOptimizers) {
    if (name == t.name) return t.kind;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown optimizer '", name, "' (known: ", KnownOptimizerNames(), ")"));
}

std::optional<OptimizerKind> OptimizerFromNumber(int number) {
  for (const Traits& t : kOptimizers) {
    if (number == static_cast<int>(t.kind)) return t.kind;
  }
  return std::nullopt;
}

std::string KnownOptimizerNames() {
  std::string known;
  for (const Traits& t : kOptimizers) {
    absl::StrAppend(&known, known.empty() ? "" : ", ", t.name);
  }
  return known;
}

const char* Block8Refusal(const OptimizerHyper& h) {
  const Traits* t = TraitsOf(h.kind);
  return t != nullptr ? t->block8_refusal(h) : kNoBlock8Kernel;
}

const char* Fp8Refusal(OptimizerKind kind) {
  const Traits* t = TraitsOf(kind);
  return t != nullptr ? t->fp8_refusal : kNoFp8Kernel;
}

bool TakesFloat64(OptimizerKind kind) {
  const Traits* t = TraitsOf(kind);
  return t != nullptr && t->takes_float64;
}

int StateSlotCount(const OptimizerHyper& h) {
  const Traits* t = TraitsOf(h.kind);
  return t != nullptr ? t->slot_count(h) : 0;
}

absl::string_view StateSlotName(OptimizerKind kind, int slot) {
  const Traits* t = TraitsOf(kind);
  if (t == nullptr || slot < 0 || slot >= kMaxStateSlots) return "";
  return t->slots[slot];
}

std::vector<std::string> AllStateSlotNames() {
  std::vector<std::string> out;
  for (const Traits& t : kOptimizers) {
    for (const char* slot : t.slots) {
      if (*slot != '\0' &&
          std::find(out.begin(), out.end(), slot) == out.end()) {
        out.push_back(slot);
      }
    }
  }
  return out;
}

int StateSlotIndex(OptimizerKind kind, int count, absl::string_view name) {
  for (int s = 0; s < count && !name.empty(); ++s) {
    if (StateSlotName(kind, s) == name) return s;
  }
  return -1;
}

absl::Status CheckHyperparameters(const OptimizerHyper& h,
                                  const std::string& where) {
  const Traits* t = TraitsOf(h.kind);
  if (t == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": unknown optimizer ", static_cast<int>(h.kind)));
  }
  // A schedule may take the learning rate below zero (a lambda past its
  // end); torch's step takes it (ascending), so does the daemon's, and a
  // group registered anew after that carries it. torch's constructor
  // refuses a negative lr: the Python client does as it does.
  if (!Fp32Finite(h.lr)) return Bad(where, "learning rate", h.lr);
  if (!Fp32Finite(h.weight_decay) || h.weight_decay < 0) {
    return Bad(where, "weight_decay", h.weight_decay);
  }
  return t->check(h, where);
}

}  // namespace optimd
