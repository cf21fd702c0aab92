#include "checkpoint/key_names.h"

#include <algorithm>
#include <set>
#include <string>

#include "core/optimizer.h"
#include "gtest/gtest.h"

namespace optimd {
namespace {

bool Has(const std::vector<std::string>& v, const std::string& s) {
  return std::find(v.begin(), v.end(), s) != v.end();
}

TEST(KeyNamesTest, SuffixesCoverEveryPieceOfState) {
  const std::vector<std::string>& suffixes = CheckpointKeySuffixes();
  for (const char* piece : {".master", ".remainder", ".moment_scales"}) {
    EXPECT_TRUE(Has(suffixes, piece)) << piece;
  }
  for (const std::string& slot : AllStateSlotNames()) {
    EXPECT_TRUE(Has(suffixes, "." + slot)) << slot;
  }
}

TEST(KeyNamesTest, NameAndItsStateKeyInOneGroupAreRefused) {
  for (const std::string& suffix : CheckpointKeySuffixes()) {
    const absl::Status s = CheckCheckpointKeys({"w", "w" + suffix}, {});
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << suffix;
    EXPECT_NE(s.message().find("'w' and 'w" + suffix + "' collide"),
              std::string::npos)
        << s;
  }
}

TEST(KeyNamesTest, CollisionsAcrossGroupsAreRefusedInEitherOrder) {
  // The new name is the registered one's state key.
  EXPECT_EQ(CheckCheckpointKeys({"w.master"}, {"w"}).code(),
            absl::StatusCode::kInvalidArgument);
  // The registered name is the new one's state key.
  const absl::Status s = CheckCheckpointKeys({"u"}, {"u.exp_avg_sq"});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("'u' and 'u.exp_avg_sq'"), std::string::npos) << s;
}

TEST(KeyNamesTest, TheHeadersKeyIsReserved) {
  const absl::Status s = CheckCheckpointKeys({"__metadata__"}, {});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("reserved"), std::string::npos) << s;
}

TEST(KeyNamesTest, NamesThatOnlyLookAlikeAreAccepted) {
  const std::set<std::string> fresh = {"w", "w.exp_avgx", "wexp_avg",
                                       "w.weight", "x.master"};
  EXPECT_TRUE(CheckCheckpointKeys(fresh, {}).ok());
  EXPECT_TRUE(CheckCheckpointKeys({"v"}, {"w", "v.bias", "vmaster"}).ok());
}

}  // namespace
}  // namespace optimd
