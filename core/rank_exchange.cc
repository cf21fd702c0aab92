#include "core/rank_exchange.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace optimd {

absl::string_view GradientShardingName(GradientSharding s) {
  switch (s) {
    case GradientSharding::kNone:
      return "none";
    case GradientSharding::kReplicated:
      return "replicated";
    case GradientSharding::kSharded:
      return "sharded";
  }
  return "unknown";
}

RankExchange::RankExchange(std::string job_id, uint32_t world_size,
                           GradientSharding sharding, bool shard_state)
    : job_id_(std::move(job_id)),
      world_size_(world_size),
      sharding_(sharding),
      shard_state_(shard_state),
      arrived_(world_size, false),
      sums_(world_size, 0.0),
      left_(world_size, false),
      pieces_(world_size, nullptr),
      failed_(world_size, false) {
  published_meeting_.arrived.assign(world_size, false);
  copied_meeting_.arrived.assign(world_size, false);
}

std::string RankExchange::Missing() const {
  std::string out;
  for (uint32_t r = 0; r < world_size_; ++r) {
    if (!arrived_[r]) absl::StrAppend(&out, out.empty() ? "" : ", ", r);
  }
  return out;
}

absl::StatusOr<double> RankExchange::Reduce(uint32_t rank, double sumsq,
                                            absl::Time deadline) {
  MutexLock lock(&mu_);
  if (!aborted_.empty()) return absl::AbortedError(aborted_);
  for (uint32_t r = 0; r < world_size_; ++r) {
    if (left_[r] && r != rank) {
      return absl::AbortedError(absl::StrCat(
          "rank ", r, " of job '", job_id_,
          "' closed its session; the ranks cannot agree on the gradient "
          "norm until it is back (resume it, or restart the job)"));
    }
  }
  if (arrived_[rank]) {
    return absl::FailedPreconditionError(
        absl::StrCat("rank ", rank, " of job '", job_id_,
                     "' is already waiting for this step's statistics"));
  }
  const uint64_t mine = round_;
  arrived_[rank] = true;
  sums_[rank] = sumsq;
  if (++arrivals_ == world_size_) {
    double total = 0.0;
    if (sharding_ == GradientSharding::kSharded || shard_state_) {
      for (double s : sums_) total += s;  // rank order: the same every round
    } else {
      total = sums_[0];
      // Replicated gradients: any rank's non-finite element skips all.
      for (double s : sums_) {
        if (!std::isfinite(s)) total = s;
      }
    }
    result_ = total;
    completed_ = mine + 1;
    ++round_;
    arrivals_ = 0;
    arrived_.assign(world_size_, false);
    return total;
  }
  struct Wait {
    RankExchange* x;
    uint64_t round, leaves;
  } wait{this, mine, leaves_};
  const bool done = mu_.AwaitWithDeadline(
      +[](Wait* w) ABSL_NO_THREAD_SAFETY_ANALYSIS {
        return w->x->completed_ > w->round || w->x->leaves_ != w->leaves;
      },
      &wait, deadline);
  if (completed_ > mine) return result_;
  const std::string missing = Missing();
  // Withdrawn: the round waits for this rank again.
  arrived_[rank] = false;
  --arrivals_;
  if (!aborted_.empty()) return absl::AbortedError(aborted_);
  if (done && left_[rank]) {
    return absl::AbortedError(absl::StrCat(
        "the session of rank ", rank, " of job '", job_id_,
        "' was closed or evicted while its step waited for the other "
        "ranks' statistics; nothing changed"));
  }
  if (done) {
    return absl::AbortedError(absl::StrCat(
        "a rank of job '", job_id_,
        "' closed its session while this step waited for its statistics"));
  }
  return absl::DeadlineExceededError(absl::StrCat(
      "rank ", rank, " of job '", job_id_,
      "' waited for the gradient statistics of ranks ", missing,
      " and gave up (the daemon's --rank_timeout); is that rank alive and "
      "stepping? Nothing changed"));
}

absl::Status RankExchange::Meet(Meeting* m, uint32_t rank, absl::Time deadline,
                                const char* what) {
  if (!aborted_.empty()) return absl::AbortedError(aborted_);
  const uint64_t mine = m->round;
  m->arrived[rank] = true;
  if (++m->arrivals == world_size_) {
    ++m->round;
    m->arrivals = 0;
    m->arrived.assign(world_size_, false);
    return absl::OkStatus();
  }
  struct Wait {
    RankExchange* x;
    Meeting* m;
    uint64_t round, leaves;
  } wait{this, m, mine, leaves_};
  const bool done = mu_.AwaitWithDeadline(
      +[](Wait* w) ABSL_NO_THREAD_SAFETY_ANALYSIS {
        return w->m->round > w->round || w->x->leaves_ != w->leaves;
      },
      &wait, deadline);
  if (m->round > mine) return absl::OkStatus();
  std::string missing;
  for (uint32_t r = 0; r < world_size_; ++r) {
    if (!m->arrived[r])
      absl::StrAppend(&missing, missing.empty() ? "" : ", ", r);
  }
  m->arrived[rank] = false;
  --m->arrivals;
  if (!aborted_.empty()) return absl::AbortedError(aborted_);
  if (done) {
    return absl::AbortedError(absl::StrCat(
        "a rank of job '", job_id_, "' closed its session while this step ",
        what, "; the ranks' parameters may differ: load a checkpoint"));
  }
  return absl::DeadlineExceededError(absl::StrCat(
      "rank ", rank, " of job '", job_id_, "' waited for ranks ", missing,
      " while this step ", what,
      " and gave up (the daemon's --rank_timeout); the ranks' parameters may "
      "differ: load a checkpoint"));
}

absl::Status RankExchange::Gather(
    uint32_t rank, const ParamPieces* mine, bool failed,
    const std::function<absl::Status(const std::vector<const ParamPieces*>&)>&
        copy,
    absl::Time deadline) {
  std::vector<const ParamPieces*> all;
  std::string failed_ranks;
  {
    MutexLock lock(&mu_);
    pieces_[rank] = mine;
    failed_[rank] = failed;
    OPTIMD_RETURN_IF_ERROR(Meet(&published_meeting_, rank, deadline,
                                "gathered the updated parameters"));
    all = pieces_;
    for (uint32_t r = 0; r < world_size_; ++r) {
      if (failed_[r]) {
        absl::StrAppend(&failed_ranks, failed_ranks.empty() ? "" : ", ", r);
      }
    }
  }
  absl::Status copied = absl::OkStatus();
  if (!failed_ranks.empty()) {
    copied = absl::AbortedError(absl::StrCat(
        "the update of rank(s) ", failed_ranks, " of job '", job_id_,
        "' failed in this step, so the job's parameters were not gathered; "
        "load a checkpoint on every rank"));
  } else {
    copied = copy(all);
  }
  MutexLock lock(&mu_);
  OPTIMD_RETURN_IF_ERROR(Meet(&copied_meeting_, rank, deadline,
                              "waited for the other ranks' parameter copies"));
  return copied;
}

void RankExchange::Leave(uint32_t rank) {
  MutexLock lock(&mu_);
  if (rank >= world_size_) return;
  left_[rank] = true;
  ++leaves_;
}

void RankExchange::Abort(const std::string& why) {
  MutexLock lock(&mu_);
  aborted_ = why.empty() ? std::string("aborted") : why;
  ++leaves_;
}

void RankExchange::Join(uint32_t rank) {
  MutexLock lock(&mu_);
  if (rank < world_size_) left_[rank] = false;
}

}  // namespace optimd
