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

}  // namespace
}  // namespace optimd
