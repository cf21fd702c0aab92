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
