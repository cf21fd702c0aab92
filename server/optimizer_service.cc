#include "server/optimizer_service.h"

#include <cmath>
#include <type_traits>

#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "checkpoint/session_checkpoint.h"
#include "common/mutex.h"
#include "common/version.h"
#include "server/convert.h"
#include "server/log.h"
#include "server/raw_call.h"
#include "server/session_listing.h"
#include "server/session_name.h"
#include "server/spool_files.h"

namespace optimd {

namespace {

// The API's GradientSharding; INVALID_ARGUMENT for an unknown value.
absl::StatusOr<GradientSharding> ShardingFromProto(int sharding) {
  switch (sharding) {
    case v1::GRADIENT_SHARDING_UNSPECIFIED:
      return GradientSharding::kNone;
    case v1::GRADIENT_SHARDING_REPLICATED:
      return GradientSharding::kReplicated;
    case v1::GRADIENT_SHARDING_SHARDED:
      return GradientSharding::kSharded;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown gradient_sharding ", sharding,
                   " (0: none, 1: replicated, 2: sharded)"));
}

// The session a CreateSession asks for; INVALID_ARGUMENT for an unknown
// gradient_sharding or a ready_event that is not an event handle.
absl::StatusOr<SessionIdentity> IdentityOf(
    const v1::CreateSessionRequest& request) {
  SessionIdentity id;
  id.job_id = request.job_id();
  id.rank = request.rank();
  id.world_size = request.world_size();
  id.device = request.device();
  auto sharding = ShardingFromProto(request.gradient_sharding());
  if (!sharding.ok()) return sharding.status();
  id.sharding = *sharding;
  id.shard_state = request.shard_state();
  if (!request.ready_event().empty() && request.ready_event().size() != 64) {
    return absl::InvalidArgumentError(
        absl::StrCat("ready_event must be a 64-byte cudaIpcEventHandle_t, got ",
                     request.ready_event().size(), " bytes"));
  }
  return id;
}

}  // namespace

OptimizerServiceImpl::OptimizerServiceImpl(SessionRegistry* registry,
                                           std::vector<DeviceWorker*> workers,
                                           CheckpointOptions checkpoint_options)
    : registry_(registry),
      workers_(std::move(workers)),
      checkpoint_options_(std::move(checkpoint_options)) {
  RemoveStaleSpoolFiles(SpoolDirectory(checkpoint_options_));
}

namespace {

// A worker the service does not own (a backend's, or its I/O worker), as
// WorkerFor hands workers out.
std::shared_ptr<DeviceWorker> Unowned(DeviceWorker* worker) {
  return std::shared_ptr<DeviceWorker>(std::shared_ptr<DeviceWorker>(), worker);
}

}  // namespace

std::shared_ptr<DeviceWorker> OptimizerServiceImpl::WorkerFor(
    const std::shared_ptr<Session>& session) const {
  if (session->exchanges_statistics()) {
    MutexLock lock(&rank_workers_mu_);
    RankWorker& mine = rank_workers_[session.get()];
    if (mine.session.lock() != session) {
      // A new session (perhaps where a freed one lived): drop the workers
      // of freed sessions, then make this one's.
      for (auto it = rank_workers_.begin(); it != rank_workers_.end();) {
        it = it->second.session.expired() && &it->second != &mine
                 ? rank_workers_.erase(it)
                 : std::next(it);
      }
      mine.session = session;
      mine.worker = std::make_shared<DeviceWorker>("optimd-rank");
    }
    return mine.worker;
  }
  const std::vector<Backend*>& backends = registry_->backends();
  for (size_t i = 0; i < backends.size() && i < workers_.size(); ++i) {
    if (backends[i] == session->backend()) return Unowned(workers_[i]);
  }
  // Not reached: every session has a registry backend.
  return Unowned(workers_[0]);
}

int OptimizerServiceImpl::Pending() const {
  int n = io_worker_.pending();
  for (const DeviceWorker* w : workers_) n += w->pending();
  MutexLock lock(&rank_workers_mu_);
  for (const auto& [session, w] : rank_workers_) n += w.worker->pending();
  return n;
}

std::string OptimizerServiceImpl::TokenOf(
    grpc::CallbackServerContext* context) const {
  const auto& md = context->client_metadata();
  auto it = md.find(kSessionMetadataKey);
  if (it == md.end()) return "";
  return std::string(it->second.data(), it->second.size());
}

std::string OptimizerServiceImpl::AdminTokenOf(
    grpc::CallbackServerContext* context) const {
  const auto& md = context->client_metadata();
  auto it = md.find(kAdminMetadataKey);
  if (it == md.end()) return "";
  return std::string(it->second.data(), it->second.size());
}

absl::Status OptimizerServiceImpl::CheckAdmin(
    grpc::CallbackServerContext* context, const char* call) const {
  return admin_.Check(context->peer(), AdminTokenOf(context), call);
}

absl::StatusOr<std::shared_ptr<Session>> OptimizerServiceImpl::SessionOf(
    grpc::CallbackServerContext* context) const {
  return registry_->Find(TokenOf(context));
}

namespace {

// What calls get while the daemon drains (StartDraining).
grpc::Status ShuttingDown() {
  return grpc::Status(grpc::StatusCode::UNAVAILABLE, "optimd is shutting down");
}

// CANCELLED when the call's client went (cancelled it, its deadline
// passed, or the daemon shuts down) before its turn came; `outcome` says
// what was not done.
absl::Status GoneBeforeItsTurn(grpc::CallbackServerContext& context,
                               absl::string_view outcome) {
  if (!context.IsCancelled()) return absl::OkStatus();
  return absl::CancelledError(
      absl::StrCat("the call was cancelled (by its client, its deadline or the "
                   "daemon's shutdown) before its turn came; ",
                   outcome));
}

// Why a call queued on a worker is not to run by its turn: its client
// cancelled it (or the shutdown did, after its grace), or its session was
// closed, evicted or reaped meanwhile; OK when it is to run. `outcome`
// says what became of the call.
absl::Status NotToRun(grpc::CallbackServerContext& context,
                      const Session& session,
                      absl::string_view outcome = "nothing was done") {
  if (session.retired()) {
    return absl::AbortedError(absl::StrCat(
        "the session was closed, evicted or reaped before this call's turn "
        "came; ",
        outcome));
  }
  return GoneBeforeItsTurn(context, outcome);
}

// Finishes `call` (CANCELLED) if its caller went before it ran (a
// connection closed with calls it never read): a large reply is not made
// for nobody. True then.
template <typename Call>
bool FinishedIfGone(grpc::CallbackServerContext& context, Call* call) {
  absl::Status gone = GoneBeforeItsTurn(context, "nothing was done");
  if (gone.ok()) return false;
  call->Finish(gone);
  return true;
}

// A refused step's outcome (Session::RefuseAfterUpdates).
constexpr absl::string_view kStepNotRun =
    "the step was not run, but its buffer updates (where the trainer's "
    "buffers are, and its writes into parameters) were applied";

}  // namespace

template <typename Request, typename Response, typename Work>
grpc::ServerUnaryReactor* OptimizerServiceImpl::OnWorker(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* bytes,
    grpc::ByteBuffer* out, Work work, bool file_io, WhenGone when_gone) {
  // GetState's reply may be large and changes nothing.
  constexpr ReplyKind kReply = std::is_same_v<Response, v1::GetStateResponse>
                                   ? ReplyKind::kRefusable
                                   : ReplyKind::kMustSend;
  auto* call =
      new RawUnaryCall<Request, Response>(out, request_budget_.get(), kReply);
  if (draining_.load()) {
    call->Finish(ShuttingDown());
    return call;
  }
  auto session = SessionOf(context);
  if (!session.ok()) {
    call->Finish(session.status());
    return call;
  }
  // File I/O of host-addressable sessions runs on the I/O worker, so that
  // other sessions keep stepping; not for sessions whose steps may wait for
  // other ranks while holding the session (the I/O worker would wait too).
  std::shared_ptr<DeviceWorker> worker =
      file_io && (*session)->backend()->HostAddressable() &&
              !(*session)->exchanges_statistics()
          ? Unowned(&io_worker_)
          : WorkerFor(*session);
  const void* owner = session->get();
  if (worker->queued(owner) >= kMaxQueuedCallsPerSession) {
    call->Finish(absl::ResourceExhaustedError(absl::StrCat(
        "this session already has ", kMaxQueuedCallsPerSession,
        " calls waiting for its device's worker; wait for their replies "
        "before sending more (nothing was done)")));
    return call;
  }
  // Parsed only once its cost is known and held; held until the call is
  // done.
  if (absl::Status parsed = call->Parse(*bytes); !parsed.ok()) {
    call->Finish(parsed);
    return call;
  }
  worker->Post(owner, [call, context, when_gone, work = std::move(work),
                       session = *std::move(session)]() mutable {
    if (when_gone == WhenGone::kSkip) {
      if (absl::Status gone = NotToRun(*context, *session); !gone.ok()) {
        call->Finish(gone);
        return;
      }
    }
    call->Finish(work(*session, call->request(), call->response()));
  });
  return call;
}

grpc::ServerUnaryReactor* OptimizerServiceImpl::CreateSession(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* bytes,
    grpc::ByteBuffer* out) {
  auto* reactor =
      new RawUnaryCall<v1::CreateSessionRequest, v1::CreateSessionResponse>(
          out, request_budget_.get());
  if (draining_.load()) {
    // The daemon is stopping: a new session could do no work.
    reactor->Finish(ShuttingDown());
    return reactor;
  }
  if (!reactor->Parsed(*bytes)) return reactor;
  const v1::CreateSessionRequest* request = &reactor->request();
  v1::CreateSessionResponse* response = reactor->response();
  if (absl::Status caller =
          admin_.CheckSessionCaller(context->peer(), AdminTokenOf(context));
      !caller.ok()) {
    reactor->Finish(ToGrpcStatus(caller));
    return reactor;
  }
  auto identity = IdentityOf(*request);
  if (!identity.ok()) {
    reactor->Finish(ToGrpcStatus(identity.status()));
    return reactor;
  }
  const SessionIdentity& id = *identity;
  auto created = registry_->Create(
      id, request->resume(), request->ready_event(), request->trainer_pid(),
      request->resume_secret(), request->nccl_unique_id());
  if (!created.ok()) {
    reactor->Finish(ToGrpcStatus(created.status()));
    return reactor;
  }
  if (!created->resumed) {
    // Once retired (closed, evicted, reaped), the session's queued calls
    // finish unrun one after the other, so that its state is freed before
    // the next session's work on the device.
    created->session->OnRetire(
        [drains = drains_, worker = WorkerFor(created->session),
         owner = static_cast<const void*>(created->session.get())] {
          MutexLock lock(&drains->mu);
          if (drains->on) worker->Drain(owner);
        });
  }
  std::optional<std::string> saved_dir;
  if (request->resume() && !created->resumed && restart_store_ != nullptr) {
    saved_dir = restart_store_->Find(id.job_id, id.rank);
    const auto secret = restart_store_->SavedSecret(id.job_id, id.rank);
    if (saved_dir && secret && !SameSecret(*secret, request->resume_secret())) {
      registry_->Close(created->token).IgnoreError();
      reactor->Finish(grpc::Status(
          grpc::StatusCode::PERMISSION_DENIED,
          absl::StrCat("the daemon saved job '", id.job_id, "' rank ", id.rank,
                       " at its last stop, and a resume must send "
                       "the resume_secret that session was created with")));
      return reactor;
    }
  }
  response->set_session_token(created->token);
  response->set_backend(created->session->backend()->kind() == BackendKind::kCpu
                            ? v1::BACKEND_CPU
                            : v1::BACKEND_CUDA);
  response->set_resumed(created->resumed);
  response->set_resume_secret(created->session->resume_secret());
  response->set_daemon_version(kVersion);
  response->set_api_revision(kApiRevision);
  log::Info(absl::StrCat(
      "session ", created->resumed || saved_dir ? "resumed" : "created", ": ",
      SessionName(id), " device ", id.device, " world_size ", id.world_size,
      !created->session->exchanges_statistics() &&
              created->session->nccl_unique_id().empty()
          ? ""
          : absl::StrCat(" (", GradientShardingName(id.sharding),
                         " gradients, ranks agree",
                         id.shard_state ? ", sharded state" : "", ")"),
      " trainer pid ", request->trainer_pid(),
      saved_dir ? absl::StrCat("; its state saved at the daemon's last stop "
                               "is in ",
                               *saved_dir, " for the client to load")
                : std::string()));
  if (saved_dir) {
    response->set_saved_state_dir(*saved_dir);
    created->session->RunAfterNextStep(
        [offered = RestartStore::CheckpointPath(*saved_dir, id.rank)] {
          RestartStore::Forget(offered);
        });
  }
  response->set_done_event(created->session->done_event());
  response->set_nccl_unique_id(created->session->nccl_unique_id());
  for (const auto& gid : created->session->GroupIds()) {
    response->add_group_ids(gid);
  }
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerUnaryReactor* OptimizerServiceImpl::CloseSession(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* bytes,
    grpc::ByteBuffer* out) {
  auto* reactor =
      new RawUnaryCall<v1::CloseSessionRequest, v1::CloseSessionResponse>(
          out, request_budget_.get());
  if (!reactor->Parsed(*bytes)) return reactor;
  const std::string token = TokenOf(context);
  auto session = registry_->Find(token);
  if (!session.ok()) {
    reactor->Finish(ToGrpcStatus(session.status()));
    return reactor;
  }
  absl::Status closed = registry_->Close(token);
  if (!closed.ok()) {
    reactor->Finish(ToGrpcStatus(closed));
    return reactor;
  }
  log::Info(
      absl::StrCat("session closed: ", SessionName((*session)->identity())));
  // Freeing the state can take a while; the worker drops the last reference
  // after any step of this session already queued.
  std::shared_ptr<DeviceWorker> worker = WorkerFor(*session);
  const void* owner = session->get();
  worker->Post(owner, [reactor, s = *std::move(session)]() mutable {
    s.reset();
    reactor->Finish(grpc::Status::OK);
  });
  return reactor;
}

grpc::ServerUnaryReactor* OptimizerServiceImpl::RegisterGroup(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
    grpc::ByteBuffer* response) {
  return OnWorker<v1::RegisterGroupRequest, v1::RegisterGroupResponse>(
      context, request, response,
      [](Session& s, const v1::RegisterGroupRequest& request,
         v1::RegisterGroupResponse* response) -> absl::Status {
        auto spec = GroupSpecFromProto(request);
        if (!spec.ok()) return spec.status();
        auto result = s.RegisterGroup(*spec);
        if (!result.ok()) return result.status();
        log::Info(absl::StrCat("group registered: ", SessionName(s.identity()),
                               " group '", spec->id.substr(0, 128), "', ",
                               spec->tensors.size(), " tensors, ",
                               result->state_bytes, " state bytes"));
        response->set_state_bytes(result->state_bytes);
        response->set_plan_items(result->plan_items);
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* OptimizerServiceImpl::UnregisterGroup(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
    grpc::ByteBuffer* response) {
  return OnWorker<v1::UnregisterGroupRequest, v1::UnregisterGroupResponse>(
      context, request, response,
      [](Session& s, const v1::UnregisterGroupRequest& request,
         v1::UnregisterGroupResponse*) {
        return s.UnregisterGroup(request.group_id());
      });
}

grpc::ServerUnaryReactor* OptimizerServiceImpl::UpdateBuffers(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
    grpc::ByteBuffer* response) {
  return OnWorker<v1::UpdateBuffersRequest, v1::UpdateBuffersResponse>(
      context, request, response,
      [](Session& s, const v1::UpdateBuffersRequest& request,
         v1::UpdateBuffersResponse*) -> absl::Status {
        auto updates = BufferUpdatesFromProto(request);
        if (!updates.ok()) return updates.status();
        return s.UpdateBuffers(request.group_id(), *updates,
                               request.memory_released());
      });
}

absl::Status OptimizerServiceImpl::RunStep(Session& s,
                                           const v1::StepRequest& request,
                                           v1::StepResponse* response,
                                           absl::Time start,
                                           absl::Status refused) {
  auto spec = StepSpecFromProto(request);
  if (!spec.ok()) return spec.status();
  const absl::Time host_start = absl::Now();
  // Refused steps still go through Session::Step, which releases the
  // step's flags before refusing it.
  spec->refused = refused.ok() ? CheckStepOptions(request) : refused;
  spec->caller_gone = !refused.ok();
  auto result = s.Step(*spec);
  if (!result.ok()) return result.status();
  step_host_time_.Observe(absl::ToDoubleSeconds(absl::Now() - host_start));
  const StepOutcome& outcome = result->outcome;
  if (outcome.timing_fresh && std::isfinite(outcome.device_seconds)) {
    step_device_time_.Observe(outcome.device_seconds);
    step_ready_wait_.Observe(outcome.device_wait_seconds);
  }
  response->set_known(result->outcome.known);
  response->set_current(result->outcome.current);
  response->set_skipped(result->outcome.skipped);
  response->set_grad_norm(result->outcome.grad_norm);
  for (const auto& [id, step] : result->group_steps) {
    auto* g = response->add_groups();
    g->set_group_id(id);
    g->set_step(step);
  }
  step_latency_.Observe(absl::ToDoubleSeconds(absl::Now() - start));
  return absl::OkStatus();
}

grpc::ServerUnaryReactor* OptimizerServiceImpl::Step(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
    grpc::ByteBuffer* response) {
  const absl::Time start = absl::Now();
  return OnWorker<v1::StepRequest, v1::StepResponse>(
      context, request, response,
      [this, start, context](Session& s, const v1::StepRequest& request,
                             v1::StepResponse* response) -> absl::Status {
        return RunStep(s, request, response, start,
                       NotToRun(*context, s, kStepNotRun));
      },
      /*file_io=*/false, WhenGone::kRun);
}

// Reads one request, runs it on the session's worker, writes its response,
// then reads the next: steps of a stream are strictly ordered. Each
// request arrives as bytes and is parsed into an arena of its own once its
// parsed cost is held against the request budget (ParseHeld), which is
// released when its step is done. Each step finds its session by the
// stream's token again: a session closed, evicted or resumed by another
// trainer after the stream opened ends the stream at its next request, and
// the stream does not keep the session's state alive.
class OptimizerServiceImpl::StepStreamReactor final
    : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  StepStreamReactor(OptimizerServiceImpl* service, std::string token,
                    const Session* session,
                    std::shared_ptr<DeviceWorker> worker)
      : service_(service),
        token_(std::move(token)),
        owner_(session),
        worker_(std::move(worker)) {
    StartRead(&in_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {  // the client closed its side
      Finish(grpc::Status::OK);
      return;
    }
    const absl::Time start = absl::Now();
    arena_ = std::make_unique<google::protobuf::Arena>();
    auto* request =
        google::protobuf::Arena::CreateMessage<v1::StepRequest>(arena_.get());
    uint64_t held = 0;
    absl::Status parsed =
        ParseHeld(in_, service_->request_budget_.get(), request, &held);
    in_.Clear();
    if (!parsed.ok()) {
      service_->request_budget_->Release(held);
      Finish(ToGrpcStatus(parsed));
      return;
    }
    worker_->Post(owner_, [this, start, request, held] {
      v1::StepResponse response;
      absl::StatusOr<std::shared_ptr<Session>> session =
          service_->registry_->Find(token_);
      absl::Status s = session.ok() ? service_->RunStep(**session, *request,
                                                        &response, start)
                                    : StreamSessionGone(session.status());
      session = absl::CancelledError();  // not held past its step
      arena_.reset();
      service_->request_budget_->Release(held);
      if (!s.ok()) {
        Finish(ToGrpcStatus(s));
        return;
      }
      // The last reply's write is done: its buffer may go.
      out_.Clear();
      bool own_buffer;
      grpc::Status serialized =
          grpc::SerializationTraits<v1::StepResponse>::Serialize(
              response, &out_, &own_buffer);
      if (!serialized.ok()) {
        Finish(serialized);
        return;
      }
      StartWrite(&out_);
    });
  }

  void OnWriteDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status(grpc::StatusCode::CANCELLED, "stream closed"));
      return;
    }
    StartRead(&in_);
  }

  void OnDone() override { delete this; }

 private:
  // Why a step of this stream found no session.
  static absl::Status StreamSessionGone(const absl::Status& found) {
    return absl::Status(
        found.code(),
        absl::StrCat(found.message(),
                     " (the session of this step stream was closed, evicted "
                     "or resumed by another trainer after the stream opened; "
                     "open a new stream with the session's current token)"));
  }

  OptimizerServiceImpl* const service_;
  const std::string token_;
  // The session's turn on the worker (DeviceWorker::Post); an address
  // only: the stream does not hold the session.
  const void* const owner_;
  // Kept alive by the stream: a closed session's own worker (WorkerFor)
  // would otherwise go with the next session's.
  const std::shared_ptr<DeviceWorker> worker_;
  grpc::ByteBuffer in_;
  grpc::ByteBuffer out_;
  // The request being stepped, parsed; replaced by each read.
  std::unique_ptr<google::protobuf::Arena> arena_;
};

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>*
OptimizerServiceImpl::StepStream(grpc::CallbackServerContext* context) {
  auto session = SessionOf(context);
  if (draining_.load() || !session.ok()) {
    // A reactor that fails the stream at once.
    class Refused final
        : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
     public:
      explicit Refused(grpc::Status s) { Finish(std::move(s)); }
      void OnDone() override { delete this; }
    };
    return new Refused(draining_.load() ? ShuttingDown()
                                        : ToGrpcStatus(session.status()));
  }
  return new StepStreamReactor(this, TokenOf(context), session->get(),
                               WorkerFor(*session));
}

grpc::ServerUnaryReactor* OptimizerServiceImpl::GetParams(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
    grpc::ByteBuffer* response) {
  return OnWorker<v1::GetParamsRequest, v1::GetParamsResponse>(
      context, request, response,
      [](Session& s, const v1::GetParamsRequest& request,
         v1::GetParamsResponse* response) -> absl::Status {
        std::vector<std::string> ids(request.group_ids().begin(),
                                     request.group_ids().end());
        auto written = s.GetParams(ids);
        if (!written.ok()) return written.status();
        response->set_tensors_written(*written);
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* OptimizerServiceImpl::GetState(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
    grpc::ByteBuffer* response) {
  return OnWorker<v1::GetStateRequest, v1::GetStateResponse>(
      context, request, response,
      [](Session& s, const v1::GetStateRequest& request,
         v1::GetStateResponse* response) -> absl::Status {
        std::vector<std::string> ids(request.group_ids().begin(),
                                     request.group_ids().end());
        std::vector<std::string> tensors(request.tensor_names().begin(),
                                         request.tensor_names().end());
        // Replies stay below the daemon's 1 GiB send limit (and far below
        // protobuf's 2 GiB, past which serializing aborts): data and names are
        // counted, with room left for group ids and hyperparameters.
        constexpr uint64_t kMaxReplyData = (uint64_t{1} << 30) - (64 << 20);
        auto state =
            s.ReadState(ids, !request.metadata_only(), tensors, kMaxReplyData);
        if (!state.ok()) return state.status();
        for (const GroupState& g : *state) {
          GroupStateToProto(g, response->add_groups());
        }
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* OptimizerServiceImpl::SetState(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
    grpc::ByteBuffer* response) {
  return OnWorker<v1::SetStateRequest, v1::SetStateResponse>(
      context, request, response,
      [](Session& s, const v1::SetStateRequest& request,
         v1::SetStateResponse*) -> absl::Status {
        auto blobs = StateBlobsFromProto(request);
        if (!blobs.ok()) return blobs.status();
        std::vector<std::pair<std::string, uint64_t>> tensor_steps;
        for (const v1::TensorStep& t : request.tensor_steps()) {
          tensor_steps.emplace_back(t.tensor(), t.step());
        }
        return s.WriteState(request.group_id(), request.step(), *blobs,
                            tensor_steps);
      });
}

std::function<void(const SaveStatusInfo&)>
OptimizerServiceImpl::BackgroundSaveLogger(const SessionIdentity& id) {
  // Runs on the session's writing thread; the daemon joins every writing
  // thread before the service goes (sessions' ends, RestartStore::SaveAll).
  return [this, name = SessionName(id)](const SaveStatusInfo& info) {
    if (info.state == SaveStatusInfo::kSucceeded) {
      log::Info(absl::StrCat("checkpoint saved (background): ", name, " to ",
                             info.path, ", ", info.bytes_written, " bytes, ",
                             absl::StrFormat("%.3f", info.seconds), " s"));
      return;
    }
    checkpoint_failures_.fetch_add(1);
    log::Warn(absl::StrCat("checkpoint save failed (background): ", name,
                           " to ", info.path, ": ",
                           info.error.ToString().substr(0, 500)));
  };
}

grpc::ServerUnaryReactor* OptimizerServiceImpl::SaveState(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* bytes,
    grpc::ByteBuffer* out) {
  return OnWorker<v1::SaveStateRequest, v1::SaveStateResponse>(
      context, bytes, out,
      [this](Session& s, const v1::SaveStateRequest& request,
             v1::SaveStateResponse* response) -> absl::Status {
        log::Info(
            absl::StrCat("checkpoint save started: ", SessionName(s.identity()),
                         " to ", request.directory().substr(0, 512),
                         request.background() ? " (background)" : ""));
        auto r = SaveSession(s, request.directory(), checkpoint_options_,
                             request.background(),
                             BackgroundSaveLogger(s.identity()));
        if (!r.ok()) {
          checkpoint_failures_.fetch_add(1);
          log::Warn(absl::StrCat(
              "checkpoint save failed: ", SessionName(s.identity()), ": ",
              r.status().ToString().substr(0, 500)));
          return r.status();
        }
        log::Info(absl::StrCat(
            "checkpoint ", request.background() ? "snapshot taken" : "saved",
            ": ", SessionName(s.identity()), " to ", r->path, ", ", r->bytes,
            " bytes, ", absl::StrFormat("%.3f", r->seconds), " s"));
        checkpoint_saves_.fetch_add(1);
        checkpoint_save_bytes_.fetch_add(r->bytes);
        response->set_path(r->path);
        response->set_bytes(r->bytes);
        response->set_seconds(r->seconds);
        return absl::OkStatus();
      },
      /*file_io=*/true);
}

grpc::ServerUnaryReactor* OptimizerServiceImpl::GetSaveStatus(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* bytes,
    grpc::ByteBuffer* out) {
  auto* reactor =
      new RawUnaryCall<v1::GetSaveStatusRequest, v1::GetSaveStatusResponse>(
          out, request_budget_.get());
  if (!reactor->Parsed(*bytes)) return reactor;
  v1::GetSaveStatusResponse* response = reactor->response();
  auto session = SessionOf(context);
  if (!session.ok()) {
    reactor->Finish(ToGrpcStatus(session.status()));
    return reactor;
  }
  const SaveStatusInfo info = SaveStatusOf(**session);
  switch (info.state) {
    case SaveStatusInfo::kNone:
      response->set_state(v1::SAVE_STATE_UNSPECIFIED);
      break;
    case SaveStatusInfo::kRunning:
      response->set_state(v1::SAVE_STATE_RUNNING);
      break;
    case SaveStatusInfo::kSucceeded:
      response->set_state(v1::SAVE_STATE_SUCCEEDED);
      break;
    case SaveStatusInfo::kFailed:
      response->set_state(v1::SAVE_STATE_FAILED);
      response->set_error(info.error.ToString());
      break;
  }
  response->set_path(info.path);
  response->set_bytes_written(info.bytes_written);
  response->set_total_bytes(info.total_bytes);
  response->set_seconds(info.seconds);
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerUnaryReactor* OptimizerServiceImpl::LoadState(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* bytes,
    grpc::ByteBuffer* out) {
  return OnWorker<v1::LoadStateRequest, v1::LoadStateResponse>(
      context, bytes, out,
      [this](Session& s, const v1::LoadStateRequest& request,
             v1::LoadStateResponse* response) -> absl::Status {
        log::Info(
            absl::StrCat("checkpoint load started: ", SessionName(s.identity()),
                         " from ", request.directory().substr(0, 512)));
        auto r = LoadSession(s, request.directory(), checkpoint_options_);
        if (!r.ok()) {
          checkpoint_failures_.fetch_add(1);
          log::Warn(absl::StrCat(
              "checkpoint load failed: ", SessionName(s.identity()), ": ",
              r.status().ToString().substr(0, 500)));
          return r.status();
        }
        log::Info(absl::StrCat("checkpoint loaded: ", SessionName(s.identity()),
                               " from ", r->path, ", ", r->bytes, " bytes, ",
                               absl::StrFormat("%.3f", r->seconds), " s"));
        checkpoint_loads_.fetch_add(1);
        checkpoint_load_bytes_.fetch_add(r->bytes);
        response->set_path(r->path);
        response->set_bytes(r->bytes);
        response->set_peak_staging_bytes(r->peak_staging_bytes);
        response->set_seconds(r->seconds);
        return absl::OkStatus();
      },
      /*file_io=*/true);
}

namespace {

// The listing of `sessions` (AddSessionInfos) into *out.
uint32_t ListInto(const std::vector<std::shared_ptr<Session>>& sessions,
                  google::protobuf::RepeatedPtrField<v1::SessionInfo>* out,
                  size_t max_bytes) {
  return AddSessionInfos(
      sessions.size(), [&](size_t i) { return sessions[i]->Info(); }, out,
      max_bytes);
}

}  // namespace

grpc::ServerUnaryReactor* OptimizerServiceImpl::EvictSession(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* bytes,
    grpc::ByteBuffer* out) {
  auto* reactor =
      new RawUnaryCall<v1::EvictSessionRequest, v1::EvictSessionResponse>(
          out, request_budget_.get());
  if (!reactor->Parsed(*bytes)) return reactor;
  const v1::EvictSessionRequest* request = &reactor->request();
  const absl::Status admin = CheckAdmin(context, "EvictSession");
  if (!admin.ok()) {
    reactor->Finish(ToGrpcStatus(admin));
    return reactor;
  }
  const absl::Status evicted =
      registry_->Evict(request->job_id(), request->rank());
  if (evicted.ok()) {
    log::Info(absl::StrCat("session evicted: ",
                           SessionName({request->job_id(), request->rank()})));
  }
  reactor->Finish(ToGrpcStatus(evicted));
  return reactor;
}

grpc::ServerUnaryReactor* OptimizerServiceImpl::ListSessions(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* bytes,
    grpc::ByteBuffer* out) {
  auto* reactor =
      new RawUnaryCall<v1::ListSessionsRequest, v1::ListSessionsResponse>(
          out, request_budget_.get(), ReplyKind::kRefusable);
  if (!reactor->Parsed(*bytes) || FinishedIfGone(*context, reactor)) {
    return reactor;
  }
  v1::ListSessionsResponse* response = reactor->response();
  const absl::Status admin = CheckAdmin(context, "ListSessions");
  if (!admin.ok()) {
    reactor->Finish(ToGrpcStatus(admin));
    return reactor;
  }
  response->set_sessions_omitted(ListInto(
      registry_->List(), response->mutable_sessions(), max_listing_bytes_));
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerUnaryReactor* OptimizerServiceImpl::GetMetrics(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* bytes,
    grpc::ByteBuffer* out) {
  auto* reactor =
      new RawUnaryCall<v1::GetMetricsRequest, v1::GetMetricsResponse>(
          out, request_budget_.get(), ReplyKind::kRefusable);
  if (!reactor->Parsed(*bytes) || FinishedIfGone(*context, reactor)) {
    return reactor;
  }
  v1::GetMetricsResponse* response = reactor->response();
  // Job ids (and group ids, which name a job's parts) are for callers the
  // daemon knows, as sessions are: an anonymous TCP caller sees each
  // session under the name "session-<n>" (its place in the reply).
  const bool known =
      admin_.CheckSessionCaller(context->peer(), AdminTokenOf(context)).ok();
  FillMetrics(response, /*redact_jobs=*/!known);
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

std::string OptimizerServiceImpl::PrometheusText() const {
  v1::GetMetricsResponse m;
  FillMetrics(&m);
  return m.prometheus_text();
}

void OptimizerServiceImpl::FillMetrics(v1::GetMetricsResponse* response,
                                       bool redact_jobs) const {
  response->set_daemon_version(kVersion);
  response->set_api_revision(kApiRevision);
  for (const Backend* b : registry_->backends()) {
    const Counters& c = const_cast<Backend*>(b)->counters();
    response->set_steps(response->steps() + c.steps.load());
    response->set_skipped_steps(response->skipped_steps() +
                                c.skipped_steps.load());
    response->set_plan_builds(response->plan_builds() + c.plan_builds.load());
    response->set_plan_entry_updates(response->plan_entry_updates() +
                                     c.plan_entry_updates.load());
  }
  const auto sessions = registry_->List();
  response->set_sessions(sessions.size());
  response->set_state_bytes(registry_->budget()->used());
  response->set_metadata_bytes(registry_->budget()->metadata_used());
  response->set_worker_tasks(Pending());
  step_latency_.ToProto(response->mutable_step_latency());
  step_host_time_.ToProto(response->mutable_step_host_time());
  step_device_time_.ToProto(response->mutable_step_device_time());
  step_ready_wait_.ToProto(response->mutable_step_ready_wait());
  response->set_session_infos_omitted(ListInto(
      sessions, response->mutable_session_infos(), max_listing_bytes_));
  if (redact_jobs) {
    int n = 0;
    for (v1::SessionInfo& info : *response->mutable_session_infos()) {
      info.set_job_id(absl::StrCat("session-", n++));
      info.clear_group_ids();
    }
  }
  response->set_checkpoint_saves(checkpoint_saves_.load());
  response->set_checkpoint_save_bytes(checkpoint_save_bytes_.load());
  response->set_checkpoint_loads(checkpoint_loads_.load());
  response->set_checkpoint_load_bytes(checkpoint_load_bytes_.load());
  response->set_checkpoint_failures(checkpoint_failures_.load());
  response->set_prometheus_text(RenderPrometheus(*response));
}

}  // namespace optimd
