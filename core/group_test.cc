#include "core/group.h"

#include <cstdint>
#include <utility>
#include <vector>

#include "gtest/gtest.h"

namespace optimd {
namespace {

using Ranges = std::vector<std::pair<uintptr_t, uintptr_t>>;

TEST(UpdatePassesTest, RangesThatOverlapNothingShareTheFirstPass) {
  // Touching is not overlapping: [0, 10) and [10, 20) share no byte.
  EXPECT_EQ(UpdatePasses(Ranges{{0, 10}, {10, 20}, {40, 50}, {20, 40}}),
            (std::vector<uint32_t>{0, 0, 0, 0}));
  EXPECT_TRUE(UpdatePasses(Ranges{}).empty());
}

TEST(UpdatePassesTest, OverlapsAreUpdatedInEntryOrder) {
  // Entries 0, 1 and 2 are linked by overlaps (0 with 1, 1 with 2), as
  // are 3 and 4 (the same memory twice); 5 stands alone.
  EXPECT_EQ(UpdatePasses(Ranges{
                {20, 30}, {5, 25}, {0, 10}, {40, 50}, {40, 50}, {60, 70}}),
            (std::vector<uint32_t>{0, 1, 2, 0, 1, 0}));
}

TEST(UpdatePassesTest, ManyTensorsOverOneMemoryTakeOnePassEach) {
  // A client may register any number of tensors over one buffer: one
  // sort, one pass each, never a quadratic walk.
  Ranges ranges(100000, {4096, 8192});
  const std::vector<uint32_t> passes = UpdatePasses(ranges);
  for (uint32_t e = 0; e < passes.size(); ++e) ASSERT_EQ(passes[e], e);
}

// Tensor of `numel` fp32 elements whose buffers start at `param` (made-up
// addresses: the builder never reads them) and at distinct addresses after
// it for the gradient and state.
TensorEntry Tensor(uintptr_t param, uintptr_t other, uint64_t numel) {
  TensorEntry t;
  t.numel = numel;
  t.param.data = reinterpret_cast<uint8_t*>(param);
  t.param.size = numel * 4;
  t.grad.data = reinterpret_cast<uint8_t*>(other);
  t.grad.size = numel * 4;
  return t;
}

TEST(BuildPlanTest, ParametersOverOneMemoryAreUpdatedInALaterPass) {
  constexpr uintptr_t kBase = uintptr_t{1} << 32;
  Group g;
  g.tensors = {Tensor(kBase, kBase + (1 << 20), 300),
               Tensor(kBase + 4096, kBase + (2 << 20), 100),
               Tensor(kBase, kBase + (3 << 20), 300)};  // tied to tensor 0
  for (uint32_t i = 0; i < g.tensors.size(); ++i) {
    g.tensors[i].name = "t" + std::to_string(i);
  }
  g.IndexTensors();
  BuildPlan(g, 64);
  const Plan& plan = g.plan;
  EXPECT_EQ(plan.pass_of_entry, (std::vector<uint32_t>{0, 0, 1}));
  ASSERT_EQ(plan.passes(), 2u);
  // Pass 0 holds entries 0 and 1, in entry order; pass 1 entry 2 alone,
  // and no task spans both.
  std::vector<uint32_t> entries_in_order;
  for (uint32_t pass = 0; pass < plan.passes(); ++pass) {
    for (uint32_t t = plan.pass_tasks[pass]; t < plan.pass_tasks[pass + 1];
         ++t) {
      for (uint32_t i = plan.tasks[t].first_item; i < plan.tasks[t].end_item;
           ++i) {
        EXPECT_EQ(plan.pass_of_entry[plan.items[i].entry], pass);
        if (entries_in_order.empty() ||
            entries_in_order.back() != plan.items[i].entry) {
          entries_in_order.push_back(plan.items[i].entry);
        }
      }
    }
  }
  EXPECT_EQ(entries_in_order, (std::vector<uint32_t>{0, 1, 2}));
  EXPECT_EQ(plan.pass_tasks.back(), plan.tasks.size());
  EXPECT_EQ(plan.items.size(), 5u + 2u + 5u);  // items of at most 64
}

TEST(BuildPlanTest, AGroupWithoutSteppableTensorsHasOneEmptyPass) {
  Group g;
  g.IndexTensors();
  BuildPlan(g, 64);
  EXPECT_EQ(g.plan.passes(), 1u);
  EXPECT_TRUE(g.plan.tasks.empty());
}

}  // namespace
}  // namespace optimd
