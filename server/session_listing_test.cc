#include "server/session_listing.h"

#include <string>

#include "gtest/gtest.h"
#include "server/convert.h"

namespace optimd {
namespace {

// A session as large as a listing entry can be: the longest job id and
// kMaxGroupsPerSession group ids of kMaxNameBytes (about 4.2 MB encoded).
SessionInfo LargestSession(size_t i) {
  SessionInfo info;
  info.identity.job_id =
      std::string(kMaxNameBytes - 8, 'j') + std::to_string(10000000 + i);
  info.identity.rank = static_cast<uint32_t>(i);
  for (size_t g = 0; g < kMaxGroupsPerSession; ++g) {
    std::string id = std::to_string(g);
    id.resize(kMaxNameBytes, 'g');
    info.group_ids.push_back(std::move(id));
  }
  info.state_bytes = uint64_t{1} << 40;
  return info;
}

// 70 of the largest sessions, then a small one: the listing reaches the
// 256 MiB cut-off, leaves out exactly the sessions past it (counted), keeps
// the order, still lists the small one that fits, and the whole reply
// stays within the cut-off (so far below gRPC's limits).
TEST(SessionListingTest, CutOffAt256MiBLeavesTheRestOutCounted) {
  constexpr size_t kLarge = 70;
  auto info_of = [](size_t i) {
    if (i < kLarge) return LargestSession(i);
    SessionInfo small;
    small.identity.job_id = "small";
    return small;
  };
  const size_t one = [&] {
    v1::SessionInfo p;
    SessionInfoToProto(LargestSession(0), &p);
    return p.ByteSizeLong() + 8;
  }();
  const size_t fit = kMaxListingBytes / one;
  ASSERT_LT(fit, kLarge);  // the cut-off is reached
  v1::ListSessionsResponse reply;
  const uint32_t omitted =
      AddSessionInfos(kLarge + 1, info_of, reply.mutable_sessions());
  reply.set_sessions_omitted(omitted);
  EXPECT_EQ(omitted, kLarge - fit);
  ASSERT_EQ(static_cast<size_t>(reply.sessions_size()), fit + 1);
  for (size_t i = 0; i < fit; ++i) {
    EXPECT_EQ(reply.sessions(i).rank(), i);
  }
  EXPECT_EQ(reply.sessions(fit).job_id(), "small");
  const size_t bytes = reply.ByteSizeLong();
  EXPECT_LE(bytes, kMaxListingBytes);
  EXPECT_GT(bytes, kMaxListingBytes - one);
}

TEST(SessionListingTest, EverythingFitsBelowTheCutOff) {
  v1::GetMetricsResponse reply;
  const uint32_t omitted = AddSessionInfos(
      3, [](size_t i) { return LargestSession(i); },
      reply.mutable_session_infos());
  EXPECT_EQ(omitted, 0u);
  EXPECT_EQ(reply.session_infos_size(), 3);
}

}  // namespace
}  // namespace optimd
