// All open sessions of the daemon, by token and by (job id, rank).
// Thread-safe.
#ifndef OPTIMD_CORE_SESSION_REGISTRY_H_
#define OPTIMD_CORE_SESSION_REGISTRY_H_

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/mutex.h"
#include "core/backend.h"
#include "core/session.h"
#include "core/state_budget.h"
#include "core/trainer_process.h"

namespace optimd {

// Open sessions the daemon holds at most (each costs a little memory and
// a line in every ListSessions and GetMetrics reply).
inline constexpr size_t kMaxSessions = 4096;
// Ranks of one job: above any job run today, and a bound on what a job's
// per-rank tables cost.
inline constexpr uint32_t kMaxWorldSize = uint32_t{1} << 20;

// True when `a` equals `b`, compared in time independent of where they
// differ (resume secrets).
bool SameSecret(const std::string& a, const std::string& b);

class SessionRegistry {
 public:
  struct Created {
    std::string token;
    std::shared_ptr<Session> session;
    bool resumed = false;
  };

  // The longest resume secret accepted.
  static constexpr size_t kMaxSecretBytes = 64;

  // The CUDA backends among `backends`, in order, serve CUDA devices 0, 1,
  // ...; a CPU backend among them (at most one) serves device -1.
  SessionRegistry(std::vector<Backend*> backends, StateBudget* budget);
  SessionRegistry(Backend* backend, StateBudget* budget)
      : SessionRegistry(std::vector<Backend*>{backend}, budget) {}
  SessionRegistry(const SessionRegistry&) = delete;
  SessionRegistry& operator=(const SessionRegistry&) = delete;

  // Opens a session. With `resume`, an existing session of the same job id
  // and rank is handed over under a fresh token (the old token stops
  // working); without it, such a session is ALREADY_EXISTS.
  // `ready_event` is the trainer's interprocess CUDA event handle (empty on
  // the CPU backend).
  // `trainer_pid`: the trainer's process id on this node (0: unknown), so
  // that Reap notices a trainer gone without closing its session.
  // `resume_secret`: a resume must present the session's secret
  // (PERMISSION_DENIED otherwise, nothing changed); a session made anew
  // under `resume` adopts a non-empty one, any other gets a fresh one.
  // `nccl_unique_id`: rank 0's, for the other ranks of a job whose ranks
  // agree on the device (Backend::JoinJob).
  absl::StatusOr<Created> Create(const SessionIdentity& identity, bool resume,
                                 const std::string& ready_event = "",
                                 uint32_t trainer_pid = 0,
                                 const std::string& resume_secret = "",
                                 const std::string& nccl_unique_id = "")
      ABSL_LOCKS_EXCLUDED(mu_);

  // UNAUTHENTICATED for a missing or unknown token.
  absl::StatusOr<std::shared_ptr<Session>> Find(const std::string& token) const
      ABSL_LOCKS_EXCLUDED(mu_);

  // Removes the session; its state is freed when the last in-flight call
  // holding it ends.
  absl::Status Close(const std::string& token) ABSL_LOCKS_EXCLUDED(mu_);

  std::vector<std::shared_ptr<Session>> List() const ABSL_LOCKS_EXCLUDED(mu_);

  // Sessions whose trainer process is gone (killed, or exited without
  // CloseSession) are orphaned: kept for a resume for `grace`, then closed.
  // Reap checks every session's trainer once; a resume ends the orphanhood.
  // Each check also lets through the steps of every orphaned session that
  // wait on the device for the gone trainer's ready flag, as skipped steps
  // (Backend::AbandonSteps), so that the device's other sessions go on.
  struct Reaped {
    std::vector<SessionIdentity> orphaned;  // newly
    std::vector<SessionIdentity> freed;
    std::vector<SessionIdentity> abandoned;  // steps let through
    std::vector<std::pair<SessionIdentity, absl::Status>> abandon_failed;
    // The freed sessions themselves, for Dispose: their end may wait for
    // the device (a CUDA session's stream), so not on the thread that
    // rescues.
    std::vector<std::shared_ptr<Session>> freed_sessions;
  };
  Reaped Reap(absl::Time now, absl::Duration grace) ABSL_LOCKS_EXCLUDED(mu_);
  // Lets the backends remove what of the freed sessions' trainer buffers
  // would outlive both sides (Session::ForgetTrainerBuffers), but not what
  // a session still registered maps too (another trainer's buffers in the
  // same segment), and drops them.
  void Dispose(std::vector<std::shared_ptr<Session>> freed)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Closes the session of `job_id` and `rank` (an operator's eviction),
  // first letting through the steps that wait for its trainer's ready
  // flag if that trainer is gone; NOT_FOUND when there is none.
  absl::Status Evict(const std::string& job_id, uint32_t rank)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Every backend, as given.
  const std::vector<Backend*>& backends() const { return backends_; }
  // The backend serving `device`, or FAILED_PRECONDITION.
  absl::StatusOr<Backend*> BackendFor(int device) const;
  StateBudget* budget() const { return budget_; }
  // Ends every job's exchange of statistics (the daemon is stopping):
  // steps waiting for other ranks return ABORTED naming `why` at once.
  void AbortExchanges(const std::string& why) ABSL_LOCKS_EXCLUDED(mu_);
  // How long a step of a session whose ranks exchange statistics waits for
  // the other ranks (the daemon's --rank_timeout). Set before serving.
  void set_rank_timeout(absl::Duration t) { rank_timeout_ = t; }
  // The rule every new session applies to the tensor names of its groups
  // (Session::set_tensor_name_rule; none by default). Set before serving.
  void set_tensor_name_rule(TensorNameRule rule) {
    tensor_name_rule_ = std::move(rule);
  }

 private:
  const std::vector<Backend*> backends_;
  std::vector<Backend*> gpus_;  // by CUDA device
  Backend* cpu_ = nullptr;      // device -1, if any
  StateBudget* const budget_;
  absl::Duration rank_timeout_ = absl::Minutes(10);
  TensorNameRule tensor_name_rule_;

  mutable Mutex mu_;
  std::map<std::string, std::shared_ptr<Session>> by_token_
      ABSL_GUARDED_BY(mu_);
  std::map<std::pair<std::string, uint32_t>, std::string> token_by_rank_
      ABSL_GUARDED_BY(mu_);
  // By token: the session's trainer process, when the daemon can see it,
  // and since when it is gone.
  struct Trainer {
    std::optional<TrainerProcess> process;
    std::optional<absl::Time> orphaned_since;
  };
  std::map<std::string, Trainer> trainers_ ABSL_GUARDED_BY(mu_);

  // The exchanges of statistics of jobs whose ranks agree on them, by job
  // id; an entry lives as long as a session of the job holds it.
  std::map<std::string, std::weak_ptr<RankExchange>> exchanges_
      ABSL_GUARDED_BY(mu_);
  // The job's exchange for a new session of `identity` on `backend` (null
  // when its ranks do not exchange); refuses a mismatch with the job's
  // other ranks.
  // The job's ranks agree on the device (Backend::JoinJob), not in the
  // daemon.
  static bool NeedsDeviceJob(const SessionIdentity& identity,
                             const Backend& backend);
  absl::StatusOr<std::shared_ptr<RankExchange>> ExchangeFor(
      const SessionIdentity& identity, const Backend& backend)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // The request's own checks, before anything is looked up: lengths, rank
  // and world size, device, shard_state's needs.
  static absl::Status CheckIdentity(const SessionIdentity& identity,
                                    const std::string& resume_secret);
  // A resume: the session of `old_token`, taken out of the maps under its
  // old token (PERMISSION_DENIED, changing nothing, for a wrong secret).
  absl::StatusOr<std::shared_ptr<Session>> TakeOverLocked(
      const SessionIdentity& identity, const std::string& old_token,
      const std::string& resume_secret) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A new session on `backend`, in its job's exchange or device job when
  // its ranks agree on steps; not yet in the maps.
  absl::StatusOr<std::shared_ptr<Session>> OpenLocked(
      const SessionIdentity& identity, Backend* backend,
      const std::string& ready_event, const std::string& nccl_unique_id)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Removes the session of `token` from every map.
  void EraseLocked(const std::string& token) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Session::AbandonSteps into `out` for a session whose trainer is gone;
  // under the lock, so that no resume takes the session over meanwhile.
  void AbandonLocked(Session& session, Reaped* out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
};

// 128 random bits as 32 hex characters, from the OS's entropy source.
std::string NewSessionToken();

}  // namespace optimd

#endif  // OPTIMD_CORE_SESSION_REGISTRY_H_
