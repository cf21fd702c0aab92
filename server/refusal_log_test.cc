#include "server/refusal_log.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace optimd {
namespace {

TEST(RefusalLogTest, LogsUpToTheLimitThenCounts) {
  std::vector<std::string> lines;
  RefusalLog log([&](const std::string& s) { lines.push_back(s); });
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  const grpc::Status bad(grpc::StatusCode::INVALID_ARGUMENT, "lr is NaN");
  for (int i = 0; i < 100; ++i) log.Note("/optimd.v1.Optimizer/Step", bad, t0);
  ASSERT_EQ(lines.size(), size_t{RefusalLog::kLinesPerWindow});
  EXPECT_EQ(lines[0],
            "refused /optimd.v1.Optimizer/Step: INVALID_ARGUMENT: lr is NaN");
  // The next window reports what it left out, then logs again.
  log.Note("/optimd.v1.Optimizer/Step", bad, t0 + RefusalLog::kWindow);
  ASSERT_EQ(lines.size(), size_t{RefusalLog::kLinesPerWindow} + 2);
  EXPECT_EQ(lines[RefusalLog::kLinesPerWindow],
            "80 more refused calls were not logged in the last window");
}

// A burst followed by quiet: the calls left out are reported once their
// window has ended (the daemon flushes every second and at shutdown), not
// only when another call is refused.
TEST(RefusalLogTest, FlushReportsWhatAnEndedWindowLeftOut) {
  std::vector<std::string> lines;
  RefusalLog log([&](const std::string& s) { lines.push_back(s); });
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  const grpc::Status bad(grpc::StatusCode::NOT_FOUND, "no such session");
  log.Flush(t0);  // nothing refused yet: nothing to say
  EXPECT_TRUE(lines.empty());
  for (int i = 0; i < 25; ++i) log.Note("/optimd.v1.Optimizer/Step", bad, t0);
  ASSERT_EQ(lines.size(), size_t{RefusalLog::kLinesPerWindow});
  // Not while the window is open (its count may still grow).
  log.Flush(t0 + RefusalLog::kWindow - absl::Milliseconds(1));
  EXPECT_EQ(lines.size(), size_t{RefusalLog::kLinesPerWindow});
  log.Flush(t0 + RefusalLog::kWindow);
  ASSERT_EQ(lines.size(), size_t{RefusalLog::kLinesPerWindow} + 1);
  EXPECT_EQ(lines.back(),
            "5 more refused calls were not logged in the last window");
  // Said once; the next refusal opens a window and is logged.
  log.Flush(t0 + 2 * RefusalLog::kWindow);
  log.Note("/optimd.v1.Optimizer/Step", bad, t0 + 2 * RefusalLog::kWindow);
  ASSERT_EQ(lines.size(), size_t{RefusalLog::kLinesPerWindow} + 2);
  EXPECT_EQ(lines.back(),
            "refused /optimd.v1.Optimizer/Step: NOT_FOUND: no such session");
  // At shutdown, the open window's count too.
  for (int i = 0; i < 30; ++i) {
    log.Note("/optimd.v1.Optimizer/Step", bad, t0 + 2 * RefusalLog::kWindow);
  }
  log.Flush(absl::InfiniteFuture());
  EXPECT_EQ(lines.back(),
            "11 more refused calls were not logged in the last window");
}

TEST(RefusalLogTest, GrpcsOwnEmptyUnimplementedIsExplained) {
  std::vector<std::string> lines;
  RefusalLog log([&](const std::string& s) { lines.push_back(s); });
  log.Note("/optimd.v1.Optimizer/SetState",
           grpc::Status(grpc::StatusCode::UNIMPLEMENTED, ""), absl::Now());
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_NE(lines[0].find("UNIMPLEMENTED: no such method, or its request was "
                          "not received whole"),
            std::string::npos)
      << lines[0];
  EXPECT_NE(lines[0].find("--max_request_memory_bytes"), std::string::npos);
}

}  // namespace
}  // namespace optimd
