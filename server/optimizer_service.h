// The optimd.v1.Optimizer gRPC service (callback API). Handlers are thin:
// they find the session, convert the request, and hand slow work to the
// device worker, which finishes the call. Thread-safe.
#ifndef OPTIMD_SERVER_OPTIMIZER_SERVICE_H_
#define OPTIMD_SERVER_OPTIMIZER_SERVICE_H_

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <set>

#include "absl/time/time.h"
#include "checkpoint/background_save.h"
#include "checkpoint/checkpoint.h"
#include "common/mutex.h"
#include "core/session_registry.h"
#include "optimd/v1/optimd.grpc.pb.h"
#include "server/admin_guard.h"
#include "server/device_worker.h"
#include "server/load_stream_claims.h"
#include "server/metrics.h"
#include "server/request_budget.h"
#include "server/restart_store.h"
#include "server/session_listing.h"

namespace optimd {

// The metadata key that carries the session token.
inline constexpr char kSessionMetadataKey[] = "x-optimd-session";
// Unary calls of one session waiting for its worker at most: past it a call
// is refused (RESOURCE_EXHAUSTED), so that a client that sends without
// waiting for replies cannot take the daemon's request memory from the
// other sessions. Far above what a trainer keeps in flight.
inline constexpr int kMaxQueuedCallsPerSession = 1024;

// The service's methods, in the API's order. Every one takes its requests
// (and a stream's messages) as bytes (raw_call.h), so that a request's
// parsed cost is known and held before it is parsed.
using OptimizerApi = v1::Optimizer;
// clang-format off
using OptimizerServiceBase =
    OptimizerApi::WithRawCallbackMethod_CreateSession<
    OptimizerApi::WithRawCallbackMethod_CloseSession<
    OptimizerApi::WithRawCallbackMethod_RegisterGroup<
    OptimizerApi::WithRawCallbackMethod_UnregisterGroup<
    OptimizerApi::WithRawCallbackMethod_UpdateBuffers<
    OptimizerApi::WithRawCallbackMethod_Step<
    OptimizerApi::WithRawCallbackMethod_StepStream<
    OptimizerApi::WithRawCallbackMethod_GetParams<
    OptimizerApi::WithRawCallbackMethod_GetState<
    OptimizerApi::WithRawCallbackMethod_SetState<
    OptimizerApi::WithRawCallbackMethod_SaveState<
    OptimizerApi::WithRawCallbackMethod_GetSaveStatus<
    OptimizerApi::WithRawCallbackMethod_LoadState<
    OptimizerApi::WithRawCallbackMethod_SaveStateStream<
    OptimizerApi::WithRawCallbackMethod_LoadStateStream<
    OptimizerApi::WithRawCallbackMethod_ListSessions<
    OptimizerApi::WithRawCallbackMethod_EvictSession<
    OptimizerApi::WithRawCallbackMethod_GetMetrics<
    OptimizerApi::Service>>>>>>>>>>>>>>>>>>;
// clang-format on

class OptimizerServiceImpl final : public OptimizerServiceBase {
 public:
  // `registry` and the workers must outlive the service. `workers[i]` runs
  // the work of the sessions of registry->backends()[i].
  OptimizerServiceImpl(SessionRegistry* registry,
                       std::vector<DeviceWorker*> workers,
                       CheckpointOptions checkpoint_options = {});

  // From now on, session calls fail with UNAVAILABLE (the daemon is
  // stopping); calls already queued still run.
  void StartDraining() { draining_.store(true); }
  // Calls still queued on the device workers.
  int pending() const { return Pending(); }
  // Sessions retired from now on no longer drain their queued calls on
  // their workers (DeviceWorker::Drain): called before the backends'
  // workers are destroyed, since sessions may be retired (reaped, or
  // freed with the registry) after them.
  void EndDrains() ABSL_LOCKS_EXCLUDED(drains_->mu) {
    MutexLock lock(&drains_->mu);
    drains_->on = false;
  }
  // Where sessions saved at the daemon's last stop are found, for
  // CreateSession(resume=true); must outlive the service. Set before
  // serving.
  void set_restart_store(const RestartStore* store) { restart_store_ = store; }
  // The metrics of GetMetrics in the Prometheus text format (for HTTP
  // /metrics). Thread-safe.
  std::string PrometheusText() const;
  // Who may make admin calls and open sessions; set before serving.
  void set_admin_guard(AdminGuard guard) { admin_ = std::move(guard); }
  // The most bytes the session list of a ListSessions or GetMetrics reply
  // may take, encoded (AddSessionInfos); at most kMaxListingBytes, the
  // default. Set before serving.
  void set_max_listing_bytes(size_t bytes) { max_listing_bytes_ = bytes; }
  // The most bytes of parsed requests (their cost once parsed and
  // converted, RequestScan::held_bytes) held at once while
  // they wait for or run on a worker; 0, the default: no bound. Set before
  // serving.
  void set_max_held_request_bytes(uint64_t bytes) {
    request_budget_ = std::make_unique<RequestBudget>(bytes);
  }

  grpc::ServerUnaryReactor* CreateSession(grpc::CallbackServerContext* context,
                                          const grpc::ByteBuffer* request,
                                          grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* CloseSession(grpc::CallbackServerContext* context,
                                         const grpc::ByteBuffer* request,
                                         grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* RegisterGroup(grpc::CallbackServerContext* context,
                                          const grpc::ByteBuffer* request,
                                          grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* UnregisterGroup(
      grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
      grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* UpdateBuffers(grpc::CallbackServerContext* context,
                                          const grpc::ByteBuffer* request,
                                          grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* Step(grpc::CallbackServerContext* context,
                                 const grpc::ByteBuffer* request,
                                 grpc::ByteBuffer* response) override;
  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* StepStream(
      grpc::CallbackServerContext* context) override;
  grpc::ServerUnaryReactor* GetParams(grpc::CallbackServerContext* context,
                                      const grpc::ByteBuffer* request,
                                      grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* GetState(grpc::CallbackServerContext* context,
                                     const grpc::ByteBuffer* request,
                                     grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* SetState(grpc::CallbackServerContext* context,
                                     const grpc::ByteBuffer* request,
                                     grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* SaveState(grpc::CallbackServerContext* context,
                                      const grpc::ByteBuffer* request,
                                      grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* GetSaveStatus(grpc::CallbackServerContext* context,
                                          const grpc::ByteBuffer* request,
                                          grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* LoadState(grpc::CallbackServerContext* context,
                                      const grpc::ByteBuffer* request,
                                      grpc::ByteBuffer* response) override;
  grpc::ServerWriteReactor<grpc::ByteBuffer>* SaveStateStream(
      grpc::CallbackServerContext* context,
      const grpc::ByteBuffer* request) override;
  grpc::ServerReadReactor<grpc::ByteBuffer>* LoadStateStream(
      grpc::CallbackServerContext* context,
      grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* EvictSession(grpc::CallbackServerContext* context,
                                         const grpc::ByteBuffer* request,
                                         grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* ListSessions(grpc::CallbackServerContext* context,
                                         const grpc::ByteBuffer* request,
                                         grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* GetMetrics(grpc::CallbackServerContext* context,
                                       const grpc::ByteBuffer* request,
                                       grpc::ByteBuffer* response) override;

 private:
  class StepStreamReactor;
  class SaveStreamReactor;
  class LoadStreamReactor;

  // One step of `session` (on its device worker): buffer updates, the step,
  // the reply. Shared by Step and StepStream.
  // `refused`: NotToRun's reason when nobody waits for the step any more:
  // it is refused (its buffer updates still applied, its flags released)
  // and waits for no other rank; OK otherwise.
  absl::Status RunStep(Session& session, const v1::StepRequest& request,
                       v1::StepResponse* response, absl::Time start,
                       absl::Status refused = absl::OkStatus());

  // The session named by the call's metadata, or UNAUTHENTICATED.
  absl::StatusOr<std::shared_ptr<Session>> SessionOf(
      grpc::CallbackServerContext* context) const;
  std::string TokenOf(grpc::CallbackServerContext* context) const;
  // With `redact_jobs`, sessions are listed as "session-<n>" without
  // their group ids (GetMetrics of an anonymous TCP caller).
  void FillMetrics(v1::GetMetricsResponse* response,
                   bool redact_jobs = false) const;
  // Logs a background save's end (and counts a failure), on the session's
  // writing thread.
  std::function<void(const SaveStatusInfo&)> BackgroundSaveLogger(
      const SessionIdentity& id);
  // Log and count the end of a streamed checkpoint (SaveStateStream,
  // LoadStateStream) of the session `name`, as SaveState and LoadState do
  // theirs: `bytes` sent or loaded, `seconds` since its start.
  void EndStreamedSave(const std::string& name, const grpc::Status& status,
                       uint64_t bytes, uint64_t total_bytes, double seconds);
  void EndStreamedLoad(const std::string& name, const grpc::Status& status,
                       uint64_t bytes, double seconds);
  // The admin token the caller sent (x-optimd-admin), or "".
  std::string AdminTokenOf(grpc::CallbackServerContext* context) const;
  // OK when the caller may make the admin call `call` (AdminGuard).
  absl::Status CheckAdmin(grpc::CallbackServerContext* context,
                          const char* call) const;

  // Runs `work` on the device worker for the call's session and finishes the
  // call with its status. `file_io`: the work is checkpoint file I/O, which
  // for a session whose state the host addresses directly (CPU backend)
  // runs on the I/O worker instead, so that other sessions' steps do not
  // wait behind it (the session's own calls still wait: they take its
  // lock).
  // `work(session, request, response)` gets the request parsed from
  // `bytes` (RawUnaryCall: refused before parsing, with RESOURCE_EXHAUSTED,
  // when it has more entries than a session can hold or its parsed cost
  // would pass the request budget); an OK status sends `response` to `out`.
  // A call whose turn comes after its client cancelled it (gone, past its
  // deadline, or cancelled by the shutdown after its grace) or after its
  // session was retired is finished unrun (WhenGone::kSkip, NotToRun's
  // status), or `work` runs anyway and refuses it itself (kRun: Step,
  // whose refusal releases the trainer's step flags).
  enum class WhenGone { kSkip, kRun };
  template <typename Request, typename Response, typename Work>
  grpc::ServerUnaryReactor* OnWorker(grpc::CallbackServerContext* context,
                                     const grpc::ByteBuffer* bytes,
                                     grpc::ByteBuffer* out, Work work,
                                     bool file_io = false,
                                     WhenGone when_gone = WhenGone::kSkip);

  SessionRegistry* const registry_;
  const RestartStore* restart_store_ = nullptr;
  AdminGuard admin_;
  size_t max_listing_bytes_ = kMaxListingBytes;
  std::unique_ptr<RequestBudget> request_budget_ =
      std::make_unique<RequestBudget>();
  // The worker that runs `session`'s work: its backend's, or, for a
  // session whose steps wait for the job's other ranks, a thread of its
  // own (so that one rank's wait never holds up another session). Shared:
  // a reactor that outlives its session (a step stream holds only the
  // token) keeps its worker alive. Called from gRPC threads only, and a
  // worker's last holder lets go on one (a reactor's OnDone): the end of a
  // worker joins its thread.
  std::shared_ptr<DeviceWorker> WorkerFor(
      const std::shared_ptr<Session>& session) const
      ABSL_LOCKS_EXCLUDED(rank_workers_mu_);
  // Tasks queued or running on all workers.
  int Pending() const ABSL_LOCKS_EXCLUDED(rank_workers_mu_);

  const std::vector<DeviceWorker*> workers_;
  const CheckpointOptions checkpoint_options_;
  LatencyHistogram step_latency_;
  LatencyHistogram step_host_time_;
  LatencyHistogram step_device_time_;
  LatencyHistogram step_ready_wait_;
  std::atomic<uint64_t> checkpoint_saves_{0}, checkpoint_save_bytes_{0};
  std::atomic<uint64_t> checkpoint_loads_{0}, checkpoint_load_bytes_{0};
  std::atomic<uint64_t> checkpoint_failures_{0};
  std::atomic<bool> draining_{false};
  // Whether retired sessions still drain their workers (EndDrains); shared
  // with the sessions' retire callbacks, which may outlive the service.
  struct Drains {
    Mutex mu;
    bool on ABSL_GUARDED_BY(mu) = true;
  };
  const std::shared_ptr<Drains> drains_ = std::make_shared<Drains>();
  // Workers of sessions whose ranks exchange statistics, by session; an
  // entry whose session is gone is dropped (its thread ended) when the next
  // such session's worker is made.
  struct RankWorker {
    std::weak_ptr<Session> session;
    std::shared_ptr<DeviceWorker> worker;
  };
  mutable Mutex rank_workers_mu_;
  mutable std::map<const Session*, RankWorker> rank_workers_
      ABSL_GUARDED_BY(rank_workers_mu_);
  // Sessions with a LoadStateStream arriving: one at a time per session; a
  // stream waits this long for the session's earlier one to end.
  static constexpr absl::Duration kLoadStreamGrace = absl::Seconds(1);
  LoadStreamClaims load_stream_claims_{kLoadStreamGrace};
  // Last: destroyed first, finishing its tasks while the rest still lives.
  DeviceWorker io_worker_{"optimd-io"};
};

}  // namespace optimd

#endif  // OPTIMD_SERVER_OPTIMIZER_SERVICE_H_
