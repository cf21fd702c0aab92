// How the daemon stores one tensor's optimizer state (its Layout), and the
// rules that decide which layouts are valid. Layout decides bytes per
// parameter, so it is resolved once at registration.
#ifndef OPTIMD_CORE_LAYOUT_H_
#define OPTIMD_CORE_LAYOUT_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "core/dtype.h"
#include "core/fp8_recipe.h"
#include "core/optimizer.h"

namespace optimd {

// Where a tensor's fp32 master weights live.
enum class MasterKind : uint8_t {
  // None: the parameter is fp32 and updated in place.
  kNone = 0,
  // A daemon-side fp32 copy.
  kFp32 = 1,
  // An int16 remainder beside a bf16 parameter: the fp32 master's bits are
  // (bf16 bits, minus one if the remainder is negative) << 16 | remainder.
  kRemainder = 2,
};

absl::string_view MasterKindName(MasterKind k);

// The group-level request, before per-tensor resolution.
enum class MasterRequest : uint8_t { kDefault, kNone, kFp32, kRemainder };

struct Layout {
  DType param_dtype = DType::kFloat32;
  DType grad_dtype = DType::kFloat32;
  DType moment_dtype = DType::kFloat32;
  MasterKind master = MasterKind::kNone;
  // The group's optimizer and the number of its state slots this tensor
  // holds (StateSlotCount), each of moment_dtype.
  OptimizerKind optimizer = OptimizerKind::kAdamW;
  uint8_t state_slots = 2;
  // FP8 parameters (param_dtype kFloat8*): the scaling recipe by which the
  // step requantizes the fp32 master into the parameter and its scale
  // inverses (core/fp8_recipe.h); kNone for every other parameter.
  Fp8Recipe fp8_recipe = Fp8Recipe::kNone;

  // AdamW with a third slot: the running maximum of the second moment.
  bool amsgrad() const {
    return optimizer == OptimizerKind::kAdamW && state_slots == 3;
  }

  // Bytes of daemon-held state per element: master + state slots (for
  // kBlock8 moments their codes; the scales come on top, ScaleBytes).
  uint64_t StateBytesPerElement() const;
  // Bytes per element of each state buffer (0 when absent).
  uint64_t MasterBytesPerElement() const;
  uint64_t MomentBytesPerElement() const { return DTypeSize(moment_dtype); }

  // kBlock8 moments: each state slot's scales, one fp32 per block
  // (core/block8.h). Stored per tensor as [blocks][state_slots].
  bool block8() const { return moment_dtype == DType::kBlock8; }
  uint64_t ScaleBytes(uint64_t numel) const;
  // All daemon-held state of a tensor of `numel` elements.
  uint64_t StateBytes(uint64_t numel) const {
    return numel * StateBytesPerElement() + ScaleBytes(numel);
  }

  bool operator==(const Layout& o) const {
    return param_dtype == o.param_dtype && grad_dtype == o.grad_dtype &&
           moment_dtype == o.moment_dtype && master == o.master &&
           optimizer == o.optimizer && state_slots == o.state_slots &&
           fp8_recipe == o.fp8_recipe;
  }
  std::string DebugString() const;
};

// The moments of a tensor whose group leaves their dtype unspecified:
// float64 for a float64 parameter (torch keeps moments in the parameter's
// dtype), else float32.
inline DType DefaultMomentDType(DType param_dtype) {
  return param_dtype == DType::kFloat64 ? DType::kFloat64 : DType::kFloat32;
}

// Resolves and checks one tensor's layout. `tensor` names it in errors.
//  - keep_fp32 needs an fp32 parameter and always means no master copy.
//  - kRemainder needs a bf16 parameter.
//  - kNone needs an fp32 or float64 parameter.
//  - moments are fp32, bf16, or kBlock8 for AdamW without amsgrad
//    (refused for other optimizers and amsgrad).
//  - float64 goes all the way or not at all: a float64 parameter has a
//    float64 gradient, float64 moments and no master, and its optimizer
//    has a float64 kernel (TakesFloat64: AdamW, SGD and Lion do); float64
//    gradients or moments need a float64 parameter.
// The optimizer and its state slots come from `hyper`.
// FP8 parameters (IsFp8) are resolved with their recipe afterwards
// (ResolveFp8Recipe).
absl::StatusOr<Layout> ResolveLayout(const std::string& tensor,
                                     DType param_dtype, DType grad_dtype,
                                     DType moment_dtype, MasterRequest master,
                                     bool keep_fp32,
                                     const OptimizerHyper& hyper);

// Sets `layout`'s FP8 recipe and checks it: an FP8 parameter needs a
// recipe and AdamW with an fp32 master and float32 or bfloat16 moments;
// a recipe needs an FP8 parameter; gradients are never FP8.
absl::Status ResolveFp8Recipe(const std::string& tensor, Fp8Recipe recipe,
                              Layout* layout);

// Whether state slot `slot` of a kBlock8 layout holds signed codes:
// exp_avg does, exp_avg_sq (never negative) does not. AdamW is the only
// optimizer with kBlock8 state (ResolveLayout).
inline bool Block8SlotIsSigned(int slot) { return slot == 0; }

// The remainder encoding of a bf16 parameter's fp32 master (kRemainder):
// used by the kernels, state reads and writes, and checkpoints.
// Both branch-free so that loops over them vectorize.
inline float ReconstructFromRemainder(uint16_t bf16_bits, int16_t remainder) {
  const uint32_t hi =
      (static_cast<uint32_t>(bf16_bits) - (remainder < 0 ? 1u : 0u)) & 0xffffu;
  return BitsToFloat((hi << 16) | static_cast<uint16_t>(remainder));
}

inline void SplitToRemainder(float master, uint16_t* bf16_bits,
                             int16_t* remainder) {
  const uint32_t u = FloatBits(master);
  const int16_t r = static_cast<int16_t>(static_cast<uint16_t>(u & 0xffffu));
  const uint32_t hi = ((u >> 16) + (r < 0 ? 1u : 0u)) & 0xffffu;
  *bf16_bits = static_cast<uint16_t>(hi);
  *remainder = r;
}

}  // namespace optimd

#endif  // OPTIMD_CORE_LAYOUT_H_
