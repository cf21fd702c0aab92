#include "core/optimizer.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"

namespace optimd {
namespace {

// Each optimizer's traits; a new optimizer adds one row (and its kernels).
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
};

constexpr const char* kNoBlock8Kernel =
    "block8 moments are for AdamW/Adam only";

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
     true},
    {OptimizerKind::kSgd,
     "sgd",
     {"momentum_buffer", "", ""},
     [](const OptimizerHyper& h) { return h.momentum != 0 ? 1 : 0; },
     [](const OptimizerHyper&) { return kNoBlock8Kernel; },
     true},
    {OptimizerKind::kLion,
     "lion",
     {"exp_avg", "", ""},
     [](const OptimizerHyper&) { return 1; },
     [](const OptimizerHyper&) { return kNoBlock8Kernel; },
     true},
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
  std::string known;
  for (const Traits& t : kOptimizers) {
    if (name == t.name) return t.kind;
    absl::StrAppend(&known, known.empty() ? "" : ", ", t.name);
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown optimizer '", name, "' (known: ", known, ")"));
}

const char* Block8Refusal(const OptimizerHyper& h) {
  const Traits* t = TraitsOf(h.kind);
  return t != nullptr ? t->block8_refusal(h) : kNoBlock8Kernel;
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
  auto bad = [&](absl::string_view what, double v) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": invalid ", what, ": ", v));
  };
  // The kernels take the hyperparameters as fp32: each must be finite there
  // too (an lr of 1e308 would become inf and every parameter NaN).
  auto fp32_finite = [](double v) {
    return std::isfinite(v) && std::isfinite(static_cast<float>(v));
  };
  if (!fp32_finite(h.lr) || h.lr < 0) return bad("learning rate", h.lr);
  if (!fp32_finite(h.weight_decay) || h.weight_decay < 0) {
    return bad("weight_decay", h.weight_decay);
  }
  if (h.kind == OptimizerKind::kSgd) {
    if (!fp32_finite(h.momentum) || h.momentum < 0) {
      return bad("momentum", h.momentum);
    }
    if (!fp32_finite(h.dampening)) return bad("dampening", h.dampening);
    if (h.nesterov && (h.momentum <= 0 || h.dampening != 0)) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": nesterov momentum requires a momentum and zero dampening"));
    }
    return absl::OkStatus();
  }
  if (!(h.beta1 >= 0 && h.beta1 < 1)) {
    return bad("beta1 (need 0 <= beta1 < 1)", h.beta1);
  }
  if (!(h.beta2 >= 0 && h.beta2 < 1)) {
    return bad("beta2 (need 0 <= beta2 < 1)", h.beta2);
  }
  if (h.kind == OptimizerKind::kAdamW && (!fp32_finite(h.eps) || h.eps < 0)) {
    return bad("eps", h.eps);
  }
  return absl::OkStatus();
}

}  // namespace optimd
