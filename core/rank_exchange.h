// The ranks of one job agreeing on each step's gradient statistics, in the
// daemon (ranks whose sessions live on the same CPU daemon): each rank
// contributes the sum of squares of its gradients (non-finite when one of
// them is) and gets the job's, so that every rank clips by the same norm
// and skips the same steps. With sharded optimizer state (ZeRO,
// core/state_shard.h) the ranks also gather each step's updated
// parameters through it. Thread-safe; each rank calls from its own
// thread.
#ifndef OPTIMD_CORE_RANK_EXCHANGE_H_
#define OPTIMD_CORE_RANK_EXCHANGE_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/mutex.h"

namespace optimd {

// How a job's gradients lie across its ranks.
enum class GradientSharding : uint8_t {
  // Each rank steps on its own statistics (no exchange).
  kNone = 0,
  // Every rank holds the whole gradient (DDP): the job's sum of squares is
  // rank 0's; the ranks agree on the skip.
  kReplicated = 1,
  // Each rank holds a shard (FSDP2, ZeRO): the job's sum of squares is the
  // sum over ranks.
  kSharded = 2,
};

absl::string_view GradientShardingName(GradientSharding s);

// Elements of one tensor that a rank updated in a step of a job with
// sharded state, for the other ranks to copy into their own copies of
// that tensor.
struct ParamPiece {
  uint32_t group = 0;   // index of the group in registration order
  uint32_t tensor = 0;  // index of the tensor in its group
  uint64_t offset = 0;  // byte offset in the whole tensor
  uint64_t bytes = 0;
  const uint8_t* data = nullptr;  // in the updating rank's trainer buffer
};
using ParamPieces = std::vector<ParamPiece>;

class RankExchange {
 public:
  // `shard_state`: each rank keeps state for its part of the parameters
  // only (core/state_shard.h), so its sum of squares covers that part and
  // the job's is the sum over ranks whatever `sharding` says.
  RankExchange(std::string job_id, uint32_t world_size,
               GradientSharding sharding, bool shard_state = false);
  RankExchange(const RankExchange&) = delete;
  RankExchange& operator=(const RankExchange&) = delete;

  uint32_t world_size() const { return world_size_; }
  GradientSharding sharding() const { return sharding_; }
  bool shard_state() const { return shard_state_; }

  // Contributes `rank`'s sum of squares to its next round and waits until
  // every rank has contributed to that round; returns the job's sum of
  // squares (non-finite when any rank's is). DEADLINE_EXCEEDED naming the
  // missing ranks at `deadline`, ABORTED when a rank leaves the job while
  // others wait: the contribution is then withdrawn, so the rank's next
  // call is the same round again.
  absl::StatusOr<double> Reduce(uint32_t rank, double sumsq,
                                absl::Time deadline) ABSL_LOCKS_EXCLUDED(mu_);

  // A step's parameter gather (shard_state): `rank` publishes the pieces
  // it updated (`mine`, which must stay valid until this returns; `failed`:
  // its update failed) and waits until every rank has published; then
  // `copy` runs, outside the exchange's lock, with every rank's pieces
  // (index = rank), and this rank waits until every rank's copy has ended,
  // so that no rank's buffers are read after its step returned. ABORTED
  // without copying when a rank failed; DEADLINE_EXCEEDED naming the
  // missing ranks at `deadline`; otherwise `copy`'s status.
  absl::Status Gather(
      uint32_t rank, const ParamPieces* mine, bool failed,
      const std::function<absl::Status(const std::vector<const ParamPieces*>&)>&
          copy,
      absl::Time deadline) ABSL_LOCKS_EXCLUDED(mu_);

  // `rank`'s session closed: rounds waiting for it fail at once (ABORTED),
  // and so do later ones until a session of that rank joins again.
  void Leave(uint32_t rank) ABSL_LOCKS_EXCLUDED(mu_);
  void Join(uint32_t rank) ABSL_LOCKS_EXCLUDED(mu_);
  // Ends the exchange for good (the daemon is stopping): waiting and later
  // rounds fail at once with ABORTED naming `why`.
  void Abort(const std::string& why) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  // The ranks that have not contributed to the current round, for errors.
  std::string Missing() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // A point every rank of the job must reach before any goes on (the two
  // halves of a Gather).
  struct Meeting {
    uint64_t round = 0;  // completed meetings
    uint32_t arrivals = 0;
    std::vector<bool> arrived;
  };
  // Arrives at `m` and waits until every rank has (OK), a rank left or the
  // exchange was aborted (ABORTED), or `deadline` (DEADLINE_EXCEEDED naming
  // the missing ranks and `what`); on an error this rank's arrival is
  // withdrawn.
  absl::Status Meet(Meeting* m, uint32_t rank, absl::Time deadline,
                    const char* what) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::string job_id_;
  const uint32_t world_size_;
  const GradientSharding sharding_;
  const bool shard_state_;
  Mutex mu_;
  // The round being gathered, and per rank whether it contributed to it
  // and what.
  uint64_t round_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<bool> arrived_ ABSL_GUARDED_BY(mu_);
  std::vector<double> sums_ ABSL_GUARDED_BY(mu_);
  uint32_t arrivals_ ABSL_GUARDED_BY(mu_) = 0;
  // The last completed round and its result.
  uint64_t completed_ ABSL_GUARDED_BY(mu_) = 0;
  double result_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<bool> left_ ABSL_GUARDED_BY(mu_);
  uint64_t leaves_ ABSL_GUARDED_BY(mu_) = 0;  // grows with every Leave
  std::string aborted_ ABSL_GUARDED_BY(mu_);  // why, once Abort ran
  // Gather: the two meetings, and per rank what it published for the
  // current gather (valid from the first meeting to the second).
  Meeting published_meeting_ ABSL_GUARDED_BY(mu_);
  Meeting copied_meeting_ ABSL_GUARDED_BY(mu_);
  std::vector<const ParamPieces*> pieces_ ABSL_GUARDED_BY(mu_);
  std::vector<bool> failed_ ABSL_GUARDED_BY(mu_);
};

}  // namespace optimd

#endif  // OPTIMD_CORE_RANK_EXCHANGE_H_
