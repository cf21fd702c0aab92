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

// Sharded state: each rank's sum covers its part, so the job's is the sum
// over ranks even though DDP's gradients are replicated.
TEST(RankExchangeTest, ShardedStateSumsReplicatedGradients) {
  RankExchange x("job", 2, GradientSharding::kReplicated, true);
  for (const auto& r : Round(x, {2.0, 5.0})) EXPECT_EQ(*r, 7.0);
}

// Each rank publishes the bytes it updated; every rank copies the others'
// into its own buffer, and none returns before all copies ended.
TEST(RankExchangeTest, GatherCopiesEveryRanksPieces) {
  constexpr uint32_t kRanks = 3;
  RankExchange x("job", kRanks, GradientSharding::kReplicated, true);
  // 9 bytes of one tensor; rank r owns bytes [3r, 3r + 3).
  std::vector<std::vector<uint8_t>> buffers(kRanks, std::vector<uint8_t>(9));
  for (int round = 1; round <= 5; ++round) {
    std::vector<absl::Status> out(kRanks);
    std::vector<std::thread> threads;
    for (uint32_t r = 0; r < kRanks; ++r) {
      threads.emplace_back([&, r] {
        for (int k = 0; k < 3; ++k) buffers[r][3 * r + k] = round * 10 + r;
        ParamPieces mine = {{0, 0, 3 * r, 3, buffers[r].data() + 3 * r}};
        out[r] = x.Gather(
            r, &mine, false,
            [&](const std::vector<const ParamPieces*>& all) {
              for (uint32_t q = 0; q < kRanks; ++q) {
                if (q == r) continue;
                for (const ParamPiece& p : *all[q]) {
                  std::copy(p.data, p.data + p.bytes,
                            buffers[r].data() + p.offset);
                }
              }
              return absl::OkStatus();
            },
            Soon());
      });
    }
    for (auto& t : threads) t.join();
    for (uint32_t r = 0; r < kRanks; ++r) {
      ASSERT_TRUE(out[r].ok()) << out[r];
      for (int b = 0; b < 9; ++b) {
        EXPECT_EQ(buffers[r][b], round * 10 + b / 3) << "rank " << r;
      }
    }
  }
}

// A rank whose update failed: nobody copies, every rank hears why.
TEST(RankExchangeTest, GatherAfterAFailedUpdateCopiesNothing) {
  RankExchange x("job", 2, GradientSharding::kReplicated, true);
  std::vector<absl::Status> out(2);
  bool copied = false;
  std::vector<std::thread> threads;
  for (uint32_t r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      ParamPieces none;
      out[r] = x.Gather(
          r, &none, r == 1,
          [&](const std::vector<const ParamPieces*>&) {
            copied = true;
            return absl::OkStatus();
          },
          Soon());
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_FALSE(copied);
  for (const absl::Status& s : out) {
    EXPECT_EQ(s.code(), absl::StatusCode::kAborted);
    EXPECT_NE(s.message().find("rank(s) 1 "), std::string::npos) << s;
  }
  // A missing rank: the gather times out naming it.
  ParamPieces none;
  absl::Status late = x.Gather(
      0, &none, false,
      [](const std::vector<const ParamPieces*>&) { return absl::OkStatus(); },
      absl::Now() + absl::Milliseconds(50));
  EXPECT_EQ(late.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_NE(late.message().find("ranks 1 "), std::string::npos) << late;
}

}  // namespace
}  // namespace optimd
