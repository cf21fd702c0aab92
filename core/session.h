// A session: one trainer rank's registered groups and their state.
//
// Thread-safe: every method takes the session's mutex, so a session's calls
// are serialized (and its steps ordered) whatever thread runs them. Slow
// work (buffer mapping, state allocation, steps) runs on the caller's thread;
// the server calls these methods from the device worker, never from gRPC
// threads.
#ifndef OPTIMD_CORE_SESSION_H_
#define OPTIMD_CORE_SESSION_H_

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <type_traits>
#include <typeindex>
#include <typeinfo>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/mutex.h"
#include "core/backend.h"
#include "core/group.h"
#include "core/rank_exchange.h"
#include "core/session_attachment.h"
#include "core/snapshot_reservation.h"
#include "core/state_budget.h"
#include "core/state_shard.h"
#include "core/tensor_aliases.h"

namespace optimd {

struct SessionIdentity {
  std::string job_id;
  uint32_t rank = 0;
  uint32_t world_size = 1;
  int device = -1;
  // How the job's gradients lie across its ranks: with kReplicated or
  // kSharded (and world_size > 1) the ranks agree on every step's norm and
  // skip (core/rank_exchange.h).
  GradientSharding sharding = GradientSharding::kNone;
  // ZeRO (with world_size > 1 and replicated gradients): the session keeps
  // optimizer state and master weights for its rank's part of each group
  // only (core/state_shard.h), and each step gathers the other ranks'
  // updated parts into the trainer's parameters.
  bool shard_state = false;
};

// A rule of a layer above on a session's tensor names, checked when a
// group registers, before anything changes: `fresh` (the group's tensor
// names) against `registered` (the session's). The daemon's is
// checkpoint/'s: names whose checkpoint keys would collide
// (checkpoint/key_names.h). Called under the session's lock; must not
// call the session.
using TensorNameRule =
    std::function<absl::Status(const std::set<std::string>& fresh,
                               const std::set<std::string>& registered)>;

struct RegisterResult {
  uint64_t state_bytes = 0;
  uint64_t plan_items = 0;
};

// Hyperparameter changes of one group from a step on.
struct HyperOverride {
  std::string group_id;
  double lr = 0;
  // The override leaves the learning rate as it is (`lr` is ignored).
  bool keep_lr = false;
  std::optional<double> beta1, beta2, eps, weight_decay, momentum;
};

// A new buffer for one tensor of a group (UpdateBuffers).
struct BufferUpdate {
  std::string tensor;
  BufferHandle param;  // kind kNone: unchanged
  BufferHandle grad;   // kind kNone: unchanged
  // The tensor has no gradient from now on (grad must be kNone): it is left
  // out of steps until an update gives it a gradient buffer again.
  bool grad_absent = false;
  // The trainer wrote the parameter: its master is set from it
  // (TensorBuffers.param_written).
  bool param_written = false;
};

struct StepRequestSpec {
  uint64_t step = 0;
  std::vector<HyperOverride> overrides;
  StepOptions options;
  // Buffers that moved, per group id, applied first.
  std::vector<std::pair<std::string, std::vector<BufferUpdate>>> buffer_updates;
  // Step flags to bind (kind kNone: keep the bound ones) and this step's
  // number (0: no step flags).
  BufferHandle step_flags;
  uint64_t sequence = 0;
  // The trainer's allocator gave memory back since the last step: the
  // mappings no buffer uses (recent_mappings_) are closed after the
  // buffer updates, so that memory it freed returns to the device.
  bool memory_released = false;
  // Why the step was refused before it reached the session (request
  // validation); the session refuses it with this, after releasing its
  // step flags.
  absl::Status refused;
  // The refusal is for a call nobody waits for any more (cancelled, or its
  // session retired): its NaN contribution to the job's exchange (which
  // makes ranks already waiting skip the step) waits for no other rank.
  bool caller_gone = false;
};

struct StepResult {
  StepOutcome outcome;
  // (group id, step counter) for every group, in registration order.
  std::vector<std::pair<std::string, uint64_t>> group_steps;
  // The done-event handle is per session, not per step; nothing here.
};

// One state buffer of one tensor, in host memory.
struct StateBlob {
  std::string tensor;
  // "master" or the name of one of the optimizer's state slots
  // (core/optimizer.h: "exp_avg", "momentum_buffer", ...).
  std::string kind;
  DType dtype = DType::kFloat32;
  uint64_t numel = 0;
  std::string data;
  // The tensor's own step count (TensorEntry::missed_steps); read only.
  uint64_t step = 0;
};

struct GroupState {
  std::string id;
  uint64_t step = 0;
  OptimizerHyper hyper;
  std::vector<StateBlob> tensors;
};

struct SessionInfo {
  SessionIdentity identity;
  std::vector<std::string> group_ids;
  uint64_t state_bytes = 0;
  // Bytes of the trainer's parameters registered (checkpoints hold them).
  uint64_t param_bytes = 0;
  uint64_t steps = 0;
  uint64_t skipped_steps = 0;
  // Unix time since which the trainer is gone (orphaned); 0 while it runs.
  double orphaned_since = 0;
};

// Snapshots of one session alive at once (streams still being read and a
// background save): each holds a host copy of the session's parameters
// and state.
inline constexpr int kMaxLiveSnapshots = 2;

class Session;

// A session's whole state, lent under the session's lock to the code that
// copies, saves or loads all of it at a step boundary (checkpoint/): its
// groups in registration order, the backend they live in, the flag that
// refuses steps after a load failed part-way, and the reservation of a
// snapshot's memory. Valid only inside the Session::WithLockedState call
// that lends it, where the session's lock is held.
class LockedSession {
 public:
  LockedSession(const LockedSession&) = delete;
  LockedSession& operator=(const LockedSession&) = delete;

  const SessionIdentity& identity() const;
  Backend* backend() const;
  // The groups in registration order: what a checkpoint holds.
  const std::vector<Group*>& groups() const;
  // Checks that the trainer's buffers are still mapped and brings the
  // groups' step counters up to date from the backend, so that the groups
  // hold the state after the last completed step.
  absl::Status SyncFromBackend();
  // Whether a load failed after changing state (or a step failed with
  // DATA_LOSS): the state is a mix, and steps are refused until a load
  // succeeds.
  bool state_mixed() const;
  void set_state_mixed(bool mixed);
  // Reserves host memory for one snapshot of the session's parameters and
  // state against the daemon's state budget and the session's limit of
  // kMaxLiveSnapshots (RESOURCE_EXHAUSTED past either, nothing reserved).
  absl::StatusOr<SnapshotReservation> ReserveSnapshot();

 private:
  friend class Session;
  explicit LockedSession(Session* session) : session_(session) {}
  Session* const session_;
};

class Session {
 public:
  // `context` is the backend's side of the session (Backend::OpenSession).
  Session(SessionIdentity identity, Backend* backend, StateBudget* budget,
          std::unique_ptr<SessionContext> context);
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;
  ~Session();

  const SessionIdentity& identity() const { return identity_; }
  Backend* backend() const { return backend_; }

  // The interprocess event the daemon records after each step (CUDA).
  const std::string& done_event() const { return done_event_; }
  void set_done_event(std::string e) { done_event_ = std::move(e); }
  // Joins the job's ranks on the device (Backend::JoinJob); keeps the job's
  // NCCL unique id, which CreateSession returns (also on a resume).
  absl::Status JoinDeviceJob(const Backend::DeviceJob& job);
  const std::string& nccl_unique_id() const { return nccl_unique_id_; }
  // What a resume of this session must present (SessionRegistry::Create).
  const std::string& resume_secret() const { return resume_secret_; }
  void set_resume_secret(std::string s) { resume_secret_ = std::move(s); }
  // The job's exchange of gradient statistics, for sessions whose ranks
  // agree on them (set by SessionRegistry::Create before the session is
  // shared); each step waits at most `timeout` for the other ranks.
  void set_rank_exchange(std::shared_ptr<RankExchange> exchange,
                         absl::Duration timeout) {
    exchange_ = std::move(exchange);
    rank_timeout_ = timeout;
  }
  // Whether steps wait for the job's other ranks (a thread of its own).
  bool exchanges_statistics() const { return exchange_ != nullptr; }
  // Retires the session, once: when it is closed, evicted or reaped
  // (SessionRegistry), and at the latest when destroyed. It leaves the
  // job's rank exchange (ranks waiting for this one, and this session's own
  // step waiting for them, stop waiting with ABORTED), sets retired() and
  // calls what OnRetire registered (the session's checkpoint streams still
  // under way end).
  void Retire();
  // Whether Retire has run (it may still be calling what OnRetire
  // registered).
  bool retired() const { return retired_.load(); }
  // Calls `fn` when the session is retired, on the retiring thread (at
  // once, on this thread, if it is retired already): for a stream that
  // holds the session, so that it ends instead of keeping a closed
  // session's state. `fn` runs under retire_mu_, and under
  // SessionRegistry's lock when the registry retires the session: it must
  // not call OnRetire, ForgetOnRetire or the registry, nor wait for work
  // that does (cancelling a call is what it is for). The caller of
  // OnRetire must not hold a lock that `fn` takes. Returns the id
  // ForgetOnRetire takes; the caller forgets it before `fn`'s captures go
  // (ForgetOnRetire waits for a call under way).
  uint64_t OnRetire(std::function<void()> fn) ABSL_LOCKS_EXCLUDED(retire_mu_);
  void ForgetOnRetire(uint64_t id) ABSL_LOCKS_EXCLUDED(retire_mu_);
  // The rule RegisterGroup applies to new tensor names beside its own
  // checks (none when empty); set by SessionRegistry::Create before the
  // session is shared.
  void set_tensor_name_rule(TensorNameRule rule) {
    tensor_name_rule_ = std::move(rule);
  }

  // Validates the whole group first; on any error nothing is registered.
  absl::StatusOr<RegisterResult> RegisterGroup(const GroupSpec& spec)
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status UnregisterGroup(const std::string& id) ABSL_LOCKS_EXCLUDED(mu_);
  // Points tensors of a group at new buffers (a restarted trainer, or a
  // gradient buffer the allocator moved). Only the changed plan entries are
  // updated. All or nothing.
  // With `memory_released`, then closes the mappings no buffer uses
  // (StepRequestSpec::memory_released).
  absl::Status UpdateBuffers(const std::string& group_id,
                             const std::vector<BufferUpdate>& updates,
                             bool memory_released = false)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Applies the request's buffer updates, then steps. With step flags, a
  // failed or refused step still releases the trainer's stream.
  absl::StatusOr<StepResult> Step(const StepRequestSpec& request)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Writes master weights into the trainer's buffers; returns the number of
  // tensors written. Empty `group_ids` means all.
  absl::StatusOr<uint64_t> GetParams(const std::vector<std::string>& group_ids)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Never waits for a running step.
  // Copies the state of groups to host memory (empty `group_ids`: all).
  // `with_data` false: counters and hyperparameters only. `tensors` limits
  // the data to those tensors (empty: all). More than `max_bytes` of data
  // is RESOURCE_EXHAUSTED.
  absl::StatusOr<std::vector<GroupState>> ReadState(
      const std::vector<std::string>& group_ids, bool with_data = true,
      const std::vector<std::string>& tensors = {},
      uint64_t max_bytes = ~uint64_t{0}) ABSL_LOCKS_EXCLUDED(mu_);
  // Overwrites a group's step counter, the given state buffers and its
  // tensors' own step counts (`tensor_steps`: name and step, at most
  // `step`; tensors not named get `step`). Everything is checked before
  // anything is written.
  absl::Status WriteState(
      const std::string& group_id, uint64_t step,
      const std::vector<StateBlob>& blobs,
      const std::vector<std::pair<std::string, uint64_t>>& tensor_steps = {})
      ABSL_LOCKS_EXCLUDED(mu_);

  // Runs `fn(LockedSession&)` with the session's lock held: the whole
  // state lent to code that copies, saves or loads all of it at a step
  // boundary (checkpoint/). Returns what `fn` returns.
  template <typename Fn>
  auto WithLockedState(Fn fn) ABSL_LOCKS_EXCLUDED(mu_) {
    MutexLock lock(&mu_);
    LockedSession locked(this);
    return fn(locked);
  }

  // What a layer above keeps for this session (checkpoint/'s background
  // save; core/session_attachment.h): one T per session, made on first
  // use, destroyed first when the session goes. Never waits for a step.
  template <typename T>
  T& Attachment() ABSL_LOCKS_EXCLUDED(attachments_mu_) {
    static_assert(std::is_base_of_v<SessionAttachment, T>);
    MutexLock lock(&attachments_mu_);
    std::unique_ptr<SessionAttachment>& a =
        attachments_[std::type_index(typeid(T))];
    if (a == nullptr) a = std::make_unique<T>();
    // Made as a T just above: the key is T's alone.
    return static_cast<T&>(*a);
  }

  SessionInfo Info() const ABSL_LOCKS_EXCLUDED(info_mu_);
  // Its trainer is gone for good (the session is being freed): let the
  // backend remove the trainer's buffers that would outlive both sides,
  // except the mappings in `kept` (those of sessions still registered).
  void ForgetTrainerBuffers(const absl::flat_hash_set<const void*>& kept)
      ABSL_LOCKS_EXCLUDED(mu_) {
    MutexLock lock(&mu_);
    std::vector<std::shared_ptr<const void>> forgotten;
    for (const auto& m : mappings_) {
      if (!kept.contains(m.get())) forgotten.push_back(m);
    }
    backend_->ForgetTrainerBuffers(forgotten);
  }
  // Adds the mappings its buffers use to *out, without waiting for the
  // session (a step may hold it for as long as other ranks take).
  void AddMappings(absl::flat_hash_set<const void*>* out) const
      ABSL_LOCKS_EXCLUDED(mappings_mu_) {
    MutexLock lock(&mappings_mu_);
    for (const auto& m : shown_mappings_) out->insert(m.get());
  }
  // Runs `fn` once, after the session's next successful step, under the
  // session's lock (`fn` must not call the session). The server removes
  // there the checkpoint it saved at its last stop and offered to this
  // session (server/restart_store.h), so that a later resume is never
  // offered state older than what training went on from.
  void RunAfterNextStep(std::function<void()> fn) ABSL_LOCKS_EXCLUDED(mu_) {
    MutexLock lock(&mu_);
    after_next_step_ = std::move(fn);
  }
  // Its trainer is gone: lets through the session's steps that wait for the
  // trainer's ready flag, as skipped steps (Backend::AbandonSteps). Takes
  // no lock of the session's: a step of it may hold that one, waiting.
  absl::StatusOr<bool> AbandonSteps() {
    return backend_->AbandonSteps(context_.get());
  }
  // Marks the session orphaned since `unix_seconds` (0: not orphaned).
  void SetOrphanedSince(double unix_seconds) ABSL_LOCKS_EXCLUDED(info_mu_) {
    MutexLock lock(&info_mu_);
    info_.orphaned_since = unix_seconds;
  }
  std::vector<std::string> GroupIds() const ABSL_LOCKS_EXCLUDED(mu_);

  // Runs `fn` with the session's groups locked (checkpoints, tests).
  template <typename Fn>
  auto WithGroups(Fn fn) const ABSL_LOCKS_EXCLUDED(mu_) {
    MutexLock lock(&mu_);
    return fn(groups_);
  }

 private:
  friend class LockedSession;

  // Validates, maps and allocates a group (RegisterGroup): nothing of the
  // session changes; *state_bytes is what it reserved from the budget.
  absl::StatusOr<std::unique_ptr<Group>> BuildGroup(const GroupSpec& spec,
                                                    uint64_t* state_bytes)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // BuildGroup's checks of one tensor, which need no memory: its name and
  // aliases (unique in the session, added to *names), dtypes, shape,
  // stage, layout (into *layout) and buffer regions; adds its state and
  // parameter bytes to the sums.
  absl::Status CheckTensor(const GroupSpec& spec, const TensorSpec& t,
                           NameTable* names, uint64_t* bytes,
                           uint64_t* param_bytes, Layout* layout)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Maps every tensor's buffers into group->tensors (cached mappings).
  absl::Status MapTensors(const GroupSpec& spec,
                          const std::vector<Layout>& layouts, Group* group)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // shard_state: marks group->tensors (this rank's parts `ranges` of the
  // tensors of `whole`) as sharded and maps their whole parameters.
  absl::Status MapWholeParams(const GroupSpec& whole,
                              const std::vector<ShardRange>& ranges,
                              Group* group) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  Group* FindGroup(const std::string& id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  const Group* FindGroup(const std::string& id) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A tensor's param and grad handles (those given) are of kinds this
  // session's backend maps (CheckHandleKind): checked before their sizes.
  absl::Status CheckHandleKinds(const std::string& tensor,
                                const BufferHandle& param,
                                const BufferHandle& grad) const;
  // Checks a trainer buffer's size against numel x dtype, then maps it.
  absl::StatusOr<BufferRef> ResolveRegion(const std::string& tensor,
                                          const char* which,
                                          const BufferHandle& handle,
                                          uint64_t numel, DType dtype);
  // Maps an FP8 parameter's scale_inv buffer (its size checked by
  // CheckTensor).
  absl::StatusOr<BufferRef> ResolveScaleInv(const TensorSpec& t);
  // The named groups (all when empty), or NOT_FOUND.
  absl::StatusOr<std::vector<Group*>> Targets(
      const std::vector<std::string>& group_ids)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RefreshMappings() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The step's buffer updates, then (memory_released) the closing of the
  // mappings no buffer uses.
  absl::Status ApplyStepUpdates(const StepRequestSpec& request)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A step refused for its options (request.refused) still applies its
  // buffer updates: they say where the trainer's gradients are now, and
  // the trainer counts them as told. Returns the refusal.
  absl::Status RefuseAfterUpdates(const StepRequestSpec& request)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status UpdateBuffersLocked(const std::string& group_id,
                                   const std::vector<BufferUpdate>& updates)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // One group's buffer updates, checked and mapped, not yet applied.
  struct GroupUpdates;
  // Finds group `group_id` and resolves `updates` against it; changes
  // nothing.
  absl::StatusOr<GroupUpdates> ResolveGroupUpdates(
      const std::string& group_id, const std::vector<BufferUpdate>& updates)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Applies what ResolveGroupUpdates checked. The tensors whose
  // parameters the trainer wrote (param_written) adopt them as masters
  // (Backend::AdoptWrittenParam) now, or with `step_written` (a step's
  // updates) are added to it for the step to adopt once the trainer's
  // stream reaches it (StepOptions::written).
  absl::Status ApplyGroupUpdates(
      GroupUpdates& resolved,
      std::vector<const TensorEntry*>* step_written = nullptr)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Binds the request's step flags (if any) and checks its sequence; sets
  // options->step_flags and ->sequence when the step uses them (also when
  // the sequence is refused, so that the step can be released).
  absl::Status BindStepFlags(const StepRequestSpec& request,
                             StepOptions* options)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The step proper; *exchanged tells whether the backend contributed to
  // the job's exchange of statistics.
  absl::StatusOr<StepResult> StepLocked(const StepRequestSpec& request,
                                        const StepOptions& options,
                                        bool* exchanged)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Keeps `old_mapping` among the recently used mappings when `mapping`
  // replaces it; returns whether it was replaced.
  bool RetainIfReplaced(const std::shared_ptr<const void>& old_mapping,
                        const std::shared_ptr<const void>& mapping)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A BufferUpdate checked and mapped, not yet applied.
  struct ResolvedUpdate {
    uint32_t tensor = 0;  // index into Group::tensors
    BufferRef param, grad;
    BufferRef full_param;  // sharded tensors: the whole parameter
    bool has_param = false, has_grad = false;
    bool absent = false;         // the gradient goes away
    bool param_written = false;  // the master is set from the parameter
  };
  struct GroupUpdates {
    Group* group = nullptr;
    std::vector<ResolvedUpdate> resolved;
  };
  // ResolveUpdates' part for a sharded tensor `e`: the whole buffers are
  // checked, this rank's part of them mapped.
  absl::Status ResolveShardedUpdate(const TensorEntry& e, const BufferUpdate& u,
                                    ResolvedUpdate* r);
  // Per tensor of `g`, its missed steps from a state load's tensor steps.
  static absl::StatusOr<std::vector<uint64_t>> MissedSteps(
      const Group& g, uint64_t step,
      const std::vector<std::pair<std::string, uint64_t>>& tensor_steps);
  // Checks and maps every update of `group`; changes nothing.
  absl::StatusOr<std::vector<ResolvedUpdate>> ResolveUpdates(
      const Group& group, const std::vector<BufferUpdate>& updates);
  // Checks a step's hyperparameter overrides against their groups: known
  // group, valid values, the same state slots. Changes nothing.
  absl::Status CheckOverrides(const std::vector<HyperOverride>& overrides)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Appends tensor `t`'s state to *out: its fp32 master (for every
  // layout), then its state slots, each copied from backend memory.
  absl::Status ReadTensorState(const TensorEntry& t,
                               std::vector<StateBlob>* out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // ReadTensorState's state slots of a block8 tensor, dequantized to fp32.
  absl::Status ReadBlock8State(const TensorEntry& t,
                               std::vector<StateBlob>* out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Quantizes fp32 `values` into state slot `slot` of block8 tensor `t`
  // (codes and that slot's scales).
  absl::Status WriteBlock8Slot(const std::vector<float>& values, int slot,
                               TensorEntry* t)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Writes FP8 tensor `t`'s parameter and scale inverses quantized from
  // its new fp32 `master` (the recipe's rules, core/fp8_quantize.h).
  absl::Status WriteFp8Param(const std::vector<float>& master,
                             const TensorEntry& t)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Checks every blob of a SetState against group `g` (known tensor and
  // state kind, sizes, no duplicates) and pairs each with its tensor.
  absl::StatusOr<std::vector<std::pair<const StateBlob*, TensorEntry*>>>
  CheckStateBlobs(Group* g, const std::vector<StateBlob>& blobs)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Writes one checked blob into tensor `t`'s state (or its master and
  // parameter), converted to the layout's dtypes.
  absl::Status WriteStateBlob(const StateBlob& b, TensorEntry* t)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Publishes the admin view (Info) after a change.
  void PublishInfo() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Constant after construction.
  const SessionIdentity identity_;
  std::shared_ptr<RankExchange> exchange_;
  // What OnRetire registered, called once by Retire.
  Mutex retire_mu_;
  std::map<uint64_t, std::function<void()>> on_retire_
      ABSL_GUARDED_BY(retire_mu_);
  uint64_t next_on_retire_ ABSL_GUARDED_BY(retire_mu_) = 0;
  std::atomic<bool> retired_{false};  // set once, by Retire
  absl::Duration rank_timeout_;
  TensorNameRule tensor_name_rule_;
  Backend* const backend_;
  StateBudget* const budget_;
  const std::unique_ptr<SessionContext> context_;
  std::string nccl_unique_id_;  // set once, at creation
  std::string done_event_;      // set once, before the session is shared
  std::string resume_secret_;   // likewise

  mutable Mutex mu_;
  // In registration order.
  std::vector<std::unique_ptr<Group>> groups_ ABSL_GUARDED_BY(mu_);
  std::set<std::string> tensor_names_ ABSL_GUARDED_BY(mu_);
  // Every registered tensor's aliases (TensorEntry::aliases), none of them
  // in tensor_names_.
  std::set<std::string> alias_names_ ABSL_GUARDED_BY(mu_);
  // Distinct buffer mappings the groups use, checked before each step.
  std::vector<std::shared_ptr<const void>> mappings_ ABSL_GUARDED_BY(mu_);
  // A copy of mappings_ for AddMappings, set with it.
  mutable Mutex mappings_mu_ ABSL_ACQUIRED_AFTER(mu_);
  std::vector<std::shared_ptr<const void>> shown_mappings_
      ABSL_GUARDED_BY(mappings_mu_);
  // Mappings buffers moved away from, most recent first, kept open: a
  // trainer's allocator hands the same allocations out again (gradients
  // that autograd allocates anew each step), and reopening one costs an IPC
  // open, closing one a wait for the device. At most kRecentMappings.
  static constexpr size_t kRecentMappings = 64;
  std::deque<std::shared_ptr<const void>> recent_mappings_ ABSL_GUARDED_BY(mu_);
  // The groups in registration order, kept so that a step need not build
  // the list.
  std::vector<Group*> step_groups_ ABSL_GUARDED_BY(mu_);
  uint64_t state_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  // The groups' metadata bytes (Group::metadata_bytes), all together.
  uint64_t metadata_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  // Bytes of the trainers' parameters registered (at most kMaxSessionBytes).
  uint64_t param_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  // The backend's totals (StepOutcome), the one count of the session's
  // steps, as last reported: kept for Info, and so that the daemon's step
  // counters grow by the difference. Never lowered, since an asynchronous
  // outcome may repeat an older one.
  uint64_t steps_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t skipped_steps_ ABSL_GUARDED_BY(mu_) = 0;
  // Snapshots of this session still alive (streams not yet read to the
  // end, background saves writing). Shared with the snapshots' release
  // functions, which may outlive the session.
  const std::shared_ptr<std::atomic<int>> live_snapshots_ =
      std::make_shared<std::atomic<int>>(0);
  // Set when a load failed after changing state (or a step failed with
  // DATA_LOSS); cleared by a good load (LockedSession::set_state_mixed).
  bool needs_load_ ABSL_GUARDED_BY(mu_) = false;
  // The trainer's step flags (StepRequest.step_flags), and the sequence of
  // the last step that used them.
  BufferRef step_flags_ ABSL_GUARDED_BY(mu_);
  uint64_t last_sequence_ ABSL_GUARDED_BY(mu_) = 0;
  // The running step's tensors whose parameters the trainer wrote
  // (StepOptions::written); emptied as each step starts.
  std::vector<const TensorEntry*> step_written_ ABSL_GUARDED_BY(mu_);
  // RunAfterNextStep's, cleared when run.
  std::function<void()> after_next_step_ ABSL_GUARDED_BY(mu_);

  // What layers above keep for this session (Attachment), by type.
  mutable Mutex attachments_mu_ ABSL_ACQUIRED_AFTER(mu_);
  std::map<std::type_index, std::unique_ptr<SessionAttachment>> attachments_
      ABSL_GUARDED_BY(attachments_mu_);

  // The admin view, behind its own mutex so that ListSessions and
  // GetMetrics never wait for a running step.
  mutable Mutex info_mu_ ABSL_ACQUIRED_AFTER(mu_);
  SessionInfo info_ ABSL_GUARDED_BY(info_mu_);
};

}  // namespace optimd

#endif  // OPTIMD_CORE_SESSION_H_
