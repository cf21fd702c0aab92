#include "core/layout.h"

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "core/block8.h"

namespace optimd {

absl::string_view MasterKindName(MasterKind k) {
  switch (k) {
    case MasterKind::kNone:
      return "none";
    case MasterKind::kFp32:
      return "fp32";
    case MasterKind::kRemainder:
      return "remainder";
  }
  return "unknown";
}

uint64_t Layout::MasterBytesPerElement() const {
  switch (master) {
    case MasterKind::kNone:
      return 0;
    case MasterKind::kFp32:
      return 4;
    case MasterKind::kRemainder:
      return 2;
  }
  return 0;
}

uint64_t Layout::StateBytesPerElement() const {
  return MasterBytesPerElement() + MomentBytesPerElement() * state_slots;
}

uint64_t Layout::ScaleBytes(uint64_t numel) const {
  return block8() ? Block8Blocks(numel) * 4 * state_slots : 0;
}

std::string Layout::DebugString() const {
  return absl::StrCat(
      "param=", DTypeName(param_dtype), " grad=", DTypeName(grad_dtype),
      " moments=", DTypeName(moment_dtype), " master=", MasterKindName(master),
      " optimizer=", OptimizerName(optimizer), amsgrad() ? " amsgrad" : "",
      fp8_recipe == Fp8Recipe::kNone ? "" : " fp8_recipe=",
      fp8_recipe == Fp8Recipe::kNone ? "" : Fp8RecipeName(fp8_recipe));
}

namespace {

// block8 state only for optimizers whose kernels take it (their traits).
absl::Status CheckBlock8(const std::string& tensor, DType moment_dtype,
                         const OptimizerHyper& hyper) {
  if (moment_dtype != DType::kBlock8) return absl::OkStatus();
  if (const char* refusal = Block8Refusal(hyper)) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor '", tensor, "' (", OptimizerName(hyper.kind),
                     hyper.amsgrad ? ", amsgrad" : "", "): ", refusal,
                     "; use float32 or bfloat16 moments"));
  }
  return absl::OkStatus();
}

// The float64 layout: parameter, gradient and moments all float64, no
// master, an optimizer with a float64 kernel; any other use of float64 is
// refused.
absl::Status CheckFloat64(const std::string& tensor, DType param_dtype,
                          DType grad_dtype, DType moment_dtype,
                          MasterRequest master, const OptimizerHyper& hyper) {
  const bool param64 = param_dtype == DType::kFloat64;
  if (!param64) {
    if (grad_dtype == DType::kFloat64 || moment_dtype == DType::kFloat64) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor '", tensor, "': float64 ",
                       grad_dtype == DType::kFloat64 ? "gradients" : "moments",
                       " need a float64 parameter, and this one is ",
                       DTypeName(param_dtype)));
    }
    return absl::OkStatus();
  }
  if (!TakesFloat64(hyper.kind)) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor '", tensor, "': ", OptimizerName(hyper.kind),
                     " has no float64 kernel; it steps float32, bfloat16 "
                     "and float16 parameters"));
  }
  if (grad_dtype != DType::kFloat64) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor '", tensor,
                     "': a float64 parameter needs a float64 gradient, "
                     "not ",
                     DTypeName(grad_dtype)));
  }
  if (moment_dtype != DType::kFloat64) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor '", tensor,
        "': a float64 parameter keeps float64 moments, as "
        "torch does; leave moment_dtype unspecified or set float64, not ",
        DTypeName(moment_dtype)));
  }
  if (master == MasterRequest::kFp32) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor '", tensor,
        "': a float64 parameter is stepped in float64 in "
        "place and takes no fp32 master weights; leave master_weights "
        "unspecified or set none"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<Layout> ResolveLayout(const std::string& tensor,
                                     DType param_dtype, DType grad_dtype,
                                     DType moment_dtype, MasterRequest master,
                                     bool keep_fp32,
                                     const OptimizerHyper& hyper) {
  Layout layout;
  layout.param_dtype = param_dtype;
  layout.grad_dtype = grad_dtype;
  layout.optimizer = hyper.kind;
  layout.state_slots = static_cast<uint8_t>(StateSlotCount(hyper));
  OPTIMD_RETURN_IF_ERROR(CheckFloat64(tensor, param_dtype, grad_dtype,
                                      moment_dtype, master, hyper));
  if (moment_dtype != DType::kFloat32 && moment_dtype != DType::kBFloat16 &&
      moment_dtype != DType::kBlock8 && moment_dtype != DType::kFloat64) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor '", tensor,
                     "': moments can be float32, bfloat16, "
                     "block8 or float64 (for float64 parameters), not ",
                     DTypeName(moment_dtype)));
  }
  OPTIMD_RETURN_IF_ERROR(CheckBlock8(tensor, moment_dtype, hyper));
  layout.moment_dtype = moment_dtype;
  if (keep_fp32) {
    if (param_dtype != DType::kFloat32) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor '", tensor, "' is marked keep_fp32 but its parameter is ",
          DTypeName(param_dtype), "; keep_fp32 is for fp32 parameters"));
    }
    // Updated in fp32, in place, whatever the group asks for; a remainder is
    // meaningless for it.
    if (master == MasterRequest::kRemainder) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor '", tensor,
                       "': keep_fp32 tensors cannot use remainder "
                       "master weights (they have no bf16 half)"));
    }
    layout.master =
        master == MasterRequest::kFp32 ? MasterKind::kFp32 : MasterKind::kNone;
    return layout;
  }
  switch (master) {
    case MasterRequest::kDefault:
      layout.master =
          param_dtype == DType::kFloat32 || param_dtype == DType::kFloat64
              ? MasterKind::kNone
              : MasterKind::kFp32;
      break;
    case MasterRequest::kNone:
      if (param_dtype != DType::kFloat32 && param_dtype != DType::kFloat64) {
        // Remainders are for bfloat16 parameters only (kRemainder below).
        return absl::InvalidArgumentError(absl::StrCat(
            "tensor '", tensor, "': a ", DTypeName(param_dtype),
            " parameter needs ",
            param_dtype == DType::kBFloat16
                ? "master weights (fp32 or remainder)"
                : "fp32 master weights",
            "; master_weights=none is only for float32 and float64 "
            "parameters"));
      }
      layout.master = MasterKind::kNone;
      break;
    case MasterRequest::kFp32:
      layout.master = MasterKind::kFp32;
      break;
    case MasterRequest::kRemainder:
      if (param_dtype != DType::kBFloat16) {
        return absl::InvalidArgumentError(
            absl::StrCat("tensor '", tensor,
                         "': remainder master weights need a bfloat16 "
                         "parameter, not ",
                         DTypeName(param_dtype)));
      }
      layout.master = MasterKind::kRemainder;
      break;
  }
  return layout;
}

absl::Status ResolveFp8Recipe(const std::string& tensor, Fp8Recipe recipe,
                              Layout* layout) {
  const auto refuse = [&](absl::string_view why) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor '", tensor, "': ", why));
  };
  if (IsFp8(layout->grad_dtype)) {
    return refuse(absl::StrCat("a ", DTypeName(layout->grad_dtype),
                               " gradient; gradients are float32, bfloat16 "
                               "or float16"));
  }
  if (!IsFp8(layout->param_dtype)) {
    if (recipe == Fp8Recipe::kNone) return absl::OkStatus();
    return refuse(absl::StrCat("an fp8_recipe (", Fp8RecipeName(recipe),
                               ") is for float8_e4m3fn or float8_e5m2 "
                               "parameters, not ",
                               DTypeName(layout->param_dtype)));
  }
  if (recipe == Fp8Recipe::kNone) {
    return refuse(
        absl::StrCat("a ", DTypeName(layout->param_dtype),
                     " parameter needs an fp8_recipe (tensor, block_1x128, "
                     "block_128x128 or mxfp8) and its scale_inv buffer"));
  }
  if (const char* why = Fp8Refusal(layout->optimizer)) {
    return refuse(
        absl::StrCat(why, ", not ", OptimizerName(layout->optimizer)));
  }
  if (layout->master != MasterKind::kFp32) {
    return refuse("FP8 parameters need fp32 master weights");
  }
  if (layout->moment_dtype != DType::kFloat32 &&
      layout->moment_dtype != DType::kBFloat16) {
    return refuse(
        absl::StrCat("FP8 parameters take float32 or bfloat16 moments, not ",
                     DTypeName(layout->moment_dtype)));
  }
  layout->fp8_recipe = recipe;
  return absl::OkStatus();
}

}  // namespace optimd
