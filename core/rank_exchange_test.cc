#include "core/rank_exchange.h"

#include <cmath>
#include <limits>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace optimd {
namespace {

absl::Time Soon() { return absl::Now() + absl::Seconds(20); }

// Every rank contributes from its own thread; returns what each got.
std::vector<absl::StatusOr<double>> Round(RankExchange& x,
                                          const std::vector<double>& sums) {
  std::vector<absl::StatusOr<double>> out(sums.size(), 0.0);
  std::vector<std::thread> threads;
  for (uint32_t r = 0; r < sums.size(); ++r) {
    threads.emplace_back([&, r] { out[r] = x.Reduce(r, sums[r], Soon()); });
  }
  for (auto& t : threads) t.join();
  return out;
}

TEST(RankExchangeTest, ShardedSumsAndReplicatedAgreeOnTheSkip) {
  RankExchange sharded("job", 3, GradientSharding::kSharded);
  for (int round = 0; round < 20; ++round) {
    for (const auto& r : Round(sharded, {1.0, 2.0, 4.0 + round})) {
      ASSERT_TRUE(r.ok()) << r.status();
      EXPECT_EQ(*r, 7.0 + round);
    }
  }
  const double inf = std::numeric_limits<double>::infinity();
  for (const auto& r : Round(sharded, {1.0, inf, 4.0})) {
    EXPECT_TRUE(std::isinf(*r));
  }
  RankExchange replicated("job", 2, GradientSharding::kReplicated);
  for (const auto& r : Round(replicated, {9.0, 9.0})) EXPECT_EQ(*r, 9.0);
  for (const auto& r : Round(replicated, {9.0, std::nan("")})) {
    EXPECT_TRUE(std::isnan(*r));
  }
}

// A rank that does not come: the others give up at their deadline naming
// it, and the round is whole again when it does come.
TEST(RankExchangeTest, MissingRankTimesOutAndRoundsStayAligned) {
  RankExchange x("job", 2, GradientSharding::kSharded);
  auto late = x.Reduce(0, 1.0, absl::Now() + absl::Milliseconds(50));
  EXPECT_EQ(late.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_NE(late.status().message().find("ranks 1 "), std::string::npos)
      << late.status();
  for (const auto& r : Round(x, {1.0, 2.0})) EXPECT_EQ(*r, 3.0);
}

// A rank whose session closes fails the round others wait in, at once,
// and later rounds until a session of that rank joins again.
TEST(RankExchangeTest, LeavingRankAbortsTheOthers) {
  RankExchange x("job", 2, GradientSharding::kSharded);
  absl::StatusOr<double> waiting = 0.0;
  std::thread t([&] { waiting = x.Reduce(0, 1.0, Soon()); });
  absl::SleepFor(absl::Milliseconds(50));
  x.Leave(1);
  t.join();
  EXPECT_EQ(waiting.status().code(), absl::StatusCode::kAborted);
  EXPECT_EQ(x.Reduce(0, 1.0, Soon()).status().code(),
            absl::StatusCode::kAborted);
  x.Join(1);
  for (const auto& r : Round(x, {1.0, 2.0})) EXPECT_EQ(*r, 3.0);
}

// The daemon stopping ends every wait at once, and every later round.
TEST(RankExchangeTest, AbortEndsWaitsAtOnce) {
  RankExchange x("job", 2, GradientSharding::kSharded);
  absl::StatusOr<double> waiting = 0.0;
  std::thread t([&] { waiting = x.Reduce(0, 1.0, Soon()); });
  absl::SleepFor(absl::Milliseconds(50));
  x.Abort("the daemon is stopping");
  t.join();
  EXPECT_EQ(waiting.status().code(), absl::StatusCode::kAborted);
  EXPECT_EQ(waiting.status().message(), "the daemon is stopping");
  EXPECT_EQ(x.Reduce(1, 1.0, Soon()).status().code(),
            absl::StatusCode::kAborted);
}

}  // namespace
}  // namespace optimd
