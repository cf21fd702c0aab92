// Which LoadStateStream of a session may arrive: one at a time per session,
// so that spool files hold at most one arriving checkpoint of each session.
//
// A stream that comes while another of its session is still open waits for
// that one to end, up to a grace, and is refused past it. The grace is for
// a client that broke its stream off and started the next at once: its
// call has ended, but the daemon learns of the break asynchronously (gRPC
// reports the cancel on one of its threads, in no set order with the next
// call's arrival on another). Waiting holds no thread: the waiter's outcome
// is called, once, from the thread that released the claim before it, or
// from the claims' own timer thread when the grace has passed.
//
// Thread-safe. Outcomes are called without the claims' lock held, so they
// may claim and release again. Destroying it joins the timer thread; no
// stream may be waiting then (gRPC's shutdown has ended every call first).
#ifndef OPTIMD_SERVER_LOAD_STREAM_CLAIMS_H_
#define OPTIMD_SERVER_LOAD_STREAM_CLAIMS_H_

#include <deque>
#include <functional>
#include <map>
#include <thread>

#include "absl/time/time.h"
#include "common/mutex.h"

namespace optimd {

class LoadStreamClaims {
 public:
  // What a waiting stream is told: true, the session's claim is now its
  // own; false, the grace passed first (the claim is not its own).
  using Outcome = std::function<void(bool granted)>;

  explicit LoadStreamClaims(absl::Duration grace);
  LoadStreamClaims(const LoadStreamClaims&) = delete;
  LoadStreamClaims& operator=(const LoadStreamClaims&) = delete;
  ~LoadStreamClaims();

  // Claims `session` for `stream` (both only compared): true when granted
  // at once (`outcome` is then dropped). False: the stream waits behind the
  // streams before it, and `outcome` will be called once, unless Release
  // for the stream comes first.
  bool Claim(const void* session, const void* stream, Outcome outcome)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Ends what `stream` has of `session`: its claim (the first stream
  // waiting is then granted) or its wait. True when it was waiting: its
  // outcome will not be called. Releasing twice, or what was never
  // claimed, does nothing.
  bool Release(const void* session, const void* stream)
      ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Waiter {
    const void* stream;
    absl::Time deadline;
    Outcome outcome;
  };
  struct SessionClaim {
    const void* holder = nullptr;
    std::deque<Waiter> waiters;
  };

  // The timer thread: refuses each waiter whose deadline has passed.
  void RefuseLateWaiters() ABSL_LOCKS_EXCLUDED(mu_);

  // Constant after construction.
  const absl::Duration grace_;

  // State below is protected by mu_.
  Mutex mu_;
  // Sessions with a stream claiming or waiting.
  std::map<const void*, SessionClaim> claims_ ABSL_GUARDED_BY(mu_);
  // Counts waiters added, so that the timer thread sees a new one.
  uint64_t waiters_added_ ABSL_GUARDED_BY(mu_) = 0;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;

  // Last: started once the rest is constructed.
  std::thread timer_;
};

}  // namespace optimd

#endif  // OPTIMD_SERVER_LOAD_STREAM_CLAIMS_H_
