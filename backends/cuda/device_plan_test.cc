#include "backends/cuda/device_plan.h"

#include <cstdint>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "core/group.h"
#include "core/layout.h"
#include "gtest/gtest.h"
#include "kernels/cuda_step_types.h"

namespace optimd {
namespace cuda {
namespace {

// The builder only computes with buffer addresses, never reads them, so the
// tensors here point at made-up addresses chosen for their alignment.
constexpr uint64_t kStreamSpan = uint64_t{1} << 20;  // bytes per stream
constexpr uint64_t kTensorSpan = 8 * kStreamSpan;    // param .. state[2]
constexpr uintptr_t kFirstAddress = uintptr_t{1} << 32;

Layout MakeLayout(DType param, DType grad, DType moments, MasterKind master,
                  OptimizerKind optimizer, uint8_t slots) {
  Layout l;
  l.param_dtype = param;
  l.grad_dtype = grad;
  l.moment_dtype = moments;
  l.master = master;
  l.optimizer = optimizer;
  l.state_slots = slots;
  return l;
}

const Layout kFp32 =
    MakeLayout(DType::kFloat32, DType::kFloat32, DType::kFloat32,
               MasterKind::kNone, OptimizerKind::kAdamW, 2);
const Layout kBf16Master =
    MakeLayout(DType::kBFloat16, DType::kBFloat16, DType::kBFloat16,
               MasterKind::kFp32, OptimizerKind::kAdamW, 2);
const Layout kRemainderAmsgrad =
    MakeLayout(DType::kBFloat16, DType::kFloat32, DType::kFloat32,
               MasterKind::kRemainder, OptimizerKind::kAdamW, 3);
const Layout kSgd =
    MakeLayout(DType::kFloat32, DType::kFloat32, DType::kFloat32,
               MasterKind::kNone, OptimizerKind::kSgd, 1);

uint8_t* At(uintptr_t address) { return reinterpret_cast<uint8_t*>(address); }

// What a test tensor looks like: `misalign` bytes are added to its
// parameter's address (so that its items have no tiles unless it is 0).
struct TensorShape {
  uint64_t numel = 0;
  Layout layout = kFp32;
  uint32_t stage = 0;
  bool grad_absent = false;
  bool frozen = false;
  uint32_t misalign = 0;
};

// Tensor `index` of a group: its buffers at made-up addresses of their own.
TensorEntry MakeTensor(uint32_t index, const TensorShape& shape) {
  TensorEntry t;
  t.name = "t" + std::to_string(index);
  t.numel = shape.numel;
  t.layout = shape.layout;
  t.stage = shape.stage;
  t.grad_absent = shape.grad_absent;
  t.frozen = shape.frozen;
  if (shape.numel == 0) return t;
  const uintptr_t base = kFirstAddress + index * kTensorSpan;
  t.param.data = At(base + shape.misalign);
  t.param.size = shape.numel * DTypeSize(shape.layout.param_dtype);
  if (shape.frozen) return t;
  t.grad.data = At(base + kStreamSpan);
  t.grad.size = shape.numel * DTypeSize(shape.layout.grad_dtype);
  const uint64_t master_bytes = shape.layout.MasterBytesPerElement();
  if (master_bytes > 0) {
    t.master =
        StateSlice(At(base + 2 * kStreamSpan), shape.numel * master_bytes);
  }
  for (int s = 0; s < shape.layout.state_slots; ++s) {
    t.state[s] = StateSlice(At(base + (3 + s) * kStreamSpan),
                            shape.numel * shape.layout.MomentBytesPerElement());
  }
  return t;
}

Group MakeGroup(const std::vector<TensorShape>& shapes,
                uint64_t item_elements) {
  Group g;
  g.id = "g";
  for (uint32_t i = 0; i < shapes.size(); ++i) {
    EXPECT_LE(shapes[i].numel * 4, kStreamSpan) << "tensors overlap";
    g.tensors.push_back(MakeTensor(i, shapes[i]));
  }
  g.IndexTensors();
  BuildPlan(g, item_elements);
  return g;
}

DevicePlan MakePlan(const Group& g, uint64_t item_elements) {
  DevicePlan plan;
  BuildDeviceTables(g, item_elements, &plan);
  return plan;
}

bool Aligned(const void* p, uint64_t begin, uint64_t element_size) {
  return p == nullptr ||
         (reinterpret_cast<uintptr_t>(p) + begin * element_size) % 16 == 0;
}

// The tiles an item must have: all its whole tiles when every stream is
// 16-byte aligned at its first element, none otherwise.
uint32_t ExpectedTiles(const DeviceItem& c, const Layout& l) {
  bool aligned = Aligned(c.param, c.begin, DTypeSize(l.param_dtype)) &&
                 Aligned(c.grad, c.begin, DTypeSize(l.grad_dtype)) &&
                 (l.MasterBytesPerElement() == 0 ||
                  Aligned(c.master, c.begin, l.MasterBytesPerElement()));
  for (const void* s : c.state) {
    aligned = aligned && Aligned(s, c.begin, DTypeSize(l.moment_dtype));
  }
  return aligned ? static_cast<uint32_t>((c.end - c.begin) / kTileElements) : 0;
}

// Every element of every steppable tensor lies in exactly one item of its
// entry; each item carries its tensor's current pointers, no elements
// while the tensor has no gradient, and the tiles its alignment allows.
void CheckItems(const Group& g, const DevicePlan& plan,
                uint64_t item_elements) {
  const Plan& host = g.plan;
  ASSERT_EQ(plan.items.size(), host.items.size());
  ASSERT_EQ(plan.item_end.size(), plan.items.size());
  ASSERT_EQ(plan.entry_items.size(), host.entries.size());
  std::vector<int> owners(plan.items.size(), 0);
  for (uint32_t e = 0; e < host.entries.size(); ++e) {
    const TensorEntry& t = g.tensors[host.tensor_index[e]];
    const TensorPointers p = t.Pointers();
    const auto [first, end] = plan.entry_items[e];
    ASSERT_LT(first, end) << "entry " << e << " has no items";
    uint64_t next = 0;  // the first element not yet covered
    for (uint32_t c = first; c < end; ++c) {
      const DeviceItem& item = plan.items[c];
      ++owners[c];
      EXPECT_EQ(item.entry, e);
      EXPECT_EQ(item.begin, next) << "a gap or an overlap in entry " << e;
      EXPECT_GT(plan.item_end[c], item.begin);
      EXPECT_LE(plan.item_end[c] - item.begin, item_elements);
      next = plan.item_end[c];
      EXPECT_EQ(item.param, p.param);
      EXPECT_EQ(item.grad, p.grad);
      EXPECT_EQ(item.master, p.master);
      for (int s = 0; s < kDeviceStateSlots; ++s) {
        EXPECT_EQ(item.state[s], p.state[s]);
      }
      EXPECT_EQ(item.end, t.grad_absent ? item.begin : plan.item_end[c]);
      EXPECT_EQ(item.tiles, ExpectedTiles(item, t.layout));
    }
    EXPECT_EQ(next, t.numel) << "entry " << e << " not covered to its end";
  }
  for (uint32_t c = 0; c < owners.size(); ++c) {
    EXPECT_EQ(owners[c], 1)
        << "item " << c << " in " << owners[c] << " entries";
  }
}

// The launches cover the item table in order, one per distinct (stage,
// layout), sorted by stage, each over items of its own stage and layout.
void CheckLaunches(const Group& g, const DevicePlan& plan) {
  uint32_t next_item = 0;
  std::pair<uint32_t, uint32_t> last = {0, 0};  // (pass, stage)
  std::set<std::pair<std::pair<uint32_t, uint32_t>, std::string>> kinds;
  for (const Launch& launch : plan.launches) {
    EXPECT_EQ(launch.first_item, next_item);
    EXPECT_GT(launch.num_items, 0u);
    const std::pair<uint32_t, uint32_t> order = {launch.pass, launch.stage};
    EXPECT_GE(order, last) << "launches not sorted by pass, then stage";
    last = order;
    EXPECT_TRUE(kinds.emplace(order, launch.layout.DebugString()).second)
        << "two launches of pass " << launch.pass << ", stage " << launch.stage
        << " and layout " << launch.layout.DebugString();
    for (uint32_t c = launch.first_item;
         c < launch.first_item + launch.num_items; ++c) {
      const uint32_t entry = plan.items[c].entry;
      EXPECT_TRUE(g.plan.layouts[entry] == launch.layout);
      EXPECT_EQ(g.tensors[g.plan.tensor_index[entry]].stage, launch.stage);
      EXPECT_EQ(g.plan.pass_of_entry[entry], launch.pass);
    }
    next_item = launch.first_item + launch.num_items;
  }
  EXPECT_EQ(next_item, plan.items.size());
}

// The whole launches cover the same items and blocks as the launches, in
// order, with no two neighbours of one layout and pass: each is a run of
// launches of its layout and pass merged.
void CheckWholeLaunches(const DevicePlan& plan) {
  size_t next = 0;  // the first launch not yet covered
  for (size_t w = 0; w < plan.whole_launches.size(); ++w) {
    const Launch& whole = plan.whole_launches[w];
    if (w > 0) {
      EXPECT_FALSE(plan.whole_launches[w - 1].layout == whole.layout &&
                   plan.whole_launches[w - 1].pass == whole.pass);
    }
    ASSERT_LT(next, plan.launches.size());
    const Launch& first = plan.launches[next];
    EXPECT_EQ(whole.first_item, first.first_item);
    uint64_t items = 0, blocks[2] = {0, 0};
    for (; next < plan.launches.size() &&
           plan.launches[next].layout == whole.layout &&
           plan.launches[next].pass == whole.pass && items < whole.num_items;
         ++next) {
      items += plan.launches[next].num_items;
      for (int t = 0; t < 2; ++t) {
        EXPECT_EQ(plan.launches[next].first_block[t],
                  whole.first_block[t] + blocks[t]);
        blocks[t] += plan.launches[next].num_blocks[t];
      }
    }
    EXPECT_EQ(items, whole.num_items);
    for (int t = 0; t < 2; ++t) EXPECT_EQ(blocks[t], whole.num_blocks[t]);
  }
  EXPECT_EQ(next, plan.launches.size()) << "launches not covered";
}

// Each table's blocks split each launch's items into consecutive runs of
// at most kMaxItemsPerBlock items whose tile and scalar counts are the
// sums of their items'. With `sized`, also that each block is the
// shortest run reaching the table's target size or kMaxItemsPerBlock
// items (true as built; a refresh keeps the blocks' shapes).
void CheckBlocks(const DevicePlan& plan, uint64_t item_elements, bool sized) {
  for (int t = 0; t < 2; ++t) {
    const std::vector<DeviceBlock>& blocks = plan.tables[t].blocks;
    uint32_t next_block = 0;
    for (const Launch& launch : plan.launches) {
      const uint64_t target =
          t == 0 ? UpdateBlockElements(launch.layout, item_elements)
                 : item_elements * kStatsBlockFactor;
      EXPECT_EQ(launch.first_block[t], next_block);
      EXPECT_GT(launch.num_blocks[t], 0u);
      uint32_t next_item = launch.first_item;
      const uint32_t end_block = launch.first_block[t] + launch.num_blocks[t];
      ASSERT_LE(end_block, blocks.size());
      for (uint32_t b = launch.first_block[t]; b < end_block; ++b) {
        const DeviceBlock& block = blocks[b];
        EXPECT_EQ(block.first, next_item);
        EXPECT_GT(block.end, block.first);
        EXPECT_LE(block.end - block.first, kMaxItemsPerBlock);
        uint64_t tiles = 0, scalars = 0, elements = 0, before_last = 0;
        for (uint32_t c = block.first; c < block.end; ++c) {
          const DeviceItem& item = plan.items[c];
          before_last = elements;
          elements += item.end - item.begin;
          tiles += item.tiles;
          scalars += item.end - item.begin - item.tiles * kTileElements;
        }
        EXPECT_EQ(block.tiles, tiles) << "table " << t << " block " << b;
        EXPECT_EQ(block.scalars, scalars) << "table " << t << " block " << b;
        if (sized) {
          EXPECT_LT(before_last, target) << "block " << b << " too large";
          if (b + 1 < end_block &&
              block.end - block.first < kMaxItemsPerBlock) {
            EXPECT_GE(elements, target) << "block " << b << " closed early";
          }
        }
        next_item = block.end;
      }
      EXPECT_EQ(next_item, launch.first_item + launch.num_items);
      next_block = end_block;
    }
    EXPECT_EQ(next_block, blocks.size()) << "table " << t;
  }
}

// Lists the entries whose tensors have no gradient, after their count.
void CheckAbsent(const Group& g, const DevicePlan& plan) {
  std::vector<uint32_t> expected = {0};
  for (uint32_t e = 0; e < g.plan.entries.size(); ++e) {
    if (g.tensors[g.plan.tensor_index[e]].grad_absent) expected.push_back(e);
  }
  expected[0] = static_cast<uint32_t>(expected.size() - 1);
  EXPECT_EQ(AbsentEntries(plan), expected);
}

void CheckPlan(const Group& g, const DevicePlan& plan, uint64_t item_elements,
               bool sized = true) {
  CheckItems(g, plan, item_elements);
  CheckLaunches(g, plan);
  CheckBlocks(plan, item_elements, sized);
  CheckWholeLaunches(plan);
  CheckAbsent(g, plan);
}

TEST(DevicePlanTest, NoSteppableTensors) {
  std::vector<TensorShape> shapes(3);
  shapes[0].numel = 0;
  shapes[1].numel = 1000;
  shapes[1].frozen = true;
  shapes[2].numel = 0;
  shapes[2].layout = kSgd;
  const Group g = MakeGroup(shapes, 4096);
  const DevicePlan plan = MakePlan(g, 4096);
  EXPECT_TRUE(plan.items.empty());
  EXPECT_TRUE(plan.launches.empty());
  EXPECT_TRUE(plan.tables[0].blocks.empty());
  EXPECT_TRUE(plan.tables[1].blocks.empty());
  CheckPlan(g, plan, 4096);
}

TEST(DevicePlanTest, LargeTensorsSplitIntoItems) {
  for (uint64_t item : {uint64_t{256}, uint64_t{4096}}) {
    SCOPED_TRACE(item);
    std::vector<TensorShape> shapes(4);
    shapes[0].numel = 10 * item;       // whole items
    shapes[1].numel = 10 * item + 17;  // a scalar tail
    shapes[2].numel = 3 * item + 300;  // tiles and scalars in the tail
    shapes[3].numel = 5 * item + 1;
    shapes[3].misalign = 4;  // no tiles at all
    const Group g = MakeGroup(shapes, item);
    const DevicePlan plan = MakePlan(g, item);
    CheckPlan(g, plan, item);
    ASSERT_EQ(plan.launches.size(), 1u);
    const auto [first, end] = plan.entry_items[3];
    for (uint32_t c = first; c < end; ++c) EXPECT_EQ(plan.items[c].tiles, 0u);
    EXPECT_EQ(plan.items[plan.entry_items[0].first].tiles,
              item / kTileElements);
  }
}

TEST(DevicePlanTest, ManySmallTensorsShareWorkBlocks) {
  std::vector<TensorShape> shapes;
  for (uint32_t i = 0; i < 2000; ++i) {
    TensorShape s;
    s.numel = 1 + (i * 37) % 700;  // mostly below one tile
    s.misalign = (i % 5 == 0) ? 8 : 0;
    shapes.push_back(s);
  }
  const Group g = MakeGroup(shapes, 4096);
  const DevicePlan plan = MakePlan(g, 4096);
  CheckPlan(g, plan, 4096);
  // Work blocks full by item count, not by elements, exist.
  bool full = false;
  for (const DeviceBlock& b : plan.tables[1].blocks) {
    full |= b.end - b.first == kMaxItemsPerBlock;
  }
  EXPECT_TRUE(full);
}

TEST(DevicePlanTest, OneLaunchPerStageAndLayout) {
  const Layout layouts[] = {kFp32, kBf16Master, kRemainderAmsgrad, kSgd};
  std::vector<TensorShape> shapes;
  for (uint32_t i = 0; i < 60; ++i) {
    TensorShape s;
    s.numel = 100 + (i * 1237) % 20000;
    s.layout = layouts[i % 4];  // layouts and stages interleaved
    s.stage = (i / 4) % 3;
    s.misalign = (i % 7 == 3) ? 2 : 0;
    shapes.push_back(s);
  }
  const Group g = MakeGroup(shapes, 4096);
  const DevicePlan plan = MakePlan(g, 4096);
  CheckPlan(g, plan, 4096);
  EXPECT_EQ(plan.launches.size(), 12u);  // 3 stages x 4 layouts
  // Interleaved layouts: no two neighbouring launches share one.
  EXPECT_EQ(plan.whole_launches.size(), 12u);
  // 16-bit moments: update blocks twice as large.
  EXPECT_EQ(UpdateBlockElements(kBf16Master, 4096), 8192u);
  EXPECT_EQ(UpdateBlockElements(kFp32, 4096), 4096u);
}

// One layout over several stages: plain steps run it as one launch.
TEST(DevicePlanTest, StagesOfOneLayoutMakeOneWholeLaunch) {
  std::vector<TensorShape> shapes;
  for (uint32_t i = 0; i < 64; ++i) {
    TensorShape s;
    s.numel = 5000 + i;
    s.stage = i / 4;
    shapes.push_back(s);
  }
  const Group g = MakeGroup(shapes, 4096);
  const DevicePlan plan = MakePlan(g, 4096);
  CheckPlan(g, plan, 4096);
  EXPECT_EQ(plan.launches.size(), 16u);
  ASSERT_EQ(plan.whole_launches.size(), 1u);
  EXPECT_EQ(plan.whole_launches[0].num_items, plan.items.size());
  EXPECT_EQ(plan.whole_launches[0].num_blocks[0], plan.tables[0].blocks.size());
}

// Two parameters over one memory (tied through .data, at stages 1 and
// 0): the later one's items are launched after the earlier one's, in a
// launch of their own, plain or staged.
TEST(DevicePlanTest, ParametersOverOneMemoryAreLaunchedOneAfterTheOther) {
  std::vector<TensorShape> shapes(4);
  for (uint32_t i = 0; i < shapes.size(); ++i) {
    shapes[i].numel = 5000 + i;
    shapes[i].stage = i == 1 ? 1 : 0;
  }
  Group g;
  g.id = "g";
  for (uint32_t i = 0; i < shapes.size(); ++i) {
    g.tensors.push_back(MakeTensor(i, shapes[i]));
  }
  g.tensors[3].param.data = g.tensors[1].param.data;
  g.IndexTensors();
  BuildPlan(g, 4096);
  const DevicePlan plan = MakePlan(g, 4096);
  CheckPlan(g, plan, 4096);
  ASSERT_EQ(plan.whole_launches.size(), 2u);
  EXPECT_EQ(plan.whole_launches[0].pass, 0u);
  EXPECT_EQ(plan.whole_launches[1].pass, 1u);
  const Launch& later = plan.whole_launches[1];
  for (uint32_t c = later.first_item; c < later.first_item + later.num_items;
       ++c) {
    EXPECT_EQ(plan.items[c].entry, 3u);
  }
  // Launches by pass first: entry 3 (stage 0) after entry 1 (stage 1).
  ASSERT_EQ(plan.launches.size(), 3u);
  EXPECT_EQ(plan.launches.back().pass, 1u);
  EXPECT_EQ(plan.launches.back().stage, 0u);
}

TEST(DevicePlanTest, AbsentGradientsHaveEmptyItems) {
  std::vector<TensorShape> shapes;
  for (uint32_t i = 0; i < 40; ++i) {
    TensorShape s;
    s.numel = 300 + i * 500;
    s.grad_absent = i % 3 == 1;
    s.frozen = i % 11 == 5;
    shapes.push_back(s);
  }
  const Group g = MakeGroup(shapes, 4096);
  const DevicePlan plan = MakePlan(g, 4096);
  CheckPlan(g, plan, 4096);
  const std::vector<uint32_t> absent = AbsentEntries(plan);
  ASSERT_GT(absent[0], 0u);
  for (uint32_t k = 1; k < absent.size(); ++k) {
    const auto [first, end] = plan.entry_items[absent[k]];
    for (uint32_t c = first; c < end; ++c) {
      EXPECT_EQ(plan.items[c].end, plan.items[c].begin);
      EXPECT_EQ(plan.items[c].tiles, 0u);
    }
  }
}

// Moves some tensors' buffers and gradients, as Session::UpdateBuffers
// does, and refreshes their entries.
TEST(DevicePlanTest, RefreshedEntriesMatchTheirTensors) {
  std::vector<TensorShape> shapes;
  for (uint32_t i = 0; i < 300; ++i) {
    TensorShape s;
    s.numel = 50 + (i * 389) % 9000;
    s.layout = i % 2 == 0 ? kFp32 : kBf16Master;
    s.grad_absent = i % 10 == 3;
    shapes.push_back(s);
  }
  Group g = MakeGroup(shapes, 4096);
  DevicePlan plan = MakePlan(g, 4096);
  const std::vector<DeviceBlock> blocks_before = plan.tables[0].blocks;
  std::vector<uint32_t> moved;
  for (uint32_t i = 0; i < shapes.size(); i += 7) {
    TensorEntry& t = g.tensors[i];
    t.param.data += (i % 3 == 0) ? 4 : 16;  // some lose their tiles
    t.grad_absent = !t.grad_absent;
    moved.push_back(g.plan.entry_of_tensor[i]);
  }
  const TableChanges changes = RefreshEntries(g, moved, &plan);
  EXPECT_TRUE(changes.absence_changed);
  for (uint32_t e = 0; e < g.plan.entries.size(); ++e) {
    EXPECT_EQ(g.plan.entries[e].param,
              g.tensors[g.plan.tensor_index[e]].Pointers().param);
  }
  CheckPlan(g, plan, 4096, /*sized=*/false);
  // Shapes kept: the step graphs stay valid.
  ASSERT_EQ(plan.tables[0].blocks.size(), blocks_before.size());
  for (size_t b = 0; b < blocks_before.size(); ++b) {
    EXPECT_EQ(plan.tables[0].blocks[b].first, blocks_before[b].first);
    EXPECT_EQ(plan.tables[0].blocks[b].end, blocks_before[b].end);
  }
  // The copies cover every moved entry's items and the blocks over them.
  auto covered = [](const std::vector<std::pair<uint32_t, uint32_t>>& ranges,
                    uint32_t i) {
    for (const auto& [first, end] : ranges) {
      if (first <= i && i < end) return true;
    }
    return false;
  };
  for (uint32_t e : moved) {
    const auto [first, end] = plan.entry_items[e];
    for (uint32_t c = first; c < end; ++c) {
      EXPECT_TRUE(covered(changes.items, c)) << "item " << c;
      for (int t = 0; t < 2; ++t) {
        const std::vector<DeviceBlock>& blocks = plan.tables[t].blocks;
        for (uint32_t b = 0; b < blocks.size(); ++b) {
          if (blocks[b].first <= c && c < blocks[b].end) {
            EXPECT_TRUE(covered(changes.blocks[t], b))
                << "table " << t << " block " << b;
          }
        }
      }
    }
  }
  // Pointers alone: no absence changes.
  const TableChanges same = RefreshEntries(g, moved, &plan);
  EXPECT_FALSE(same.absence_changed);
}

// FP8 parameters: each listed once per launch, in launch order, with the
// running count of scaling units; the whole launches merge their ranges.
TEST(DevicePlanTest, Fp8ParametersAreListedWithTheirUnits) {
  Layout fp8 = MakeLayout(DType::kFloat8E4M3, DType::kBFloat16, DType::kFloat32,
                          MasterKind::kFp32, OptimizerKind::kAdamW, 2);
  fp8.fp8_recipe = Fp8Recipe::kBlock1x128;
  Layout mx = fp8;
  mx.fp8_recipe = Fp8Recipe::kMxfp8;
  std::vector<TensorShape> shapes(5);
  shapes[0] = {10000, fp8};
  shapes[1] = {300, kFp32};
  shapes[2] = {5000, mx};
  shapes[3] = {100000, fp8};
  shapes[4] = {20000, mx, /*stage=*/1};
  Group g = MakeGroup(shapes, 4096);
  // Rows of 100 columns (ragged units) but for the last, of one row.
  for (TensorEntry& t : g.tensors) {
    t.shape = t.numel == 300 || t.numel == 20000
                  ? std::vector<uint64_t>{t.numel}
                  : std::vector<uint64_t>{t.numel / 100, 100};
  }
  BuildPlan(g, 4096, /*fp8_whole_units=*/false);
  const DevicePlan plan = MakePlan(g, 4096);
  ASSERT_EQ(plan.fp8.size(), 4u);
  uint64_t units = 0;
  uint32_t listed = 0;
  for (const Launch& l : plan.launches) {
    EXPECT_EQ(l.fp8_first, listed);
    uint64_t launch_units = 0;
    for (uint32_t i = l.fp8_first; i < l.fp8_first + l.fp8_count; ++i) {
      const DeviceFp8Tensor& t = plan.fp8[i];
      EXPECT_EQ(t.first_unit, units);
      EXPECT_EQ(g.plan.layouts[t.entry], l.layout);
      EXPECT_EQ(t.param, g.plan.entries[t.entry].param);
      units += t.geometry.Units();
      launch_units += t.geometry.Units();
    }
    EXPECT_EQ(l.fp8_units, launch_units);
    listed += l.fp8_count;
  }
  EXPECT_EQ(units, 100u + 200 + 1000 + 625);
  // Ragged columns (all but the last MXFP8 tensor) take the amax pass, with
  // their amax words in plan order.
  uint64_t words = 0;
  for (const DeviceFp8Tensor& t : plan.fp8) {
    EXPECT_EQ(t.amax_first, words);
    if (HasEncodePass(t.pass)) words += t.geometry.Units();
  }
  EXPECT_EQ(words, 100u + 200 + 1000);
  EXPECT_EQ(plan.fp8_amax_words, words);
  EXPECT_EQ(plan.fp8.back().pass, Fp8Pass::kFused);
  uint64_t launch_words = 0;
  for (const Launch& l : plan.whole_launches) launch_words += l.fp8_amax_words;
  EXPECT_EQ(launch_words, words);
  uint32_t whole = 0;
  for (const Launch& l : plan.whole_launches) whole += l.fp8_count;
  EXPECT_EQ(whole, 4u);
}

// 128x128 blocks of several rows: one unit task per unit, pointing at the
// tensor's first item; the update's work blocks leave the tensor's items
// out (the statistics pass keeps them), and it has no amax words.
TEST(DevicePlanTest, UnitWalkedParametersHaveUnitTasksAndNoUpdateBlocks) {
  Layout fp8 = MakeLayout(DType::kFloat8E4M3, DType::kBFloat16, DType::kFloat32,
                          MasterKind::kFp32, OptimizerKind::kAdamW, 2);
  fp8.fp8_recipe = Fp8Recipe::kBlock128x128;
  std::vector<TensorShape> shapes = {
      {300 * 256, fp8}, {5000, fp8}, {130 * 128, fp8}};
  Group g = MakeGroup(shapes, 4096);
  g.tensors[0].shape = {300, 256};
  g.tensors[1].shape = {5000};
  g.tensors[2].shape = {130, 128};
  BuildPlan(g, 4096, /*fp8_whole_units=*/false);
  const DevicePlan plan = MakePlan(g, 4096);
  ASSERT_EQ(plan.fp8.size(), 3u);
  EXPECT_EQ(plan.fp8[0].pass, Fp8Pass::kUnitWalk);
  EXPECT_EQ(plan.fp8[1].pass, Fp8Pass::kFused);
  EXPECT_EQ(plan.fp8[2].pass, Fp8Pass::kUnitWalk);
  EXPECT_EQ(plan.fp8_amax_words, 0u);
  // 3 x 2 units, then 2 x 1.
  ASSERT_EQ(plan.unit_tasks.size(), 8u);
  for (uint32_t u = 0; u < 8; ++u) {
    const uint32_t entry = u < 6 ? plan.fp8[0].entry : plan.fp8[2].entry;
    EXPECT_EQ(plan.unit_tasks[u].item, plan.entry_items[entry].first) << u;
    EXPECT_EQ(plan.unit_tasks[u].unit, u < 6 ? u : u - 6) << u;
  }
  ASSERT_EQ(plan.whole_launches.size(), 1u);
  const Launch& l = plan.whole_launches[0];
  EXPECT_EQ(l.num_unit_tasks, 8u);
  const std::vector<bool> walked_by_item = {false, true, false};
  for (int t = 0; t < 2; ++t) {
    std::vector<bool> seen(3, false);
    for (uint32_t b = l.first_block[t]; b < l.first_block[t] + l.num_blocks[t];
         ++b) {
      const DeviceBlock& blk = plan.tables[t].blocks[b];
      for (uint32_t c = blk.first; c < blk.end; ++c) {
        seen[plan.items[c].entry] = true;
      }
    }
    for (uint32_t e = 0; e < 3; ++e) {
      EXPECT_EQ(seen[e], t == 1 || walked_by_item[e]) << t << " " << e;
    }
  }
}

// One pass where the update's warp blocks of 256 elements hold whole
// units, else the amax in the update and an encode pass.
TEST(DevicePlanTest, Fp8PassFollowsTheShapeOfTheUnits) {
  const auto pass = [](Fp8Recipe r, std::vector<uint64_t> shape,
                       uint64_t item_step) {
    uint64_t n = 1;
    for (uint64_t d : shape) n *= d;
    return ChooseFp8Pass(Fp8Geometry::Of(r, n, shape), item_step);
  };
  using R = Fp8Recipe;
  EXPECT_EQ(pass(R::kBlock1x128, {300, 256}, 4096), Fp8Pass::kFused);
  EXPECT_EQ(pass(R::kBlock1x128, {300, 200}, 4096), Fp8Pass::kElementAmax);
  EXPECT_EQ(pass(R::kBlock1x128, {300, 256}, 64), Fp8Pass::kElementAmax);
  EXPECT_EQ(pass(R::kMxfp8, {3, 96}, 4096), Fp8Pass::kFused);
  EXPECT_EQ(pass(R::kMxfp8, {3, 100}, 4096), Fp8Pass::kElementAmax);
  EXPECT_EQ(pass(R::kBlock128x128, {12800}, 4096), Fp8Pass::kFused);
  // One row: units are consecutive whatever its length, the last clipped.
  EXPECT_EQ(pass(R::kBlock1x128, {1000000}, 4096), Fp8Pass::kFused);
  EXPECT_EQ(pass(R::kBlock128x128, {1000000}, 4096), Fp8Pass::kFused);
  EXPECT_EQ(pass(R::kMxfp8, {1, 100}, 4096), Fp8Pass::kFused);
  EXPECT_EQ(pass(R::kBlock1x128, {1000000}, 64), Fp8Pass::kElementAmax);
  // 128x128 blocks of several rows: walked unit by unit, whatever the
  // items' starts.
  EXPECT_EQ(pass(R::kBlock128x128, {257, 384}, 4096), Fp8Pass::kUnitWalk);
  EXPECT_EQ(pass(R::kBlock128x128, {2, 128}, 64), Fp8Pass::kUnitWalk);
  EXPECT_EQ(pass(R::kBlock128x128, {257, 200}, 4096), Fp8Pass::kElementAmax);
  EXPECT_EQ(pass(R::kTensor, {257, 384}, 4096), Fp8Pass::kTensorAmax);
}

}  // namespace
}  // namespace cuda
}  // namespace optimd
