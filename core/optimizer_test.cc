#include "core/optimizer.h"

#include "gtest/gtest.h"

namespace optimd {
namespace {

TEST(OptimizerTest, NamesSlotsAndChecks) {
  for (OptimizerKind k :
       {OptimizerKind::kAdamW, OptimizerKind::kSgd, OptimizerKind::kLion}) {
    auto back = OptimizerFromName(OptimizerName(k));
    ASSERT_TRUE(back.ok());
    EXPECT_EQ(*back, k);
  }
  auto unknown = OptimizerFromName("adagrad");
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(unknown.status().message().find("adamw, sgd, lion"),
            absl::string_view::npos);

  OptimizerHyper h;
  EXPECT_EQ(StateSlotCount(h), 2);
  h.amsgrad = true;
  EXPECT_EQ(StateSlotCount(h), 3);
  EXPECT_EQ(StateSlotName(OptimizerKind::kAdamW, 2), "max_exp_avg_sq");
  EXPECT_EQ(StateSlotIndex(OptimizerKind::kAdamW, 2, "max_exp_avg_sq"), -1);
  h = OptimizerHyper();
  h.kind = OptimizerKind::kSgd;
  EXPECT_EQ(StateSlotCount(h), 0);
  h.momentum = 0.9;
  EXPECT_EQ(StateSlotCount(h), 1);
  EXPECT_EQ(StateSlotIndex(OptimizerKind::kSgd, 1, "momentum_buffer"), 0);
  EXPECT_EQ(StateSlotIndex(OptimizerKind::kSgd, 3, ""), -1);
  EXPECT_EQ(StateSlotName(OptimizerKind::kLion, 0), "exp_avg");
  EXPECT_EQ(StateSlotName(OptimizerKind::kLion, 1), "");
  EXPECT_EQ(AllStateSlotNames(),
            (std::vector<std::string>{"exp_avg", "exp_avg_sq", "max_exp_avg_sq",
                                      "momentum_buffer"}));

  // torch's argument checks.
  EXPECT_TRUE(CheckHyperparameters(h, "g").ok());
  h.nesterov = true;
  h.dampening = 0.1;
  EXPECT_FALSE(CheckHyperparameters(h, "g").ok());
  h.dampening = 0;
  EXPECT_TRUE(CheckHyperparameters(h, "g").ok());
  h.momentum = -1;
  EXPECT_FALSE(CheckHyperparameters(h, "g").ok());
  OptimizerHyper lion;
  lion.kind = OptimizerKind::kLion;
  lion.eps = -1;  // Lion has no eps: not checked
  EXPECT_TRUE(CheckHyperparameters(lion, "g").ok());
  lion.beta2 = 1.0;
  EXPECT_FALSE(CheckHyperparameters(lion, "g").ok());
}

// Every optimizer is found by its number, and names its FP8 support and
// its rules through its traits row.
TEST(OptimizerTest, KindsByNumberAndTheirRows) {
  for (OptimizerKind k :
       {OptimizerKind::kAdamW, OptimizerKind::kSgd, OptimizerKind::kLion}) {
    ASSERT_TRUE(OptimizerFromNumber(static_cast<int>(k)).has_value());
    EXPECT_EQ(*OptimizerFromNumber(static_cast<int>(k)), k);
  }
  EXPECT_FALSE(OptimizerFromNumber(3).has_value());
  EXPECT_FALSE(OptimizerFromNumber(-1).has_value());
  EXPECT_EQ(KnownOptimizerNames(), "adamw, sgd, lion");
  EXPECT_EQ(Fp8Refusal(OptimizerKind::kAdamW), nullptr);
  EXPECT_NE(Fp8Refusal(OptimizerKind::kSgd), nullptr);
  EXPECT_NE(Fp8Refusal(OptimizerKind::kLion), nullptr);
  OptimizerHyper unknown;
  unknown.kind = static_cast<OptimizerKind>(9);
  EXPECT_EQ(CheckHyperparameters(unknown, "g").code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace optimd
