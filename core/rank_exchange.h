// The ranks of one job agreeing on each step's gradient statistics, in the
// daemon (ranks whose sessions live on the same CPU daemon): each rank
// contributes the sum of squares of its gradients (non-finite when one of
// them is) and gets the job's, so that every rank clips by the same norm
// and skips the same steps. Thread-safe; each rank calls from its own
// thread.
#ifndef OPTIMD_CORE_RANK_EXCHANGE_H_
#define OPTIMD_CORE_RANK_EXCHANGE_H_

#include <cstdint>
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

class RankExchange {
 public:
  RankExchange(std::string job_id, uint32_t world_size,
               GradientSharding sharding);
  RankExchange(const RankExchange&) = delete;
  RankExchange& operator=(const RankExchange&) = delete;

  uint32_t world_size() const { return world_size_; }
  GradientSharding sharding() const { return sharding_; }

  // Contributes `rank`'s sum of squares to its next round and waits until
  // every rank has contributed to that round; returns the job's sum of
  // squares (non-finite when any rank's is). DEADLINE_EXCEEDED naming the
  // missing ranks at `deadline`, ABORTED when a rank leaves the job while
  // others wait: the contribution is then withdrawn, so the rank's next
  // call is the same round again.
  absl::StatusOr<double> Reduce(uint32_t rank, double sumsq,
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

  const std::string job_id_;
  const uint32_t world_size_;
  const GradientSharding sharding_;
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
};

}  // namespace optimd

#endif  // OPTIMD_CORE_RANK_EXCHANGE_H_
