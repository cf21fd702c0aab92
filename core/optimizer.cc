#include "core/optimizer.h"

#include <cmath>

#include "absl/strings/str_cat.h"

namespace optimd {
namespace {

// Slot names by optimizer, in slot order.
constexpr absl::string_view kAdamWSlots[] = {"exp_avg", "exp_avg_sq",
                                             "max_exp_avg_sq"};
constexpr absl::string_view kSgdSlots[] = {"momentum_buffer"};
constexpr absl::string_view kLionSlots[] = {"exp_avg"};

}  // namespace

absl::string_view OptimizerName(OptimizerKind kind) {
  switch (kind) {
    case OptimizerKind::kAdamW:
      return "adamw";
    case OptimizerKind::kSgd:
      return "sgd";
    case OptimizerKind::kLion:
      return "lion";
  }
  return "unknown";
}

absl::StatusOr<OptimizerKind> OptimizerFromName(absl::string_view name) {
  for (OptimizerKind k :
       {OptimizerKind::kAdamW, OptimizerKind::kSgd, OptimizerKind::kLion}) {
    if (name == OptimizerName(k)) return k;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown optimizer '", name, "' (known: adamw, sgd, lion)"));
}

int StateSlotCount(const OptimizerHyper& h) {
  switch (h.kind) {
    case OptimizerKind::kAdamW:
      return h.amsgrad ? 3 : 2;
    case OptimizerKind::kSgd:
      return h.momentum != 0 ? 1 : 0;
    case OptimizerKind::kLion:
      return 1;
  }
  return 0;
}

absl::string_view StateSlotName(OptimizerKind kind, int slot) {
  switch (kind) {
    case OptimizerKind::kAdamW:
      return slot >= 0 && slot < 3 ? kAdamWSlots[slot] : "";
    case OptimizerKind::kSgd:
      return slot == 0 ? kSgdSlots[0] : "";
    case OptimizerKind::kLion:
      return slot == 0 ? kLionSlots[0] : "";
  }
  return "";
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
