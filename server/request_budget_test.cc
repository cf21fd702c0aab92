#include "server/request_budget.h"

#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace optimd {
namespace {

TEST(RequestBudgetTest, RefusesWhatWouldPassTheLimitAndTakesItBackAfter) {
  RequestBudget budget(100);
  ASSERT_TRUE(budget.Reserve(60).ok());
  const absl::Status refused = budget.Reserve(41);
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(refused.message().find("--max_request_memory_bytes (100)"),
            std::string::npos)
      << refused;
  EXPECT_EQ(budget.used(), 60u);  // the refusal held nothing
  ASSERT_TRUE(budget.Reserve(40).ok());
  EXPECT_EQ(budget.used(), 100u);
  budget.Release(60);
  budget.Release(40);
  EXPECT_EQ(budget.used(), 0u);
}

TEST(RequestBudgetTest, RepliesTakeHalfTheLimitOrAreHeldPastIt) {
  RequestBudget budget(100);
  // A reply whose call holds all that is held is taken, however large.
  ASSERT_TRUE(budget.Reserve(10).ok());
  ASSERT_TRUE(budget.ReserveReply(500, 10).ok());
  budget.Release(510);
  // Else replies stop at half the limit: the rest is the requests'.
  ASSERT_TRUE(budget.Reserve(10).ok());
  ASSERT_TRUE(budget.ReserveReply(30, 0).ok());
  const absl::Status refused = budget.ReserveReply(11, 0);
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(refused.message().find("replies not yet read"), std::string::npos)
      << refused;
  EXPECT_EQ(budget.used(), 40u);
  EXPECT_TRUE(budget.CheckReplyRoom(0).ok());  // 40 of the 50
  EXPECT_TRUE(budget.Reserve(60).ok());        // requests may use the rest
  // Past half, a reply is refused before it is made, unless its call
  // holds all that is held.
  EXPECT_EQ(budget.CheckReplyRoom(5).code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(budget.CheckReplyRoom(100).ok());
  // The reply of a call that changed something is held whatever the limit.
  budget.Hold(70);
  EXPECT_EQ(budget.used(), 170u);
  EXPECT_EQ(budget.Reserve(1).code(), absl::StatusCode::kResourceExhausted);
  budget.Release(170);
  EXPECT_EQ(budget.used(), 0u);
}

TEST(RequestBudgetTest, ARequestLargerThanTheLimitAloneIsTaken) {
  RequestBudget budget(100);
  ASSERT_TRUE(budget.Reserve(500).ok());
  EXPECT_EQ(budget.Reserve(1).code(), absl::StatusCode::kResourceExhausted);
  budget.Release(500);
  EXPECT_TRUE(budget.Reserve(1).ok());
}

TEST(RequestBudgetTest, NoLimitAndNoWrapAround) {
  RequestBudget unlimited;
  EXPECT_TRUE(unlimited.Reserve(UINT64_MAX / 2).ok());
  EXPECT_TRUE(unlimited.Reserve(UINT64_MAX / 2).ok());
  RequestBudget budget(100);
  ASSERT_TRUE(budget.Reserve(10).ok());
  EXPECT_EQ(budget.Reserve(UINT64_MAX).code(),
            absl::StatusCode::kResourceExhausted);
}

TEST(RequestBudgetTest, NeverPastTheLimitFromManyThreads) {
  RequestBudget budget(1000);
  std::atomic<uint64_t> peak{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 20000; ++i) {
        if (!budget.Reserve(300).ok()) continue;
        uint64_t seen = peak.load();
        const uint64_t now = budget.used();
        while (now > seen && !peak.compare_exchange_weak(seen, now)) {
        }
        budget.Release(300);
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_LE(peak.load(), 900u);
  EXPECT_EQ(budget.used(), 0u);
}

}  // namespace
}  // namespace optimd
