#include "core/session_checks.h"

#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>

#include "absl/strings/match.h"
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

namespace {

// Checkpoint keys are a tensor's name and its name plus one of these
// suffixes (checkpoint/checkpoint.h); "__metadata__" is the safetensors
// header's.
// Every optimizer's slot names are refused alike, so that a name stays
// valid whatever optimizer a later group uses.
const std::vector<std::string>& StateKeySuffixes() {
  static const std::vector<std::string>* suffixes = [] {
    auto* out = new std::vector<std::string>{".master", ".remainder",
                                             ".moment_scales", ".scale_inv"};
    for (const std::string& slot : AllStateSlotNames()) {
      out->push_back("." + slot);
    }
    return out;
  }();
  return *suffixes;
}

}  // namespace

// Refuses names whose checkpoint keys would collide with another tensor's
// (`w` and `w.exp_avg`: one's moment would load as the other's parameter).
absl::Status CheckCheckpointKeys(const std::set<std::string>& fresh,
                                 const std::set<std::string>& registered) {
  auto collision = [](const std::string& base, const std::string& suffix) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor names '", base, "' and '", base, suffix,
                     "' collide in checkpoints, where the state of '", base,
                     "' is saved as '", base, suffix, "'; rename one of them"));
  };
  if (fresh.count("__metadata__") > 0) {
    return absl::InvalidArgumentError(
        "the tensor name '__metadata__' is reserved by the checkpoint "
        "format (safetensors); rename the tensor");
  }
  // A new name that ends in a suffix, whose stem is any tensor's name
  // (suffix checks are cheap; lookups only for the rare suffixed names).
  for (const std::string& n : fresh) {
    for (const std::string& suffix : StateKeySuffixes()) {
      if (!absl::EndsWith(n, suffix)) continue;
      const std::string stem = n.substr(0, n.size() - suffix.size());
      if (fresh.count(stem) > 0 || registered.count(stem) > 0) {
        return collision(stem, suffix);
      }
    }
  }
  // A registered name that is a new name plus a suffix.
  if (registered.empty()) return absl::OkStatus();
  for (const std::string& n : fresh) {
    for (const std::string& suffix : StateKeySuffixes()) {
      if (registered.count(n + suffix) > 0) return collision(n, suffix);
    }
  }
  return absl::OkStatus();
}

absl::Status TooLarge(const std::string& group) {
  return absl::ResourceExhaustedError(absl::StrCat(
      "group '", group, "' would bring the session's optimizer state or ",
      "parameters past ", kMaxSessionBytes, " bytes, more than any machine ",
      "holds; check the tensors' element counts"));
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
