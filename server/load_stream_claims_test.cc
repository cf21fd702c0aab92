#include "server/load_stream_claims.h"

#include <atomic>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace optimd {
namespace {

// Stand-ins for sessions and streams: only their addresses are compared.
int session_a, session_b, stream_1, stream_2, stream_3;

TEST(LoadStreamClaimsTest, OneStreamPerSessionSessionsApart) {
  LoadStreamClaims claims(absl::Seconds(60));
  EXPECT_TRUE(claims.Claim(&session_a, &stream_1, nullptr));
  EXPECT_TRUE(claims.Claim(&session_b, &stream_2, nullptr));
  EXPECT_FALSE(claims.Release(&session_a, &stream_1));
  // Released twice, or never claimed: nothing.
  EXPECT_FALSE(claims.Release(&session_a, &stream_1));
  EXPECT_FALSE(claims.Release(&session_a, &stream_3));
  EXPECT_TRUE(claims.Claim(&session_a, &stream_3, nullptr));
  EXPECT_FALSE(claims.Release(&session_a, &stream_3));
  EXPECT_FALSE(claims.Release(&session_b, &stream_2));
}

TEST(LoadStreamClaimsTest, WaiterGrantedWhenTheClaimEnds) {
  LoadStreamClaims claims(absl::Seconds(60));
  ASSERT_TRUE(claims.Claim(&session_a, &stream_1, nullptr));
  std::vector<int> outcomes;
  ASSERT_FALSE(claims.Claim(&session_a, &stream_2, [&](bool granted) {
    outcomes.push_back(granted ? 2 : -2);
  }));
  ASSERT_FALSE(claims.Claim(&session_a, &stream_3, [&](bool granted) {
    outcomes.push_back(granted ? 3 : -3);
  }));
  EXPECT_TRUE(outcomes.empty());
  // A waiter's release by its holder's stream does not end the claim.
  EXPECT_FALSE(claims.Release(&session_a, &stream_1));
  EXPECT_EQ(outcomes, std::vector<int>({2}));
  EXPECT_FALSE(claims.Release(&session_a, &stream_2));
  EXPECT_EQ(outcomes, std::vector<int>({2, 3}));
  EXPECT_FALSE(claims.Release(&session_a, &stream_3));
  EXPECT_TRUE(claims.Claim(&session_a, &stream_1, nullptr));
  EXPECT_FALSE(claims.Release(&session_a, &stream_1));
}

TEST(LoadStreamClaimsTest, WaiterThatWithdrawsIsNeverCalled) {
  LoadStreamClaims claims(absl::Seconds(60));
  ASSERT_TRUE(claims.Claim(&session_a, &stream_1, nullptr));
  bool called = false;
  ASSERT_FALSE(
      claims.Claim(&session_a, &stream_2, [&](bool) { called = true; }));
  EXPECT_TRUE(claims.Release(&session_a, &stream_2));
  EXPECT_FALSE(claims.Release(&session_a, &stream_1));
  EXPECT_FALSE(called);
  EXPECT_TRUE(claims.Claim(&session_a, &stream_2, nullptr));
  EXPECT_FALSE(claims.Release(&session_a, &stream_2));
}

// Past the grace a waiter is refused, from the timer thread, and the
// holder keeps the claim; the next stream waits again.
TEST(LoadStreamClaimsTest, WaiterRefusedPastTheGrace) {
  constexpr absl::Duration kGrace = absl::Milliseconds(50);
  LoadStreamClaims claims(kGrace);
  ASSERT_TRUE(claims.Claim(&session_a, &stream_1, nullptr));
  for (int round = 0; round < 3; ++round) {
    absl::Notification told;
    std::atomic<bool> granted{true};
    const absl::Time start = absl::Now();
    ASSERT_FALSE(claims.Claim(&session_a, &stream_2, [&](bool g) {
      granted = g;
      told.Notify();
    }));
    ASSERT_TRUE(told.WaitForNotificationWithTimeout(absl::Seconds(30)));
    EXPECT_FALSE(granted.load());
    EXPECT_GE(absl::Now() - start, kGrace);
    // Refused: no longer waiting.
    EXPECT_FALSE(claims.Release(&session_a, &stream_2));
  }
  EXPECT_FALSE(claims.Release(&session_a, &stream_1));
  EXPECT_TRUE(claims.Claim(&session_a, &stream_2, nullptr));
  EXPECT_FALSE(claims.Release(&session_a, &stream_2));
}

// Holders ending on many threads while others wait: every waiter is told
// once, and each claim has one holder at a time.
TEST(LoadStreamClaimsTest, OneHolderAtATimeUnderContention) {
  LoadStreamClaims claims(absl::Seconds(60));
  constexpr int kThreads = 8, kRounds = 200;
  std::atomic<int> holders{0}, max_holders{0}, told{0};
  std::vector<int> streams(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int r = 0; r < kRounds; ++r) {
        absl::Notification mine;
        if (!claims.Claim(&session_a, &streams[t], [&](bool granted) {
              EXPECT_TRUE(granted);
              ++told;
              mine.Notify();
            })) {
          mine.WaitForNotification();
        }
        const int now = ++holders;
        int seen = max_holders.load();
        while (now > seen && !max_holders.compare_exchange_weak(seen, now)) {
        }
        // Held a moment, so that the other threads come to wait.
        absl::SleepFor(absl::Microseconds(50));
        --holders;
        EXPECT_FALSE(claims.Release(&session_a, &streams[t]));
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(max_holders.load(), 1);
  EXPECT_GT(told.load(), 0);
}

}  // namespace
}  // namespace optimd
