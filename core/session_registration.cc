// Session: registering and unregistering parameter groups (the checks
// of each tensor, the mapping of its buffers, the group's plan and state).
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "core/metadata_bytes.h"
#include "core/session.h"
#include "core/session_checks.h"

namespace optimd {

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
  OPTIMD_RETURN_IF_ERROR(CheckHandleKinds(t.name, t.param, t.grad));
  OPTIMD_RETURN_IF_ERROR(
      CheckHandleKind(backend_->kind(), t.name, "scale_inv", t.scale_inv));
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
  OPTIMD_RETURN_IF_ERROR(CheckShardPlace(t));
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
    e.global_shape = t.global_shape;
    e.global_offset = t.global_offset;
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
  if (tensor_name_rule_) {
    OPTIMD_RETURN_IF_ERROR(tensor_name_rule_(names.group_names, tensor_names_));
  }
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

  // Pass 3: state memory and metadata, within the daemon's budgets.
  const std::string what = absl::StrCat("group '", spec.id.substr(0, 128), "'");
  const uint64_t metadata = GroupMetadataBytes(kept);
  OPTIMD_RETURN_IF_ERROR(budget_->Reserve(bytes, metadata, what));
  group->metadata_bytes = metadata;
  absl::Status s = AllocateGroupState(backend_, group.get());
  if (s.ok()) {
    group->IndexTensors();
    s = backend_->PrepareGroup(*group);
  }
  if (!s.ok()) {
    budget_->Release(bytes, metadata);
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
  metadata_bytes_ += group->metadata_bytes;
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
    const uint64_t metadata = (*it)->metadata_bytes;
    for (const TensorEntry& t : (*it)->tensors) {
      tensor_names_.erase(t.name);
      for (const std::string& a : t.aliases) alias_names_.erase(a);
      param_bytes_ -= t.numel * DTypeSize(t.layout.param_dtype);
    }
    groups_.erase(it);
    state_bytes_ -= bytes;
    metadata_bytes_ -= metadata;
    budget_->Release(bytes, metadata);
    RefreshMappings();
    PublishInfo();
    return absl::OkStatus();
  }
  return absl::NotFoundError(
      absl::StrCat("group '", id, "' is not registered in this session"));
}

}  // namespace optimd
