#include "core/session.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <limits>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "core/session_checks.h"

namespace optimd {

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
  budget_->Release(state_bytes_, metadata_bytes_);
  Retire();
}

void Session::Retire() {
  if (retired_.exchange(true)) return;
  if (exchange_ != nullptr) exchange_->Leave(identity_.rank);
  // Under retire_mu_, so that a caller's ForgetOnRetire (before its
  // captures go) waits for a call under way.
  MutexLock lock(&retire_mu_);
  for (auto& [id, fn] : on_retire_) fn();
  on_retire_.clear();
}

uint64_t Session::OnRetire(std::function<void()> fn) {
  MutexLock lock(&retire_mu_);
  if (retired_.load()) {
    fn();
    return 0;
  }
  const uint64_t id = ++next_on_retire_;
  on_retire_.emplace(id, std::move(fn));
  return id;
}

void Session::ForgetOnRetire(uint64_t id) {
  MutexLock lock(&retire_mu_);
  on_retire_.erase(id);
}

absl::Status Session::JoinDeviceJob(const Backend::DeviceJob& job) {
  OPTIMD_ASSIGN_OR_RETURN(nccl_unique_id_,
                          backend_->JoinJob(context_.get(), job));
  return absl::OkStatus();
}

absl::Status Session::CheckHandleKinds(const std::string& tensor,
                                       const BufferHandle& param,
                                       const BufferHandle& grad) const {
  OPTIMD_RETURN_IF_ERROR(
      CheckHandleKind(backend_->kind(), tensor, "param", param));
  return CheckHandleKind(backend_->kind(), tensor, "grad", grad);
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

absl::StatusOr<StepResult> Session::Step(const StepRequestSpec& request) {
  MutexLock lock(&mu_);
  StepOptions options = request.options;
  absl::Status bound = BindStepFlags(request, &options);
  options.sequence_in_order = bound.ok();
  step_written_.clear();
  options.written = &step_written_;
  bool exchanged = false;
  absl::StatusOr<StepResult> result =
      !bound.ok()             ? bound
      : !request.refused.ok() ? RefuseAfterUpdates(request)
                              : StepLocked(request, options, &exchanged);
  if (exchange_ != nullptr && !result.ok() && !exchanged) {
    // The other ranks skip this step rather than wait for this rank.
    exchange_
        ->Reduce(identity_.rank, std::numeric_limits<double>::quiet_NaN(),
                 absl::Now() + (request.caller_gone ? absl::ZeroDuration()
                                                    : rank_timeout_))
        .IgnoreError();
  }
  if (options.step_flags != nullptr) {
    if (!result.ok()) {
      // The trainer's stream waits for this step's done flag: release it
      // whatever went wrong (a failure here leaves only that wait). The
      // release adopts the written parameters first.
      backend_->ReleaseStep(context_.get(), options).IgnoreError();
    }
    if (bound.ok()) last_sequence_ = options.sequence;
  } else if (!result.ok()) {
    // The trainer's writes stand whatever happened to the step (adopting
    // again what the step adopted changes nothing). A failure here is the
    // device's, which the next call meets too.
    for (const TensorEntry* t : step_written_) {
      backend_->AdoptWrittenParam(*t).IgnoreError();
    }
  }
  if (result.ok() && after_next_step_) {
    const std::function<void()> after = std::move(after_next_step_);
    after_next_step_ = nullptr;
    after();
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
    // Two words (ready, done), three with a staged step's progress, or
    // eight with the step's two global-timer stamps after a spare word.
    const uint64_t size = request.step_flags.size;
    if (size != 8 && size != 12 && size != 32) {
      return absl::InvalidArgumentError(absl::StrCat(
          "step_flags are 8 bytes (ready, done), 12 (and a staged step's "
          "progress) or 32 (and the step's timer stamps); got ",
          size));
    }
    // Aligned as their widest word: 8 bytes for the stamps.
    const DType word = size == 32 ? DType::kFloat64 : DType::kFloat32;
    OPTIMD_ASSIGN_OR_RETURN(
        step_flags_, ResolveRegion("step_flags", "buffer", request.step_flags,
                                   size / DTypeSize(word), word));
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
  options->step_flags_mapping = step_flags_.mapping;
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

absl::Status Session::ApplyStepUpdates(const StepRequestSpec& request) {
  // Every group's updates are checked before any is applied: a bad one
  // leaves the buffers of the groups before it as they were.
  std::vector<GroupUpdates> resolved;
  resolved.reserve(request.buffer_updates.size());
  for (const auto& [group_id, updates] : request.buffer_updates) {
    // Two for one group would leave which buffer wins to their order.
    for (const GroupUpdates& before : resolved) {
      if (before.group->id == group_id) {
        return absl::InvalidArgumentError(
            absl::StrCat("StepRequest.buffer_updates names group '", group_id,
                         "' twice; send one UpdateBuffersRequest per group"));
      }
    }
    OPTIMD_ASSIGN_OR_RETURN(GroupUpdates r,
                            ResolveGroupUpdates(group_id, updates));
    resolved.push_back(std::move(r));
  }
  for (GroupUpdates& r : resolved) {
    OPTIMD_RETURN_IF_ERROR(ApplyGroupUpdates(r, &step_written_));
  }
  // Mappings no buffer uses are kept (torch hands its blocks out again)
  // and closed only after the trainer gave memory back; a backend closes
  // them once the steps queued before this one no longer use them.
  if (request.memory_released) recent_mappings_.clear();
  return absl::OkStatus();
}

absl::Status Session::RefuseAfterUpdates(const StepRequestSpec& request) {
  OPTIMD_RETURN_IF_ERROR(ApplyStepUpdates(request));
  return request.refused;
}

absl::StatusOr<StepResult> Session::StepLocked(const StepRequestSpec& request,
                                               const StepOptions& o,
                                               bool* exchanged) {
  OPTIMD_RETURN_IF_ERROR(ApplyStepUpdates(request));
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
