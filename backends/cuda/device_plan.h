// The CUDA backend's plan of a group, as the host builds it: the group's
// plan items as an item table (kernels/cuda_step_types.h), work blocks over
// the items, and one launch per (stage, layout), with the device copies of
// those tables beside them. Building and refreshing the host tables makes
// no CUDA call; device_plan_memory.h uploads them. Plain C++: no
// CUDA headers, so that the builder is tested on machines without a GPU.
// Not thread-safe: a plan is built and changed only under its session's
// lock (core/group.h).
#ifndef OPTIMD_BACKENDS_CUDA_DEVICE_PLAN_H_
#define OPTIMD_BACKENDS_CUDA_DEVICE_PLAN_H_

#include <cstdint>
#include <utility>
#include <vector>

#include "core/buffer.h"
#include "core/group.h"
#include "core/layout.h"
#include "core/step_types.h"
#include "kernels/cuda_step_types.h"

namespace optimd {
namespace cuda {

// Work blocks over items of one layout. The update's work blocks hold
// about item_elements elements, twice that with 16-bit or block8 moments
// (fewer bytes per element); the statistics pass, which reads one stream where
// the update reads four or more, walks work blocks kStatsBlockFactor times
// larger, so that starting a thread block costs it as little relative to
// its bytes. All three measured on the H200 (bench/RESULTS.md).
struct BlockTable {
  std::vector<DeviceBlock> blocks;
  StateStorage blocks_d;
};
constexpr uint64_t kStatsBlockFactor = 8;

uint64_t UpdateBlockElements(const Layout& l, uint64_t item_elements);

// One kernel launch of a step: the items of the plan's tensors of one
// (stage, layout) pair, and their work blocks in each block table.
struct Launch {
  Layout layout;
  uint32_t stage = 0;  // of its tensors (TensorEntry::stage)
  uint32_t pass = 0;   // of its tensors' entries (Plan::pass_of_entry)
  uint32_t first_item = 0;
  uint32_t num_items = 0;
  uint32_t first_block[2] = {0, 0};  // [0]: update, [1]: statistics
  uint32_t num_blocks[2] = {0, 0};
  // FP8 parameters (layout.fp8_recipe): DevicePlan::fp8[fp8_first ..
  // + fp8_count), holding fp8_units scaling units; the amax words
  // [fp8_amax_first, + fp8_amax_words) of those written by an encode pass
  // after the update (Fp8Pass).
  uint32_t fp8_first = 0;
  uint32_t fp8_count = 0;
  uint64_t fp8_units = 0;
  uint64_t fp8_amax_first = 0;
  uint64_t fp8_amax_words = 0;
  // The unit tasks of its kUnitWalk parameters: DevicePlan::unit_tasks
  // [first_unit_task, + num_unit_tasks). The update's work blocks leave
  // those parameters' items out.
  uint32_t first_unit_task = 0;
  uint32_t num_unit_tasks = 0;
};

// The device-resident plan of one group. items: as in device memory;
// item_end[c]: the end of item c's element range (its `end` is `begin`
// while its tensor has no gradient); entry_items[e]: the items [first,
// end) of plan entry e, consecutive since an entry has one layout;
// tables[0]: the update's work blocks, tables[1]: the statistics pass's
// (one partial sum each).
struct DevicePlan : BackendPlan {
  uint64_t id = 0;  // unique within the backend
  std::vector<DeviceItem> items;
  std::vector<uint64_t> item_end;
  std::vector<std::pair<uint32_t, uint32_t>> entry_items;
  std::vector<Launch> launches;
  // The same items and blocks in fewer, larger launches: each run of
  // consecutive launches of one layout and pass merged into one (stages
  // ignored).
  // The statistics pass and plain steps use them: every launch costs a
  // few tens of microseconds beyond its bytes, and a small one does not
  // fill the device. Same blocks, so the same partial sums and bits.
  std::vector<Launch> whole_launches;
  BlockTable tables[2];
  // The plan's FP8 parameters in launch order (Launch::fp8_first), and
  // their device copy; the amax words of those with an encode pass
  // (DeviceFp8Tensor::amax_first), fp8_amax_words in all.
  std::vector<DeviceFp8Tensor> fp8;
  StateStorage fp8_d;
  uint64_t fp8_amax_words = 0;
  StateStorage fp8_amax_d;
  // One Fp8Prediction per kTensorAmax parameter (DeviceFp8Tensor::
  // prediction), zeroed: kept from step to step for the plan's life.
  StateStorage fp8_predictions_d;
  // One per unit of each kUnitWalk parameter, in launch order
  // (Launch::first_unit_task), and their device copy.
  std::vector<UnitTask> unit_tasks;
  StateStorage unit_tasks_d;
  StateStorage items_d, partials_d, state_d, scalars_d;
  // Per entry, the group's applied steps it missed (no gradient); advanced
  // by the commit kernel for the entries listed in absent_d ([0]: count,
  // then entries), whose host copy is `absent`.
  StateStorage missed_d, absent_d;
  std::vector<uint32_t> absent;
};

// The CUDA plan of `group`: PrepareGroup sets it on every group this
// backend steps, and no other backend sees those groups.
inline DevicePlan* PlanOf(const Group& group) {
  return static_cast<DevicePlan*>(group.backend_plan.get());
}

// Fills the host tables of `plan` (items, item_end, entry_items,
// launches, the blocks of both tables) from `group.plan`, which BuildPlan
// made with the same `item_elements`.
void BuildDeviceTables(const Group& group, uint64_t item_elements,
                       DevicePlan* plan);

// `launches` with each run of consecutive launches of one layout and
// update pass merged
// (their items and blocks are adjacent in the tables: AppendLaunch appends
// them in order).
std::vector<Launch> WholeLaunches(const std::vector<Launch>& launches);

// What RefreshEntries changed in a plan's host tables: sorted, merged
// [first, end) ranges of plan.items and of each table's blocks, for the
// copies that bring the device's tables up to date, and whether some entry
// gained or lost its gradient (the absent list then changes).
struct TableChanges {
  std::vector<std::pair<uint32_t, uint32_t>> items;
  std::vector<std::pair<uint32_t, uint32_t>> blocks[2];
  bool absence_changed = false;
};

// Points plan entries `entries` of `group` (group.plan.entries and the
// items of `plan`) at their tensors' current buffers, and recounts the
// work blocks holding their items.
TableChanges RefreshEntries(Group& group, const std::vector<uint32_t>& entries,
                            DevicePlan* plan);

// The plan's entries without a gradient: [0] their count, then the entries.
std::vector<uint32_t> AbsentEntries(const DevicePlan& plan);

// The work of one launch over block table `table`, in the device copies.
Work LaunchWork(const DevicePlan& plan, const Launch& launch, int table);

// The pieces of the builder, each checked by device_plan_test.
// How an FP8 parameter of geometry `g` is requantized (Fp8Pass) when every
// one of its items starts at a multiple of `item_step` elements.
Fp8Pass ChooseFp8Pass(const Fp8Geometry& g, uint64_t item_step);

// Tiles of an item: whole tiles when every stream is 16-byte aligned at
// the item's first element (tiles access them in 8- or 16-byte pieces),
// else none.
uint32_t ItemTiles(const DeviceItem& item, const Layout& layout);
// A block's totals from its items.
void CountBlock(const std::vector<DeviceItem>& items, DeviceBlock* b);
// Appends work blocks over items [first, end): consecutive items of about
// `target` elements in all, and at most kMaxItemsPerBlock of them.
void AppendBlocks(const std::vector<DeviceItem>& items, uint32_t first,
                  uint32_t end, uint64_t target, std::vector<DeviceBlock>* out);

}  // namespace cuda
}  // namespace optimd

#endif  // OPTIMD_BACKENDS_CUDA_DEVICE_PLAN_H_
