#include "core/session_checks.h"

#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"

namespace optimd {

// A shape, when given, has at most kMaxDims dimensions whose product is
// the tensor's numel.
absl::Status CheckShape(const TensorSpec& t) {
  if (t.shape.empty()) return absl::OkStatus();
  uint64_t product = 1;
  bool overflow = t.shape.size() > kMaxDims;
  for (uint64_t d : t.shape) {
    overflow = overflow || __builtin_mul_overflow(product, d, &product);
  }
  if (overflow || product != t.numel) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor '", t.name, "': shape [", absl::StrJoin(t.shape, ", "),
        "] does not hold numel ", t.numel, " elements (at most ", kMaxDims,
        " dimensions whose product is numel)"));
  }
  return absl::OkStatus();
}

// A shard's place in its whole tensor, when given: one whole-shape and one
// offset entry per dimension of the shard's shape ([numel] when it has
// none), the shard inside the whole in every dimension, the whole's
// element count within 64 bits.
absl::Status CheckShardPlace(const TensorSpec& t) {
  if (t.global_shape.empty() && t.global_offset.empty()) {
    return absl::OkStatus();
  }
  const std::vector<uint64_t> shape =
      t.shape.empty() ? std::vector<uint64_t>{t.numel} : t.shape;
  bool bad = t.global_shape.size() != shape.size() ||
             t.global_offset.size() != shape.size();
  uint64_t whole = 1;
  for (size_t d = 0; !bad && d < shape.size(); ++d) {
    uint64_t end = 0;
    bad = __builtin_add_overflow(t.global_offset[d], shape[d], &end) ||
          end > t.global_shape[d] ||
          __builtin_mul_overflow(whole, t.global_shape[d], &whole);
  }
  if (!bad) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "tensor '", t.name, "': global_shape [",
      absl::StrJoin(t.global_shape, ", "), "] and global_offset [",
      absl::StrJoin(t.global_offset, ", "), "] do not place a shard of shape [",
      absl::StrJoin(shape, ", "),
      "] (give both, one entry per dimension of the shard's shape, with "
      "offset + shape at most the whole shape in each)"));
}

// A staged step's stage numbers are small: a step launches at least one
// kernel per stage.
absl::Status CheckStage(const TensorSpec& t) {
  if (t.stage <= kMaxStage) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "tensor '", t.name, "': stage ", t.stage, " is above ", kMaxStage,
      " (stages number the update order of a staged step; use a few dozen)"));
}

// `h` with the values `o` sets.
OptimizerHyper WithOverride(OptimizerHyper h, const HyperOverride& o) {
  if (!o.keep_lr) h.lr = o.lr;
  if (o.beta1) h.beta1 = *o.beta1;
  if (o.beta2) h.beta2 = *o.beta2;
  if (o.eps) h.eps = *o.eps;
  if (o.weight_decay) h.weight_decay = *o.weight_decay;
  if (o.momentum) h.momentum = *o.momentum;
  return h;
}

absl::Status CheckHyper(const GroupSpec& spec) {
  return CheckHyperparameters(spec.hyper,
                              absl::StrCat("group '", spec.id, "'"));
}

// Bounds on a group's id and on how many groups and tensors a session
// holds, so that replies listing them stay far below gRPC's limits.
absl::Status CheckCounts(const GroupSpec& spec, size_t groups, size_t tensors) {
  if (spec.id.size() > kMaxNameBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "group_id is ", spec.id.size(), " bytes (starting '",
        spec.id.substr(0, 64), "'); at most ", kMaxNameBytes, " are allowed"));
  }
  if (groups >= kMaxGroupsPerSession) {
    return absl::ResourceExhaustedError(
        absl::StrCat("the session already has ", groups, " groups, the limit"));
  }
  if (spec.tensors.size() > kMaxTensorsPerSession - tensors) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "group '", spec.id, "' has ", spec.tensors.size(),
        " tensors; with the ", tensors, " registered that is more than ",
        kMaxTensorsPerSession, " in one session"));
  }
  return absl::OkStatus();
}

absl::Status TooLarge(const std::string& group) {
  return absl::ResourceExhaustedError(absl::StrCat(
      "group '", group, "' would bring the session's optimizer state or ",
      "parameters past ", kMaxSessionBytes, " bytes, more than any machine ",
      "holds; check the tensors' element counts"));
}

absl::Status CheckHandleKind(BackendKind backend, const std::string& tensor,
                             const char* which, const BufferHandle& h) {
  if (h.kind == BufferHandle::Kind::kNone) return absl::OkStatus();
  const bool shared_memory = h.kind == BufferHandle::Kind::kSharedMemory;
  if (backend == BackendKind::kCpu && !shared_memory) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor '", tensor, "': the CPU backend needs a shared_memory ", which,
        " buffer handle, not a CUDA one (cuda_ipc or cuda_vmm)"));
  }
  if (backend == BackendKind::kCuda && shared_memory) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor '", tensor, "': the CUDA backend needs a cuda_ipc or ",
        "cuda_vmm ", which, " buffer handle, not a shared-memory one"));
  }
  return absl::OkStatus();
}

absl::Status CheckRegion(const std::string& tensor, const char* which,
                         const BufferHandle& h, uint64_t want_bytes) {
  if (h.kind == BufferHandle::Kind::kNone) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor '", tensor, "': missing ", which, " buffer"));
  }
  if (h.size != want_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor '", tensor, "': ", which, " buffer is ", h.size,
                     " bytes but ", want_bytes, " are needed (",
                     std::string(which) == "scale_inv"
                         ? "one scale inverse per scaling unit of the recipe"
                         : "numel x element size",
                     ")"));
  }
  return absl::OkStatus();
}

// Resolves `t`'s FP8 recipe into `layout` and checks its scale_inv
// buffer: the recipe's exact size for an FP8 parameter with elements,
// none for any other tensor.
absl::Status CheckFp8(const TensorSpec& t, Layout* layout) {
  OPTIMD_RETURN_IF_ERROR(ResolveFp8Recipe(t.name, t.fp8_recipe, layout));
  if (layout->fp8_recipe == Fp8Recipe::kNone || t.numel == 0) {
    if (t.scale_inv.kind == BufferHandle::Kind::kNone) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor '", t.name, "': a scale_inv buffer is for FP8 parameters ",
        "with elements only; leave it unset"));
  }
  return CheckRegion(
      t.name, "scale_inv", t.scale_inv,
      Fp8Geometry::Of(t.fp8_recipe, t.numel, t.shape).ScaleBytes());
}

// Lays out each kind of state of `group`'s tensors contiguously (64-byte
// aligned slices) and allocates one arena per kind from `backend`: kind 0
// the masters, kind 1 + s the optimizer's state slot s, the last kind the
// block8 moments' scales.
absl::Status AllocateGroupState(Backend* backend, Group* group) {
  constexpr uint64_t kSliceAlign = 64;
  constexpr int kKinds = 2 + kMaxStateSlots;
  constexpr int kScales = kKinds - 1;
  auto round_up = [](uint64_t n) {
    return (n + kSliceAlign - 1) / kSliceAlign * kSliceAlign;
  };
  uint64_t arena_bytes[kKinds] = {};
  std::vector<std::array<uint64_t, kKinds>> offsets(group->tensors.size());
  auto bytes_of = [](const TensorEntry& e, int kind) -> uint64_t {
    if (kind == 0) return e.numel * e.layout.MasterBytesPerElement();
    if (e.frozen) return 0;
    if (kind == kScales) return e.layout.ScaleBytes(e.numel);
    if (kind - 1 >= e.layout.state_slots) return 0;
    return e.numel * e.layout.MomentBytesPerElement();
  };
  for (size_t i = 0; i < group->tensors.size(); ++i) {
    for (int k = 0; k < kKinds; ++k) {
      offsets[i][k] = arena_bytes[k];
      // Bounded by the checked total plus 64 bytes per tensor.
      arena_bytes[k] += round_up(bytes_of(group->tensors[i], k));
    }
  }
  for (int k = 0; k < kKinds; ++k) {
    OPTIMD_ASSIGN_OR_RETURN(StateStorage arena,
                            backend->AllocateState(arena_bytes[k]));
    group->arenas.push_back(std::move(arena));
  }
  for (size_t i = 0; i < group->tensors.size(); ++i) {
    TensorEntry& e = group->tensors[i];
    for (int k = 0; k < kKinds; ++k) {
      const uint64_t bytes = bytes_of(e, k);
      if (bytes == 0) continue;
      StateSlice& slice = k == 0         ? e.master
                          : k == kScales ? e.scales
                                         : e.state[k - 1];
      slice = StateSlice(group->arenas[k].data() + offsets[i][k], bytes);
    }
  }
  return absl::OkStatus();
}

}  // namespace optimd
