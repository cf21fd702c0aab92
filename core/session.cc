#include "core/session.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"

namespace optimd {
namespace {

// Largest element count accepted: keeps numel * 4 * 4 far from overflow.
constexpr uint64_t kMaxNumel = uint64_t{1} << 48;
constexpr size_t kMaxDims = 64;

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

// Checkpoint keys are a tensor's name and its name plus one of these
// suffixes (checkpoint/checkpoint.h); "__metadata__" is the safetensors
// header's.
// Every optimizer's slot names are refused alike, so that a name stays
// valid whatever optimizer a later group uses.
const std::vector<std::string>& StateKeySuffixes() {
  static const std::vector<std::string>* suffixes = [] {
    auto* out =
        new std::vector<std::string>{".master", ".remainder", ".moment_scales"};
    for (const std::string& slot : AllStateSlotNames()) {
      out->push_back("." + slot);
    }
    return out;
  }();
  return *suffixes;
}

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

}  // namespace

Session::Session(SessionIdentity identity, Backend* backend,
                 StateBudget* budget, std::unique_ptr<SessionContext> context)
    : identity_(std::move(identity)),
      backend_(backend),
      budget_(budget),
      context_(std::move(context)) {
  MutexLock lock(&mu_);
  PublishInfo();
}

Session::~Session() {
  {
    // First: work an attachment runs (a background save writing a
    // snapshot) ends before the session's state goes.
    MutexLock lock(&attachments_mu_);
    attachments_.clear();
  }
  budget_->Release(state_bytes_);
  // Ranks waiting for this one's statistics stop waiting.
  if (exchange_ != nullptr) exchange_->Leave(identity_.rank);
}

absl::Status Session::JoinDeviceJob(const Backend::DeviceJob& job) {
  OPTIMD_ASSIGN_OR_RETURN(nccl_unique_id_,
                          backend_->JoinJob(context_.get(), job));
  return absl::OkStatus();
}

absl::StatusOr<BufferRef> Session::ResolveRegion(const std::string& tensor,
                                                 const char* which,
                                                 const BufferHandle& handle,
                                                 uint64_t numel, DType dtype) {
  OPTIMD_RETURN_IF_ERROR(
      CheckRegion(tensor, which, handle, numel * DTypeSize(dtype)));
  return backend_->ResolveBuffer(handle, DTypeSize(dtype),
                                 absl::StrCat("tensor '", tensor, "' ", which));
}

absl::StatusOr<BufferRef> Session::ResolveScaleInv(const TensorSpec& t) {
  const Fp8Geometry g = Fp8Geometry::Of(t.fp8_recipe, t.numel, t.shape);
  return backend_->ResolveBuffer(
      t.scale_inv, g.recipe == Fp8Recipe::kMxfp8 ? 1 : 4,
      absl::StrCat("tensor '", t.name, "' scale_inv"));
}

absl::StatusOr<std::vector<Group*>> Session::Targets(
    const std::vector<std::string>& group_ids) {
  if (group_ids.empty()) return step_groups_;
  std::vector<Group*> targets;
  for (const std::string& id : group_ids) {
    Group* g = FindGroup(id);
    if (g == nullptr) {
      return absl::NotFoundError(
          absl::StrCat("group '", id, "' is not registered in this session"));
    }
    targets.push_back(g);
  }
  return targets;
}

Group* Session::FindGroup(const std::string& id) {
  for (auto& g : groups_) {
    if (g->id == id) return g.get();
  }
  return nullptr;
}

const Group* Session::FindGroup(const std::string& id) const {
  for (const auto& g : groups_) {
    if (g->id == id) return g.get();
  }
  return nullptr;
}

namespace {

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

}  // namespace

absl::Status Session::CheckTensor(const GroupSpec& spec, const TensorSpec& t,
                                  NameTable* names, uint64_t* bytes,
                                  uint64_t* param_bytes, Layout* layout) {
  if (t.name.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("group '", spec.id, "': a tensor has an empty name"));
  }
  if (t.name.size() > kMaxNameBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("group '", spec.id, "': a tensor name of ", t.name.size(),
                     " bytes (starting '", t.name.substr(0, 64),
                     "') is longer than ", kMaxNameBytes, " bytes"));
  }
  if (!names->group_names.insert(t.name).second ||
      tensor_names_.count(t.name) > 0) {
    return absl::AlreadyExistsError(absl::StrCat(
        "tensor '", t.name, "' is already registered in this session"));
  }
  OPTIMD_RETURN_IF_ERROR(CheckNameIsNoAlias(spec.id, t.name, *names));
  OPTIMD_RETURN_IF_ERROR(CheckAliases(spec.id, t, names));
  if (!t.param_dtype_set) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor '", t.name, "': param_dtype is unspecified"));
  }
  if (!t.frozen && t.numel > 0 && !t.grad_dtype_set) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor '", t.name, "': grad_dtype is unspecified"));
  }
  if (t.numel > kMaxNumel) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor '", t.name, "': numel ", t.numel,
                     " exceeds the limit ", kMaxNumel));
  }
  OPTIMD_RETURN_IF_ERROR(CheckShape(t));
  OPTIMD_RETURN_IF_ERROR(CheckStage(t));
  // A float64 parameter's gradient is float64 when not given (frozen).
  const DType grad_dtype = t.grad_dtype_set || t.param_dtype != DType::kFloat64
                               ? t.grad_dtype
                               : DType::kFloat64;
  OPTIMD_ASSIGN_OR_RETURN(*layout,
                          ResolveLayout(t.name, t.param_dtype, grad_dtype,
                                        spec.moment_dtype_default
                                            ? DefaultMomentDType(t.param_dtype)
                                            : spec.moment_dtype,
                                        spec.master, t.keep_fp32, spec.hyper));
  OPTIMD_RETURN_IF_ERROR(CheckFp8(t, layout));
  if (t.numel == 0) {
    if (t.param.size != 0 || t.grad.size != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor '", t.name, "' has numel 0 but a non-empty buffer"));
    }
    return absl::OkStatus();
  }
  OPTIMD_RETURN_IF_ERROR(CheckRegion(t.name, "param", t.param,
                                     t.numel * DTypeSize(t.param_dtype)));
  if (!t.frozen && !t.grad_absent) {
    OPTIMD_RETURN_IF_ERROR(
        CheckRegion(t.name, "grad", t.grad, t.numel * DTypeSize(t.grad_dtype)));
  } else if (t.grad_absent && t.grad.kind != BufferHandle::Kind::kNone) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor '", t.name,
                     "': grad_absent with a grad buffer; leave grad unset"));
  }
  // numel <= kMaxNumel keeps each product far from overflow; the sums over
  // up to kMaxTensorsPerSession tensors are checked.
  if (!AddChecked(bytes, t.frozen ? t.numel * layout->MasterBytesPerElement()
                                  : layout->StateBytes(t.numel)) ||
      !AddChecked(param_bytes, t.numel * DTypeSize(t.param_dtype))) {
    return TooLarge(spec.id);
  }
  return absl::OkStatus();
}

absl::Status Session::MapTensors(const GroupSpec& spec,
                                 const std::vector<Layout>& layouts,
                                 Group* group) {
  for (size_t i = 0; i < spec.tensors.size(); ++i) {
    const TensorSpec& t = spec.tensors[i];
    TensorEntry e;
    e.name = t.name;
    e.numel = t.numel;
    e.layout = layouts[i];
    e.keep_fp32 = t.keep_fp32;
    e.frozen = t.frozen;
    e.grad_absent = t.grad_absent && !t.frozen;
    e.shape = t.shape;
    e.stage = t.stage;
    e.aliases = t.aliases;
    if (t.numel > 0) {
      OPTIMD_ASSIGN_OR_RETURN(e.param, ResolveRegion(t.name, "param", t.param,
                                                     t.numel, t.param_dtype));
      if (!t.frozen && !t.grad_absent) {
        OPTIMD_ASSIGN_OR_RETURN(e.grad, ResolveRegion(t.name, "grad", t.grad,
                                                      t.numel, t.grad_dtype));
      }
      if (e.layout.fp8_recipe != Fp8Recipe::kNone) {
        OPTIMD_ASSIGN_OR_RETURN(e.scale_inv, ResolveScaleInv(t));
      }
    }
    group->tensors.push_back(std::move(e));
  }
  return absl::OkStatus();
}

absl::Status Session::MapWholeParams(const GroupSpec& whole,
                                     const std::vector<ShardRange>& ranges,
                                     Group* group) {
  for (size_t i = 0; i < whole.tensors.size(); ++i) {
    const TensorSpec& t = whole.tensors[i];
    TensorEntry& e = group->tensors[i];
    e.sharded = true;
    e.shard_begin = ranges[i].begin;
    e.full_numel = t.numel;
    if (t.numel == 0) continue;
    OPTIMD_ASSIGN_OR_RETURN(
        e.full_param,
        ResolveRegion(t.name, "param", t.param, t.numel, t.param_dtype));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Group>> Session::BuildGroup(
    const GroupSpec& spec, uint64_t* state_bytes) {
  if (spec.id.empty()) {
    return absl::InvalidArgumentError("group_id must not be empty");
  }
  OPTIMD_RETURN_IF_ERROR(
      CheckCounts(spec, groups_.size(), tensor_names_.size()));
  if (FindGroup(spec.id) != nullptr) {
    return absl::AlreadyExistsError(absl::StrCat(
        "group '", spec.id, "' is already registered in this session"));
  }
  OPTIMD_RETURN_IF_ERROR(CheckHyper(spec));
  // ZeRO: the group as this rank keeps it, its part of every tensor.
  std::vector<ShardRange> ranges;
  GroupSpec part;
  if (identity_.shard_state) {
    OPTIMD_ASSIGN_OR_RETURN(
        part,
        ShardGroupSpec(spec, identity_.rank, identity_.world_size, &ranges));
  }
  const GroupSpec& kept = identity_.shard_state ? part : spec;
  auto group = std::make_unique<Group>();
  group->id = spec.id;
  group->hyper = spec.hyper;
  group->moment_dtype = spec.moment_dtype;

  // Pass 1: everything that needs no memory.
  NameTable names;
  names.session_names = &tensor_names_;
  names.session_aliases = &alias_names_;
  uint64_t bytes = 0, param_bytes = 0;
  std::vector<Layout> layouts(kept.tensors.size());
  for (size_t i = 0; i < kept.tensors.size(); ++i) {
    OPTIMD_RETURN_IF_ERROR(CheckTensor(kept, kept.tensors[i], &names, &bytes,
                                       &param_bytes, &layouts[i]));
  }
  if (names.group_aliases.size() >
      kMaxTensorsPerSession - alias_names_.size()) {
    return absl::ResourceExhaustedError(
        absl::StrCat("group '", spec.id, "' has ", names.group_aliases.size(),
                     " aliases; with the ", alias_names_.size(),
                     " registered that is more than ", kMaxTensorsPerSession,
                     " in one session"));
  }
  OPTIMD_RETURN_IF_ERROR(CheckCheckpointKeys(names.group_names, tensor_names_));
  if (!AddChecked(&bytes, state_bytes_) || bytes > kMaxSessionBytes ||
      !AddChecked(&param_bytes, param_bytes_) ||
      param_bytes > kMaxSessionBytes) {
    return TooLarge(spec.id);
  }
  bytes -= state_bytes_;
  param_bytes -= param_bytes_;

  // Pass 2: map buffers (cached per segment or allocation).
  OPTIMD_RETURN_IF_ERROR(MapTensors(kept, layouts, group.get()));
  if (identity_.shard_state) {
    OPTIMD_RETURN_IF_ERROR(MapWholeParams(spec, ranges, group.get()));
  }

  // Pass 3: state memory, within the daemon's budget.
  OPTIMD_RETURN_IF_ERROR(
      budget_->Reserve(bytes, absl::StrCat("group '", spec.id, "'")));
  absl::Status s = AllocateGroupState(backend_, group.get());
  if (s.ok()) {
    group->IndexTensors();
    s = backend_->PrepareGroup(*group);
  }
  if (!s.ok()) {
    budget_->Release(bytes);
    return s;
  }
  *state_bytes = bytes;
  return group;
}

absl::StatusOr<RegisterResult> Session::RegisterGroup(const GroupSpec& spec) {
  MutexLock lock(&mu_);
  uint64_t bytes = 0;
  OPTIMD_ASSIGN_OR_RETURN(std::unique_ptr<Group> group,
                          BuildGroup(spec, &bytes));
  RegisterResult result;
  result.state_bytes = bytes;
  result.plan_items = group->plan.items.size();
  for (const TensorEntry& t : group->tensors) {
    tensor_names_.insert(t.name);
    alias_names_.insert(t.aliases.begin(), t.aliases.end());
    param_bytes_ += t.numel * DTypeSize(t.layout.param_dtype);
  }
  state_bytes_ += bytes;
  groups_.push_back(std::move(group));
  RefreshMappings();
  PublishInfo();
  return result;
}

absl::Status Session::UnregisterGroup(const std::string& id) {
  MutexLock lock(&mu_);
  for (auto it = groups_.begin(); it != groups_.end(); ++it) {
    if ((*it)->id != id) continue;
    const uint64_t bytes = (*it)->StateBytes();
    for (const TensorEntry& t : (*it)->tensors) {
      tensor_names_.erase(t.name);
      for (const std::string& a : t.aliases) alias_names_.erase(a);
      param_bytes_ -= t.numel * DTypeSize(t.layout.param_dtype);
    }
    groups_.erase(it);
    state_bytes_ -= bytes;
    budget_->Release(bytes);
    RefreshMappings();
    PublishInfo();
    return absl::OkStatus();
  }
  return absl::NotFoundError(
      absl::StrCat("group '", id, "' is not registered in this session"));
}

absl::Status Session::UpdateBuffers(const std::string& group_id,
                                    const std::vector<BufferUpdate>& updates) {
  MutexLock lock(&mu_);
  return UpdateBuffersLocked(group_id, updates);
}

absl::Status Session::UpdateBuffersLocked(
    const std::string& group_id, const std::vector<BufferUpdate>& updates) {
  Group* group = FindGroup(group_id);
  if (group == nullptr) {
    return absl::NotFoundError(absl::StrCat(
        "group '", group_id, "' is not registered in this session"));
  }
  // Resolve everything first; apply only when all are valid.
  OPTIMD_ASSIGN_OR_RETURN(std::vector<ResolvedUpdate> resolved,
                          ResolveUpdates(*group, updates));
  std::vector<uint32_t> entries;
  entries.reserve(resolved.size());
  bool new_mapping = false;
  for (ResolvedUpdate& r : resolved) {
    TensorEntry& e = group->tensors[r.tensor];
    if (r.has_param) {
      new_mapping |= RetainIfReplaced(e.param.mapping, r.param.mapping);
      e.param = std::move(r.param);
      if (e.sharded) {
        new_mapping |=
            RetainIfReplaced(e.full_param.mapping, r.full_param.mapping);
        e.full_param = std::move(r.full_param);
      }
    }
    if (r.has_grad) {
      new_mapping |= RetainIfReplaced(e.grad.mapping, r.grad.mapping);
      e.grad = std::move(r.grad);
      e.grad_absent = false;
    } else if (r.absent) {
      e.grad_absent = true;
    }
    const uint32_t k = group->plan.entry_of_tensor[r.tensor];
    if (k != Plan::kNoEntry) entries.push_back(k);
  }
  // Mappings a step checks change only when a buffer moved to another
  // segment or allocation: the steady state of a moving gradient skips it.
  if (new_mapping) RefreshMappings();
  return backend_->UpdatePlanEntries(*group, entries);
}

bool Session::RetainIfReplaced(const std::shared_ptr<const void>& old_mapping,
                               const std::shared_ptr<const void>& mapping) {
  if (old_mapping == mapping) return false;
  if (old_mapping != nullptr &&
      std::find(recent_mappings_.begin(), recent_mappings_.end(),
                old_mapping) == recent_mappings_.end()) {
    recent_mappings_.push_front(old_mapping);
    if (recent_mappings_.size() > kRecentMappings) recent_mappings_.pop_back();
  }
  return true;
}

absl::StatusOr<std::vector<Session::ResolvedUpdate>> Session::ResolveUpdates(
    const Group& group, const std::vector<BufferUpdate>& updates) {
  std::vector<ResolvedUpdate> resolved;
  resolved.reserve(updates.size());
  std::vector<bool> seen(group.tensors.size(), false);
  for (const BufferUpdate& u : updates) {
    const size_t found = group.FindTensor(u.tensor);
    if (found == group.tensors.size()) {
      return absl::NotFoundError(absl::StrCat(
          "tensor '", u.tensor, "' is not in group '", group.id, "'"));
    }
    const uint32_t idx = static_cast<uint32_t>(found);
    if (seen[idx]) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor '", u.tensor, "' is updated twice"));
    }
    seen[idx] = true;
    const TensorEntry& e = group.tensors[idx];
    if (u.grad_absent && u.grad.kind != BufferHandle::Kind::kNone) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor '", u.tensor,
                       "': grad_absent with a grad buffer; send "
                       "one or the other"));
    }
    ResolvedUpdate r;
    r.tensor = idx;
    r.absent = u.grad_absent && e.Steppable();
    if (e.sharded) {
      OPTIMD_RETURN_IF_ERROR(ResolveShardedUpdate(e, u, &r));
      resolved.push_back(std::move(r));
      continue;
    }
    if (u.param.kind != BufferHandle::Kind::kNone && e.numel > 0) {
      if (e.layout.fp8_recipe != Fp8Recipe::kNone) {
        return absl::InvalidArgumentError(absl::StrCat(
            "tensor '", u.tensor,
            "': an FP8 parameter's buffer cannot move (its scale_inv buffer "
            "moves with it); unregister the group and register it again"));
      }
      OPTIMD_ASSIGN_OR_RETURN(r.param,
                              ResolveRegion(e.name, "param", u.param, e.numel,
                                            e.layout.param_dtype));
      r.has_param = true;
    }
    if (u.grad.kind != BufferHandle::Kind::kNone && e.Steppable()) {
      OPTIMD_ASSIGN_OR_RETURN(
          r.grad,
          ResolveRegion(e.name, "grad", u.grad, e.numel, e.layout.grad_dtype));
      r.has_grad = true;
    }
    resolved.push_back(std::move(r));
  }
  return resolved;
}

absl::Status Session::ResolveShardedUpdate(const TensorEntry& e,
                                           const BufferUpdate& u,
                                           ResolvedUpdate* r) {
  const ShardRange part{e.shard_begin, e.numel};
  const uint64_t param_size = DTypeSize(e.layout.param_dtype);
  if (u.param.kind != BufferHandle::Kind::kNone && e.full_numel > 0) {
    OPTIMD_ASSIGN_OR_RETURN(
        r->full_param, ResolveRegion(e.name, "param", u.param, e.full_numel,
                                     e.layout.param_dtype));
    if (e.numel > 0) {
      r->param = r->full_param;
      r->param.data += part.begin * param_size;
      r->param.size = part.count * param_size;
    }
    r->has_param = true;
  }
  if (u.grad.kind != BufferHandle::Kind::kNone && e.Steppable()) {
    const uint64_t grad_size = DTypeSize(e.layout.grad_dtype);
    OPTIMD_RETURN_IF_ERROR(
        CheckRegion(e.name, "grad", u.grad, e.full_numel * grad_size));
    OPTIMD_ASSIGN_OR_RETURN(
        r->grad,
        ResolveRegion(e.name, "grad", SliceHandle(u.grad, part, grad_size),
                      e.numel, e.layout.grad_dtype));
    r->has_grad = true;
  }
  return absl::OkStatus();
}

void Session::RefreshMappings() {
  std::set<const void*> seen;
  mappings_.clear();
  for (const auto& g : groups_) {
    for (const TensorEntry& t : g->tensors) {
      for (const BufferRef* r :
           {&t.param, &t.grad, &t.full_param, &t.scale_inv}) {
        if (r->mapping != nullptr && seen.insert(r->mapping.get()).second) {
          mappings_.push_back(r->mapping);
        }
      }
    }
  }
  step_groups_.clear();
  step_groups_.reserve(groups_.size());
  for (const auto& g : groups_) step_groups_.push_back(g.get());
}

absl::StatusOr<StepResult> Session::Step(const StepRequestSpec& request) {
  MutexLock lock(&mu_);
  StepOptions options = request.options;
  absl::Status bound = BindStepFlags(request, &options);
  bool exchanged = false;
  absl::StatusOr<StepResult> result =
      !bound.ok()             ? bound
      : !request.refused.ok() ? request.refused
                              : StepLocked(request, options, &exchanged);
  if (exchange_ != nullptr && !result.ok() && !exchanged) {
    // The other ranks skip this step rather than wait for this rank.
    exchange_
        ->Reduce(identity_.rank, std::numeric_limits<double>::quiet_NaN(),
                 absl::Now() + rank_timeout_)
        .IgnoreError();
  }
  if (options.step_flags != nullptr) {
    if (!result.ok()) {
      // The trainer's stream waits for this step's done flag: release it
      // whatever went wrong (a failure here leaves only that wait).
      backend_->ReleaseStep(context_.get(), options).IgnoreError();
    }
    if (bound.ok()) last_sequence_ = options.sequence;
  }
  if (result.ok() && !restart_checkpoint_.empty()) {
    unlink(restart_checkpoint_.c_str());
    unlink((restart_checkpoint_ + kSecretSuffix).c_str());
    restart_checkpoint_.clear();
  }
  return result;
}

absl::Status Session::BindStepFlags(const StepRequestSpec& request,
                                    StepOptions* options) {
  if (request.step_flags.kind != BufferHandle::Kind::kNone) {
    if (backend_->kind() != BackendKind::kCuda) {
      return absl::InvalidArgumentError(
          "step_flags order CUDA streams; this session is on the CPU "
          "backend, whose Step replies after the update: leave them unset");
    }
    if (request.sequence != 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "a step that sends step_flags starts the count: its sequence must "
          "be 1, got ",
          request.sequence));
    }
    // Two words (ready, done), or three with a staged step's progress.
    const uint64_t words = request.step_flags.size == 12 ? 3 : 2;
    OPTIMD_ASSIGN_OR_RETURN(
        step_flags_, ResolveRegion("step_flags", "buffer", request.step_flags,
                                   words, DType::kFloat32));
    last_sequence_ = 0;
  }
  const auto no_progress = [] {
    return absl::InvalidArgumentError(
        "a staged step writes its progress into the third word of the step "
        "flags: bind 12-byte step_flags (ready, done, progress) and send a "
        "sequence");
  };
  if (request.sequence == 0) {
    return request.options.staged ? no_progress() : absl::OkStatus();
  }
  if (step_flags_.data == nullptr) {
    return absl::FailedPreconditionError(
        "a step with a sequence needs step flags: send step_flags with the "
        "first one");
  }
  options->step_flags = reinterpret_cast<uint32_t*>(step_flags_.data);
  options->sequence = static_cast<uint32_t>(request.sequence);
  options->step_flag_words = static_cast<uint32_t>(step_flags_.size / 4);
  if (request.options.staged && step_flags_.size < 12) return no_progress();
  if (request.sequence != last_sequence_ + 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "step sequence ", request.sequence, " out of order: the last was ",
        last_sequence_, " (steps are numbered 1, 2, ... in order)"));
  }
  return absl::OkStatus();
}

absl::Status Session::CheckOverrides(
    const std::vector<HyperOverride>& overrides) {
  for (const HyperOverride& o : overrides) {
    Group* g = FindGroup(o.group_id);
    if (g == nullptr) {
      return absl::NotFoundError(
          absl::StrCat("override names group '", o.group_id,
                       "', which is not registered in this session"));
    }
    GroupSpec check;
    check.id = o.group_id;
    check.hyper = WithOverride(g->hyper, o);
    OPTIMD_RETURN_IF_ERROR(CheckHyper(check));
    if (StateSlotCount(check.hyper) != StateSlotCount(g->hyper)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "override of group '", o.group_id, "': momentum ", g->hyper.momentum,
          " -> ", check.hyper.momentum,
          " adds or drops the momentum buffer, which changes the group's "
          "state layout; register the group again instead"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<StepResult> Session::StepLocked(const StepRequestSpec& request,
                                               const StepOptions& o,
                                               bool* exchanged) {
  for (const auto& [group_id, updates] : request.buffer_updates) {
    OPTIMD_RETURN_IF_ERROR(UpdateBuffersLocked(group_id, updates));
  }
  if (needs_load_) {
    return absl::FailedPreconditionError(
        "the last LoadState failed part-way and left the state mixed; load "
        "a good checkpoint before stepping");
  }
  if (!std::isfinite(o.grad_scale) || o.grad_scale < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "grad_scale must be a positive finite number (or 0 for none), got ",
        o.grad_scale));
  }
  if (!std::isfinite(o.max_grad_norm) || o.max_grad_norm < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_grad_norm must be >= 0 (0 disables clipping), got ",
                     o.max_grad_norm));
  }
  OPTIMD_RETURN_IF_ERROR(CheckOverrides(request.overrides));
  OPTIMD_RETURN_IF_ERROR(backend_->CheckMappings(mappings_));
  for (const HyperOverride& o : request.overrides) {
    Group* g = FindGroup(o.group_id);
    g->hyper = WithOverride(g->hyper, o);
  }

  StepOptions with_exchange = o;
  with_exchange.exchange = exchange_.get();
  with_exchange.rank = identity_.rank;
  with_exchange.exchange_deadline = absl::Now() + rank_timeout_;
  with_exchange.exchanged = exchanged;
  with_exchange.gather_params = identity_.shard_state;
  auto stepped = backend_->Step(context_.get(), step_groups_, with_exchange);
  if (!stepped.ok()) {
    // DATA_LOSS: the state was partly updated (a segment shrank mid-step).
    if (stepped.status().code() == absl::StatusCode::kDataLoss) {
      needs_load_ = true;
    }
    return stepped.status();
  }
  const StepOutcome outcome = *stepped;
  StepResult result;
  result.outcome = outcome;
  if (outcome.known) {
    const uint64_t applied =
        outcome.steps_applied - std::min(steps_, outcome.steps_applied);
    const uint64_t skipped =
        outcome.steps_skipped - std::min(skipped_steps_, outcome.steps_skipped);
    backend_->counters().steps.fetch_add(applied, std::memory_order_relaxed);
    backend_->counters().skipped_steps.fetch_add(skipped,
                                                 std::memory_order_relaxed);
    steps_ = std::max(steps_, outcome.steps_applied);
    skipped_steps_ = std::max(skipped_steps_, outcome.steps_skipped);
  }
  {
    // Counters only: no allocation on the step path.
    MutexLock info_lock(&info_mu_);
    info_.steps = steps_;
    info_.skipped_steps = skipped_steps_;
  }
  result.group_steps.reserve(groups_.size());
  for (const auto& g : groups_) result.group_steps.emplace_back(g->id, g->step);
  return result;
}

absl::StatusOr<uint64_t> Session::GetParams(
    const std::vector<std::string>& group_ids) {
  MutexLock lock(&mu_);
  OPTIMD_ASSIGN_OR_RETURN(std::vector<Group*> targets, Targets(group_ids));
  for (Group* g : targets) {
    for (const TensorEntry& t : g->tensors) {
      if (t.numel > 0 && t.layout.master == MasterKind::kRemainder) {
        return absl::FailedPreconditionError(absl::StrCat(
            "tensor '", t.name, "' of group '", g->id,
            "' keeps remainder master weights: its bf16 half lives only in "
            "the trainer, so the daemon cannot restore it; load a checkpoint "
            "(LoadState) instead, or register with fp32 master weights"));
      }
    }
  }
  OPTIMD_RETURN_IF_ERROR(backend_->CheckMappings(mappings_));
  uint64_t written = 0;
  for (Group* g : targets) {
    OPTIMD_RETURN_IF_ERROR(backend_->WriteParams(*g));
    for (const TensorEntry& t : g->tensors) {
      if (t.numel > 0 && t.layout.master == MasterKind::kFp32) ++written;
    }
  }
  return written;
}

void Session::PublishInfo() {
  SessionInfo info;
  info.identity = identity_;
  for (const auto& g : groups_) {
    info.group_ids.push_back(g->id);
    for (const TensorEntry& t : g->tensors) {
      info.param_bytes += t.numel * DTypeSize(t.layout.param_dtype);
    }
  }
  info.state_bytes = state_bytes_;
  info.steps = steps_;
  info.skipped_steps = skipped_steps_;
  MutexLock lock(&info_mu_);
  info.orphaned_since = info_.orphaned_since;  // kept by the registry
  info_ = std::move(info);
}

SessionInfo Session::Info() const {
  MutexLock lock(&info_mu_);
  return info_;
}

std::vector<std::string> Session::GroupIds() const {
  MutexLock lock(&mu_);
  std::vector<std::string> ids;
  for (const auto& g : groups_) ids.push_back(g->id);
  return ids;
}

}  // namespace optimd
