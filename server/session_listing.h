// The lists of sessions in ListSessions and GetMetrics replies, capped so
// that no reply approaches gRPC's message limits however many sessions
// and group ids there are. Thread-compatible functions.
#ifndef OPTIMD_SERVER_SESSION_LISTING_H_
#define OPTIMD_SERVER_SESSION_LISTING_H_

#include <cstddef>
#include <cstdint>
#include <functional>

#include "core/session.h"
#include "optimd/v1/optimd.pb.h"

namespace optimd {

// The most bytes the sessions of one listing may take, encoded. A session
// lists up to kMaxGroupsPerSession ids of kMaxNameBytes (about 4 MiB), so
// every listing of at least 64 sessions fits, and the reply stays far below
// the daemon's 1 GiB send limit and protobuf's 2 GiB.
inline constexpr size_t kMaxListingBytes = size_t{256} << 20;
// The least a daemon may be set to (--max_listing_bytes): room for a few
// sessions of short ids, for tests and for operators who want small
// replies.
inline constexpr size_t kMinListingBytes = 4096;

// Appends the descriptions of sessions 0 .. count-1 (`info_of(i)`, asked
// one at a time so that only the reply holds them all) to *out, in order,
// each one whose encoded size keeps the listing within `max_bytes`; a
// session that would cross it is left out, and later, smaller ones may
// still be listed. Returns how many were left out.
uint32_t AddSessionInfos(
    size_t count, const std::function<SessionInfo(size_t)>& info_of,
    google::protobuf::RepeatedPtrField<v1::SessionInfo>* out,
    size_t max_bytes = kMaxListingBytes);

}  // namespace optimd

#endif  // OPTIMD_SERVER_SESSION_LISTING_H_
