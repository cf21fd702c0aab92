#include "core/session_registry.h"

#include <random>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace optimd {

std::string NewSessionToken() {
  std::random_device rd;
  std::string token;
  static const char kHex[] = "0123456789abcdef";
  for (int i = 0; i < 4; ++i) {
    uint32_t r = rd();
    for (int k = 0; k < 8; ++k) {
      token.push_back(kHex[r & 0xf]);
      r >>= 4;
    }
  }
  return token;
}

bool SameSecret(const std::string& a, const std::string& b) {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < a.size(); ++i) {
    diff |= static_cast<unsigned char>(a[i] ^ (i < b.size() ? b[i] : 0));
  }
  return diff == 0;
}

absl::Status SessionRegistry::CheckIdentity(const SessionIdentity& identity,
                                            const std::string& resume_secret) {
  if (resume_secret.size() > kMaxSecretBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("resume_secret is ", resume_secret.size(),
                     " bytes; at most ", kMaxSecretBytes, " are allowed"));
  }
  if (identity.job_id.empty()) {
    return absl::InvalidArgumentError("job_id must not be empty");
  }
  if (identity.job_id.size() > kMaxNameBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("job_id is ", identity.job_id.size(), " bytes; at most ",
                     kMaxNameBytes, " are allowed"));
  }
  if (identity.world_size == 0 || identity.rank >= identity.world_size) {
    return absl::InvalidArgumentError(absl::StrCat("rank ", identity.rank,
                                                   " is not below world_size ",
                                                   identity.world_size));
  }
  if (identity.world_size > kMaxWorldSize) {
    return absl::InvalidArgumentError(
        absl::StrCat("world_size ", identity.world_size, " is over ",
                     kMaxWorldSize, ", the most ranks a job may have"));
  }
  if (identity.device < -1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "device must be -1 (CPU) or a CUDA ordinal, got ", identity.device));
  }
  if (identity.shard_state &&
      (identity.world_size < 2 ||
       identity.sharding != GradientSharding::kReplicated)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "shard_state splits the optimizer state of a DDP job across its "
        "ranks: it needs world_size > 1 (got ",
        identity.world_size, ") and gradient_sharding replicated (got ",
        GradientShardingName(identity.sharding),
        "): every rank registers its whole, all-reduced gradients"));
  }
  return absl::OkStatus();
}

absl::StatusOr<SessionRegistry::Created> SessionRegistry::Create(
    const SessionIdentity& identity, bool resume,
    const std::string& ready_event, uint32_t trainer_pid,
    const std::string& resume_secret, const std::string& nccl_unique_id) {
  OPTIMD_RETURN_IF_ERROR(CheckIdentity(identity, resume_secret));
  auto backend = BackendFor(identity.device);
  if (!backend.ok()) return backend.status();
  if (!nccl_unique_id.empty() && !NeedsDeviceJob(identity, **backend)) {
    return absl::InvalidArgumentError(
        "nccl_unique_id is only for the ranks of a CUDA job with "
        "gradient_sharding and world_size > 1");
  }
  MutexLock lock(&mu_);
  const auto key = std::make_pair(identity.job_id, identity.rank);
  Created created;
  created.token = NewSessionToken();
  auto it = token_by_rank_.find(key);
  if (it != token_by_rank_.end()) {
    if (!resume) {
      return absl::AlreadyExistsError(absl::StrCat(
          "job '", identity.job_id, "' rank ", identity.rank,
          " already has a session; pass resume=true to take it over after a "
          "trainer restart, or close it first"));
    }
    OPTIMD_ASSIGN_OR_RETURN(
        created.session, TakeOverLocked(identity, it->second, resume_secret));
    created.resumed = true;
  } else {
    OPTIMD_ASSIGN_OR_RETURN(
        created.session,
        OpenLocked(identity, *backend, ready_event, nccl_unique_id));
    created.session->set_resume_secret(
        resume && !resume_secret.empty() ? resume_secret : NewSessionToken());
  }
  by_token_[created.token] = created.session;
  token_by_rank_[key] = created.token;
  trainers_[created.token].process = FindTrainerProcess(trainer_pid);
  return created;
}

absl::StatusOr<std::shared_ptr<Session>> SessionRegistry::TakeOverLocked(
    const SessionIdentity& identity, const std::string& old_token,
    const std::string& resume_secret) {
  auto old = by_token_.find(old_token);
  if (!SameSecret(resume_secret, old->second->resume_secret())) {
    return absl::PermissionDeniedError(absl::StrCat(
        "job '", identity.job_id, "' rank ", identity.rank,
        " has a session, and a resume must send the resume_secret it was "
        "created with (",
        resume_secret.empty() ? "none was sent" : "this one differs",
        "); optimd.torch.AdamW keeps it in its secrets directory or takes "
        "resume_secret="));
  }
  std::shared_ptr<Session> session = old->second;
  // Its trainer may have died since the reaper's last look: steps of it
  // still waiting for its ready flag must not hold back the new one's.
  const auto trainer = trainers_.find(old_token);
  if (trainer != trainers_.end() && trainer->second.process.has_value() &&
      TrainerGone(*trainer->second.process)) {
    Reaped ignored;
    AbandonLocked(*session, &ignored);
  }
  by_token_.erase(old);
  trainers_.erase(old_token);
  session->SetOrphanedSince(0);
  return session;
}

absl::StatusOr<std::shared_ptr<Session>> SessionRegistry::OpenLocked(
    const SessionIdentity& identity, Backend* backend,
    const std::string& ready_event, const std::string& nccl_unique_id) {
  if (by_token_.size() >= kMaxSessions) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the daemon already holds ", by_token_.size(),
        " sessions, its limit; close sessions that are no longer used"));
  }
  OPTIMD_ASSIGN_OR_RETURN(std::shared_ptr<RankExchange> exchange,
                          ExchangeFor(identity, *backend));
  std::string done_event;
  auto context =
      backend->OpenSession(identity.device, ready_event, &done_event);
  if (!context.ok()) return context.status();
  auto session = std::make_shared<Session>(identity, backend, budget_,
                                           *std::move(context));
  if (exchange != nullptr) {
    exchange->Join(identity.rank);
    session->set_rank_exchange(std::move(exchange), rank_timeout_);
  }
  session->set_done_event(done_event);
  session->set_tensor_name_rule(tensor_name_rule_);
  if (NeedsDeviceJob(identity, *backend)) {
    Backend::DeviceJob job{identity.rank,     identity.world_size,
                           identity.sharding, identity.shard_state,
                           nccl_unique_id,    rank_timeout_};
    OPTIMD_RETURN_IF_ERROR(session->JoinDeviceJob(job));
  }
  return session;
}

bool SessionRegistry::NeedsDeviceJob(const SessionIdentity& identity,
                                     const Backend& backend) {
  return identity.sharding != GradientSharding::kNone &&
         identity.world_size > 1 && backend.kind() != BackendKind::kCpu;
}

absl::StatusOr<std::shared_ptr<RankExchange>> SessionRegistry::ExchangeFor(
    const SessionIdentity& identity, const Backend& backend) {
  if (identity.sharding == GradientSharding::kNone ||
      identity.world_size == 1) {
    return std::shared_ptr<RankExchange>();
  }
  // Elsewhere the ranks agree on the device (Backend::JoinJob).
  if (backend.kind() != BackendKind::kCpu)
    return std::shared_ptr<RankExchange>();
  if (identity.world_size > kMaxSessions) {
    return absl::InvalidArgumentError(
        absl::StrCat("world_size ", identity.world_size,
                     ": every rank of a CPU job opens "
                     "its session on this daemon, which holds at most ",
                     kMaxSessions, " sessions"));
  }
  for (auto it = exchanges_.begin(); it != exchanges_.end();) {
    it = it->second.expired() ? exchanges_.erase(it) : std::next(it);
  }
  std::shared_ptr<RankExchange> x = exchanges_[identity.job_id].lock();
  if (x == nullptr) {
    x = std::make_shared<RankExchange>(identity.job_id, identity.world_size,
                                       identity.sharding, identity.shard_state);
    exchanges_[identity.job_id] = x;
  } else if (x->world_size() != identity.world_size ||
             x->sharding() != identity.sharding ||
             x->shard_state() != identity.shard_state) {
    auto state = [](bool sharded) {
      return sharded ? " and sharded state" : "";
    };
    return absl::FailedPreconditionError(absl::StrCat(
        "job '", identity.job_id, "' has world_size ", x->world_size(),
        " with ", GradientShardingName(x->sharding()), " gradients",
        state(x->shard_state()), "; this rank says world_size ",
        identity.world_size, " with ", GradientShardingName(identity.sharding),
        " gradients", state(identity.shard_state),
        ": every rank of a job must say the same"));
  }
  return x;
}

void SessionRegistry::AbortExchanges(const std::string& why) {
  MutexLock lock(&mu_);
  for (auto& [job, weak] : exchanges_) {
    if (auto x = weak.lock()) x->Abort(why);
  }
}

SessionRegistry::SessionRegistry(std::vector<Backend*> backends,
                                 StateBudget* budget)
    : backends_(std::move(backends)), budget_(budget) {
  for (Backend* b : backends_) {
    if (b->kind() == BackendKind::kCpu) {
      cpu_ = b;
    } else {
      gpus_.push_back(b);
    }
  }
}

absl::StatusOr<Backend*> SessionRegistry::BackendFor(int device) const {
  if (device < -1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "device must be -1 (CPU tensors) or a CUDA device index, got ",
        device));
  }
  if (device == -1) {
    if (cpu_ == nullptr) {
      return absl::FailedPreconditionError(
          "this daemon holds no state for CPU tensors (it runs without a "
          "CPU backend); keep parameters on a GPU");
    }
    return cpu_;
  }
  if (gpus_.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "this daemon runs the CPU backend; it cannot hold state for CUDA "
        "device ",
        device,
        " (start optimd with --backend=cuda on a GPU "
        "machine, or keep parameters on the CPU)"));
  }
  if (device < 0 || device >= static_cast<int>(gpus_.size())) {
    return absl::FailedPreconditionError(absl::StrCat(
        "this daemon runs the CUDA backend on devices 0..", gpus_.size() - 1,
        "; device ", device, " is not one of them (-1 for CPU tensors)"));
  }
  return gpus_[device];
}

absl::StatusOr<std::shared_ptr<Session>> SessionRegistry::Find(
    const std::string& token) const {
  if (token.empty()) {
    return absl::UnauthenticatedError(
        "missing session token: send the token from CreateSession in the "
        "'x-optimd-session' metadata");
  }
  MutexLock lock(&mu_);
  auto it = by_token_.find(token);
  if (it == by_token_.end()) {
    return absl::UnauthenticatedError(
        "unknown session token: its session was closed or reaped, taken "
        "over by a resumed session, or made by another daemon or by this "
        "one before a restart (a daemon stopped by SIGTERM saved every "
        "session and offers it to resume=True; otherwise load a "
        "checkpoint)");
  }
  return it->second;
}

absl::Status SessionRegistry::Close(const std::string& token) {
  std::shared_ptr<Session> closed;  // ends after the lock: it may wait
  MutexLock lock(&mu_);
  auto it = by_token_.find(token);
  if (it == by_token_.end()) {
    return absl::UnauthenticatedError("unknown session token");
  }
  closed = it->second;
  EraseLocked(token);
  return absl::OkStatus();
}

void SessionRegistry::EraseLocked(const std::string& token) {
  auto it = by_token_.find(token);
  if (it == by_token_.end()) return;
  const SessionIdentity& id = it->second->identity();
  // A step of it waiting for the other ranks ends now, not at the rank
  // timeout (its call, the close's and the session's other calls queue
  // behind it), and so do streams of its snapshots a client stopped
  // reading (each holds host memory).
  it->second->Retire();
  token_by_rank_.erase(std::make_pair(id.job_id, id.rank));
  by_token_.erase(it);
  trainers_.erase(token);
}

SessionRegistry::Reaped SessionRegistry::Reap(absl::Time now,
                                              absl::Duration grace) {
  Reaped out;
  {
    MutexLock lock(&mu_);
    std::vector<std::string> expired;
    for (auto& [token, trainer] : trainers_) {
      const std::shared_ptr<Session>& s = by_token_.at(token);
      if (!trainer.orphaned_since.has_value()) {
        if (!trainer.process.has_value() || !TrainerGone(*trainer.process)) {
          continue;
        }
        trainer.orphaned_since = now;
        s->SetOrphanedSince(absl::ToDoubleSeconds(now - absl::UnixEpoch()));
        out.orphaned.push_back(s->identity());
      }
      AbandonLocked(*s, &out);
      if (now - *trainer.orphaned_since >= grace) expired.push_back(token);
    }
    for (const std::string& token : expired) {
      out.freed_sessions.push_back(by_token_.at(token));
      out.freed.push_back(out.freed_sessions.back()->identity());
      EraseLocked(token);
    }
  }
  return out;
}

void SessionRegistry::Dispose(std::vector<std::shared_ptr<Session>> freed) {
  std::vector<std::shared_ptr<Session>> live;
  {
    MutexLock lock(&mu_);
    for (const auto& entry : by_token_) live.push_back(entry.second);
  }
  // A segment a session registers in after this look may still be
  // unlinked (its mapping stays; only a new resolve by name fails).
  absl::flat_hash_set<const void*> mapped_by_live;
  for (const auto& s : live) s->AddMappings(&mapped_by_live);
  live.clear();
  // This waits for each freed session's own lock, which a running step
  // may hold.
  for (const auto& s : freed) s->ForgetTrainerBuffers(mapped_by_live);
}

void SessionRegistry::AbandonLocked(Session& session, Reaped* out) {
  const absl::StatusOr<bool> abandoned = session.AbandonSteps();
  if (!abandoned.ok()) {
    out->abandon_failed.emplace_back(session.identity(), abandoned.status());
  } else if (*abandoned) {
    out->abandoned.push_back(session.identity());
  }
}

absl::Status SessionRegistry::Evict(const std::string& job_id, uint32_t rank) {
  std::shared_ptr<Session> evicted;  // ends after the lock: it may wait
  MutexLock lock(&mu_);
  auto it = token_by_rank_.find(std::make_pair(job_id, rank));
  if (it == token_by_rank_.end()) {
    return absl::NotFoundError(
        absl::StrCat("no session of job '", job_id, "' rank ", rank));
  }
  const std::string token(it->second);
  const auto trainer = trainers_.find(token);
  if (trainer != trainers_.end() && trainer->second.process.has_value() &&
      TrainerGone(*trainer->second.process)) {
    Reaped ignored;
    AbandonLocked(*by_token_.at(token), &ignored);
  }
  evicted = by_token_.at(token);
  EraseLocked(token);
  return absl::OkStatus();
}

std::vector<std::shared_ptr<Session>> SessionRegistry::List() const {
  MutexLock lock(&mu_);
  std::vector<std::shared_ptr<Session>> out;
  for (const auto& [token, s] : by_token_) out.push_back(s);
  return out;
}

}  // namespace optimd
