// Session: buffer updates (gradients that moved or went absent, from
// UpdateBuffers and from steps) and the refresh of cached mappings.
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "core/session.h"
#include "core/session_checks.h"

namespace optimd {

absl::Status Session::UpdateBuffers(const std::string& group_id,
                                    const std::vector<BufferUpdate>& updates,
                                    bool memory_released) {
  MutexLock lock(&mu_);
  OPTIMD_RETURN_IF_ERROR(UpdateBuffersLocked(group_id, updates));
  if (memory_released) recent_mappings_.clear();
  return absl::OkStatus();
}

absl::Status Session::UpdateBuffersLocked(
    const std::string& group_id, const std::vector<BufferUpdate>& updates) {
  OPTIMD_ASSIGN_OR_RETURN(GroupUpdates resolved,
                          ResolveGroupUpdates(group_id, updates));
  return ApplyGroupUpdates(resolved);
}

absl::StatusOr<Session::GroupUpdates> Session::ResolveGroupUpdates(
    const std::string& group_id, const std::vector<BufferUpdate>& updates) {
  Group* group = FindGroup(group_id);
  if (group == nullptr) {
    return absl::NotFoundError(absl::StrCat(
        "group '", group_id, "' is not registered in this session"));
  }
  // Resolve everything first; apply only when all are valid.
  OPTIMD_ASSIGN_OR_RETURN(std::vector<ResolvedUpdate> resolved,
                          ResolveUpdates(*group, updates));
  // Written parameters are read where they are (AdoptWrittenParam):
  // a segment shrunk under its mapping must fail here, before anything
  // is applied, not fault then.
  if (std::any_of(resolved.begin(), resolved.end(),
                  [](const ResolvedUpdate& r) { return r.param_written; })) {
    OPTIMD_RETURN_IF_ERROR(backend_->CheckMappings(mappings_));
  }
  return GroupUpdates{group, std::move(resolved)};
}

absl::Status Session::ApplyGroupUpdates(
    GroupUpdates& updates, std::vector<const TensorEntry*>* step_written) {
  Group* group = updates.group;
  std::vector<ResolvedUpdate>& resolved = updates.resolved;
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
      // Its last gradient's mapping goes among the recent ones (backends
      // read no gradient of an absent entry), so that memory the trainer
      // freed can return at its next release (memory_released).
      new_mapping |= RetainIfReplaced(e.grad.mapping, nullptr);
      e.grad = BufferRef{};
      e.grad_absent = true;
    }
    // A write alone (param_written) moves no buffer: its entry stays.
    const bool moved = r.has_param || r.has_grad || r.absent;
    const uint32_t k = group->plan.entry_of_tensor[r.tensor];
    if (moved && k != Plan::kNoEntry) entries.push_back(k);
  }
  // Mappings a step checks change only when a buffer moved to another
  // segment or allocation: the steady state of a moving gradient skips it.
  if (new_mapping) RefreshMappings();
  OPTIMD_RETURN_IF_ERROR(backend_->UpdatePlanEntries(*group, entries));
  for (const ResolvedUpdate& r : resolved) {
    if (!r.param_written) continue;
    const TensorEntry& t = group->tensors[r.tensor];
    if (step_written != nullptr) {
      step_written->push_back(&t);
    } else {
      OPTIMD_RETURN_IF_ERROR(backend_->AdoptWrittenParam(t));
    }
  }
  return absl::OkStatus();
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
    if (found == group.tensors.size()) return group.TensorNotFound(u.tensor);
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
    if (u.param_written && e.layout.fp8_recipe != Fp8Recipe::kNone) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor '", u.tensor,
          "': param_written is not taken for an FP8 parameter (its codes "
          "depend on the master's scale); set its master with SetState"));
    }
    OPTIMD_RETURN_IF_ERROR(CheckHandleKinds(u.tensor, u.param, u.grad));
    ResolvedUpdate r;
    r.tensor = idx;
    r.absent = u.grad_absent && e.Steppable();
    // A remainder layout's parameter is its master's high half: written
    // values are stepped from already (with the old low half), but for
    // +-0 and +-inf, whose low halves are cleared (AdoptWrittenParamRange).
    r.param_written = u.param_written && e.numel > 0 &&
                      (e.layout.master == MasterKind::kFp32 ||
                       e.layout.master == MasterKind::kRemainder);
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
  MutexLock lock(&mappings_mu_);
  shown_mappings_ = mappings_;
}

}  // namespace optimd
