#include "core/state_shard.h"

#include <cstdint>
#include <vector>

#include "gtest/gtest.h"

namespace optimd {
namespace {

// Every element of the flat space is owned by exactly one rank, in order.
TEST(StateShardTest, RanksCoverTheFlatSpaceOnceInOrder) {
  const std::vector<uint64_t> numels = {37, 0, 528, 5, 84, 1};
  for (uint32_t world : {1u, 2u, 3u, 7u, 1000u}) {
    std::vector<int> owner(655, -1);
    uint64_t total_count = 0;
    for (uint32_t r = 0; r < world; ++r) {
      const std::vector<ShardRange> parts = PartitionGroup(numels, r, world);
      ASSERT_EQ(parts.size(), numels.size());
      uint64_t start = 0;
      for (size_t i = 0; i < numels.size(); ++i) {
        ASSERT_LE(parts[i].begin + parts[i].count, numels[i]);
        for (uint64_t k = 0; k < parts[i].count; ++k) {
          const uint64_t flat = start + parts[i].begin + k;
          ASSERT_EQ(owner[flat], -1) << "element " << flat << " owned twice";
          owner[flat] = static_cast<int>(r);
        }
        total_count += parts[i].count;
        start += numels[i];
      }
    }
    EXPECT_EQ(total_count, 655u);
    for (size_t f = 1; f < owner.size(); ++f) {
      ASSERT_LE(owner[f - 1], owner[f])
          << "ranges are contiguous in rank order";
    }
  }
}

// PartitionAll lists exactly the parts PartitionGroup gives each rank.
TEST(StateShardTest, PartitionAllAgreesWithEachRanksPartition) {
  const std::vector<uint64_t> numels = {37, 0, 528, 5, 84, 1, 0};
  for (uint32_t world : {1u, 2u, 3u, 7u, 1000u}) {
    std::vector<OwnedPart> want;
    for (uint32_t r = 0; r < world; ++r) {
      const auto parts = PartitionGroup(numels, r, world);
      for (uint32_t i = 0; i < parts.size(); ++i) {
        if (parts[i].count > 0) want.push_back(OwnedPart{r, i, parts[i]});
      }
    }
    const std::vector<OwnedPart> got = PartitionAll(numels, world);
    ASSERT_EQ(got.size(), want.size()) << "world " << world;
    for (size_t k = 0; k < got.size(); ++k) {
      EXPECT_EQ(got[k].rank, want[k].rank);
      EXPECT_EQ(got[k].tensor, want[k].tensor);
      EXPECT_EQ(got[k].range.begin, want[k].range.begin);
      EXPECT_EQ(got[k].range.count, want[k].range.count);
    }
  }
  EXPECT_TRUE(PartitionAll({0, 0}, 4).empty());
}

TEST(StateShardTest, TwoRanksSplitATensorAtTheMiddle) {
  // 10 + 4 + 6 = 20 elements: rank 0 owns [0, 10), rank 1 [10, 20).
  const std::vector<uint64_t> numels = {10, 4, 6};
  const auto r0 = PartitionGroup(numels, 0, 2);
  const auto r1 = PartitionGroup(numels, 1, 2);
  EXPECT_EQ(r0[0].begin, 0u);
  EXPECT_EQ(r0[0].count, 10u);
  EXPECT_EQ(r0[1].count, 0u);
  EXPECT_EQ(r1[0].count, 0u);
  EXPECT_EQ(r1[1].count, 4u);
  EXPECT_EQ(r1[2].count, 6u);
  // 21 elements: rank 0 owns [0, 10), rank 1 [10, 21); 7 + 7 + 7 splits
  // the second tensor at its element 3.
  const auto s0 = PartitionGroup({7, 7, 7}, 0, 2);
  const auto s1 = PartitionGroup({7, 7, 7}, 1, 2);
  EXPECT_EQ(s0[1].begin, 0u);
  EXPECT_EQ(s0[1].count, 3u);
  EXPECT_EQ(s1[1].begin, 3u);
  EXPECT_EQ(s1[1].count, 4u);
}

TEST(StateShardTest, ShardGroupSpecNarrowsRegionsAndDropsShapes) {
  GroupSpec spec;
  spec.id = "g";
  TensorSpec t;
  t.name = "w";
  t.numel = 12;
  t.shape = {3, 4};
  t.param_dtype = DType::kBFloat16;
  t.param.kind = BufferHandle::Kind::kSharedMemory;
  t.param.offset = 64;
  t.param.size = 24;
  t.grad_dtype = DType::kFloat32;
  t.grad.kind = BufferHandle::Kind::kSharedMemory;
  t.grad.offset = 128;
  t.grad.size = 48;
  spec.tensors.push_back(t);
  std::vector<ShardRange> ranges;
  auto sliced = ShardGroupSpec(spec, 1, 3, &ranges);
  ASSERT_TRUE(sliced.ok()) << sliced.status();
  const TensorSpec& s = sliced->tensors[0];
  EXPECT_EQ(ranges[0].begin, 4u);
  EXPECT_EQ(s.numel, 4u);
  EXPECT_TRUE(s.shape.empty());
  EXPECT_EQ(s.param.offset, 64u + 8u);
  EXPECT_EQ(s.param.size, 8u);
  EXPECT_EQ(s.grad.offset, 128u + 16u);
  EXPECT_EQ(s.grad.size, 16u);

  spec.tensors[0].grad.size = 40;  // not the whole tensor
  auto bad = ShardGroupSpec(spec, 0, 2, &ranges);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("tensor 'w': grad buffer is 40"),
            std::string::npos);
}

// FP8 parameters' scaling units span rows and blocks of the whole tensor,
// which a rank's flat part would cut: refused, naming the tensor.
TEST(StateShardTest, ShardGroupSpecRefusesFp8Parameters) {
  GroupSpec spec;
  spec.id = "g";
  TensorSpec t;
  t.name = "w8";
  t.numel = 256;
  t.shape = {2, 128};
  t.param_dtype = DType::kFloat8E4M3;
  t.fp8_recipe = Fp8Recipe::kBlock1x128;
  t.grad_dtype = DType::kBFloat16;
  spec.tensors.push_back(t);
  std::vector<ShardRange> ranges;
  auto bad = ShardGroupSpec(spec, 0, 2, &ranges);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("tensor 'w8': FP8 parameters"),
            std::string::npos)
      << bad.status();
  EXPECT_NE(bad.status().message().find("shard_state"), std::string::npos);
}

}  // namespace
}  // namespace optimd
