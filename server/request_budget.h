// The bytes of requests the daemon holds parsed while they wait for or run
// on a worker, and of replies not yet taken by their callers, bounded as a
// whole. gRPC's ResourceQuota (--max_request_memory_bytes) bounds only its
// receive buffers: a parsed request is a copy beside them that lives until
// its call is finished, so requests queued behind a busy worker would
// otherwise grow without bound; and a reply stays in gRPC's send buffers
// until its caller reads it, so a caller that sends calls and never reads
// their replies would grow the daemon without bound.
//
// Thread-safe.
#ifndef OPTIMD_SERVER_REQUEST_BUDGET_H_
#define OPTIMD_SERVER_REQUEST_BUDGET_H_

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "absl/status/status.h"

namespace optimd {

class RequestBudget {
 public:
  // `limit`: the most bytes held at once; 0, no limit.
  explicit RequestBudget(uint64_t limit = 0) : limit_(limit) {}
  RequestBudget(const RequestBudget&) = delete;
  RequestBudget& operator=(const RequestBudget&) = delete;

  // Holds `bytes` (a request's cost once parsed and converted:
  // RequestScan::held_bytes) until Release(bytes).
  // RESOURCE_EXHAUSTED, holding nothing, when that would pass the limit; a
  // request larger than the limit alone is still taken when nothing else
  // is held (gRPC's quota let it in).
  absl::Status Reserve(uint64_t bytes);
  // Holds the serialized reply of a call that changed nothing, whose
  // request holds `own` bytes already. RESOURCE_EXHAUSTED, holding
  // nothing, when what is held would pass half the limit, so that replies
  // never leave requests (steps) without room; a reply is still taken when
  // its call holds all that is held.
  absl::Status ReserveReply(uint64_t bytes, uint64_t own);
  // ReserveReply's refusal, before a reply is made, when what is held
  // beside a call's own `own` bytes already fills half the limit: a call
  // refused then costs no reply's making.
  absl::Status CheckReplyRoom(uint64_t own) const;
  // Holds `bytes` whatever the limit: the reply of a call that changed
  // something, which must reach its caller.
  void Hold(uint64_t bytes) { used_.fetch_add(bytes); }
  void Release(uint64_t bytes);

  uint64_t limit() const { return limit_; }
  uint64_t used() const { return used_.load(); }

 private:
  // Holds `bytes` unless `cap` (0: none) would be passed while more than
  // `own` bytes are held; else false, with *used the bytes held meanwhile.
  bool TryReserve(uint64_t bytes, uint64_t cap, uint64_t own, uint64_t* used);

  // The most bytes refusable replies may bring the budget to; 0: none.
  uint64_t ReplyCap() const {
    return limit_ == 0 ? 0 : std::max<uint64_t>(limit_ / 2, 1);
  }
  absl::Status NoReplyRoom(uint64_t used, uint64_t bytes) const;

  const uint64_t limit_;
  std::atomic<uint64_t> used_{0};
};

}  // namespace optimd

#endif  // OPTIMD_SERVER_REQUEST_BUDGET_H_
