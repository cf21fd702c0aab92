#include "server/load_stream_claims.h"

#include <utility>
#include <vector>

namespace optimd {

LoadStreamClaims::LoadStreamClaims(absl::Duration grace)
    : grace_(grace), timer_([this] { RefuseLateWaiters(); }) {}

LoadStreamClaims::~LoadStreamClaims() {
  {
    MutexLock lock(&mu_);
    stop_ = true;
  }
  timer_.join();
}

bool LoadStreamClaims::Claim(const void* session, const void* stream,
                             Outcome outcome) {
  MutexLock lock(&mu_);
  SessionClaim& claim = claims_[session];
  if (claim.holder == nullptr && claim.waiters.empty()) {
    claim.holder = stream;
    return true;
  }
  claim.waiters.push_back({stream, absl::Now() + grace_, std::move(outcome)});
  ++waiters_added_;
  return false;
}

bool LoadStreamClaims::Release(const void* session, const void* stream) {
  Outcome granted;
  {
    MutexLock lock(&mu_);
    auto it = claims_.find(session);
    if (it == claims_.end()) return false;
    SessionClaim& claim = it->second;
    if (claim.holder != stream) {
      for (auto w = claim.waiters.begin(); w != claim.waiters.end(); ++w) {
        if (w->stream == stream) {
          claim.waiters.erase(w);
          if (claim.holder == nullptr && claim.waiters.empty()) {
            claims_.erase(it);
          }
          return true;
        }
      }
      return false;
    }
    if (claim.waiters.empty()) {
      claims_.erase(it);
      return false;
    }
    claim.holder = claim.waiters.front().stream;
    granted = std::move(claim.waiters.front().outcome);
    claim.waiters.pop_front();
  }
  granted(true);
  return false;
}

void LoadStreamClaims::RefuseLateWaiters() {
  uint64_t seen = 0;
  for (;;) {
    std::vector<Outcome> refused;
    {
      MutexLock lock(&mu_);
      absl::Time next = absl::InfiniteFuture();
      for (const auto& [session, claim] : claims_) {
        if (!claim.waiters.empty()) {
          // Waiters join at the back with the same grace: the front one
          // is due first.
          next = std::min(next, claim.waiters.front().deadline);
        }
      }
      struct Wake {
        LoadStreamClaims* claims;
        uint64_t seen;
      } wake{this, seen};
      mu_.AwaitWithDeadline(
          +[](Wake* w) ABSL_NO_THREAD_SAFETY_ANALYSIS {
            return w->claims->stop_ || w->claims->waiters_added_ != w->seen;
          },
          &wake, next);
      if (stop_) return;
      seen = waiters_added_;
      const absl::Time now = absl::Now();
      for (auto it = claims_.begin(); it != claims_.end();) {
        std::deque<Waiter>& waiters = it->second.waiters;
        while (!waiters.empty() && waiters.front().deadline <= now) {
          refused.push_back(std::move(waiters.front().outcome));
          waiters.pop_front();
        }
        if (it->second.holder == nullptr && waiters.empty()) {
          it = claims_.erase(it);
        } else {
          ++it;
        }
      }
    }
    for (Outcome& outcome : refused) outcome(false);
  }
}

}  // namespace optimd
