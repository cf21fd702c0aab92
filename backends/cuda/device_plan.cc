#include "backends/cuda/device_plan.h"

#include <algorithm>
#include <map>
#include <utility>
#include <vector>

namespace optimd {
namespace cuda {
namespace {

// Ranges of table rows at most this many rows apart are copied as one.
constexpr uint32_t kCopyGap = 16;

// An item's stream pointers: its tensor's. An FP8 parameter's items keep
// `scales`: it points at the tensor's DeviceFp8Tensor (UploadPlan).
void SetStreams(const TensorPointers& p, DeviceItem* c) {
  c->param = p.param;
  c->grad = p.grad;
  c->master = p.master;
  for (int k = 0; k < kDeviceStateSlots; ++k) c->state[k] = p.state[k];
  if (p.fp8.recipe == Fp8Recipe::kNone) c->scales = p.scales;
}

// Item [begin, end) of a tensor with pointers `p`. A tensor without a
// gradient keeps its items with no elements, so every kernel passes over
// them (and the work blocks' shapes, hence the step graphs, stay the same).
void FillItem(const TensorPointers& p, uint32_t entry, uint64_t begin,
              uint64_t end, const Layout& layout, DeviceItem* c) {
  SetStreams(p, c);
  c->entry = entry;
  c->begin = begin;
  c->end = p.grad == nullptr ? begin : end;
  c->tiles = ItemTiles(*c, layout);
}

// Sorted, merged [first, end) ranges; ranges at most `gap` apart are joined,
// so that a few copies carry many small changes.
std::vector<std::pair<uint32_t, uint32_t>> MergeRanges(
    std::vector<std::pair<uint32_t, uint32_t>> ranges, uint32_t gap) {
  std::sort(ranges.begin(), ranges.end());
  std::vector<std::pair<uint32_t, uint32_t>> out;
  for (const auto& r : ranges) {
    if (r.first >= r.second) continue;
    if (!out.empty() && r.first <= out.back().second + gap) {
      out.back().second = std::max(out.back().second, r.second);
    } else {
      out.push_back(r);
    }
  }
  return out;
}

// The largest power of two, up to 2^12, that divides every start of the
// items of entry `entry` among `items`.
uint64_t ItemStep(const Plan& host, const std::vector<uint32_t>& items,
                  uint32_t entry) {
  uint64_t step = 1 << 12;
  for (uint32_t i : items) {
    const PlanItem& item = host.items[i];
    if (item.entry != entry) continue;
    while (item.begin % step != 0) step /= 2;
  }
  return step;
}

// Lists the FP8 parameters of `items` (one launch's) in plan->fp8, each
// once, with the running count of scaling units before it and, for those
// with an encode pass, of amax words.
void AppendFp8(const Plan& host, const std::vector<uint32_t>& items,
               Launch* launch, DevicePlan* plan) {
  launch->fp8_first = static_cast<uint32_t>(plan->fp8.size());
  launch->fp8_amax_first = plan->fp8_amax_words;
  uint64_t units = plan->fp8.empty() ? 0
                                     : plan->fp8.back().first_unit +
                                           plan->fp8.back().geometry.Units();
  const uint64_t first_unit = units;
  for (uint32_t i : items) {
    const PlanItem& item = host.items[i];
    if (item.begin != 0) continue;  // the tensor's later items
    const TensorPointers& p = host.entries[item.entry];
    DeviceFp8Tensor t{};
    t.master = static_cast<const float*>(p.master);
    t.param = static_cast<uint8_t*>(p.param);
    t.scale_inv = p.scale_inv;
    t.geometry = p.fp8;
    t.first_unit = units;
    t.e5m2 = host.layouts[item.entry].param_dtype == DType::kFloat8E5M2;
    t.entry = item.entry;
    t.first_item = plan->entry_items[item.entry].first;
    t.pass = ChooseFp8Pass(p.fp8, ItemStep(host, items, item.entry));
    t.amax_first = plan->fp8_amax_words;
    if (HasEncodePass(t.pass)) plan->fp8_amax_words += p.fp8.Units();
    if (t.pass == Fp8Pass::kUnitWalk) {
      for (uint64_t u = 0; u < p.fp8.Units(); ++u) {
        plan->unit_tasks.push_back({t.first_item, static_cast<uint32_t>(u)});
      }
    }
    plan->fp8.push_back(t);
    units += p.fp8.Units();
  }
  launch->fp8_count =
      static_cast<uint32_t>(plan->fp8.size()) - launch->fp8_first;
  launch->fp8_units = units - first_unit;
  launch->fp8_amax_words = plan->fp8_amax_words - launch->fp8_amax_first;
  launch->num_unit_tasks =
      static_cast<uint32_t>(plan->unit_tasks.size()) - launch->first_unit_task;
}

// The update's work blocks of `launch` (its items and FP8 parameters in
// `plan` already): over each run of its items that the update walks by
// item, the items of every kUnitWalk parameter (walked by unit) left out.
void AppendUpdateBlocks(DevicePlan* plan, const Launch& launch,
                        uint64_t target) {
  const uint32_t end = launch.first_item + launch.num_items;
  std::vector<bool> by_unit(plan->entry_items.size(), false);
  for (uint32_t f = launch.fp8_first; f < launch.fp8_first + launch.fp8_count;
       ++f) {
    by_unit[plan->fp8[f].entry] = plan->fp8[f].pass == Fp8Pass::kUnitWalk;
  }
  const auto walked = [&](uint32_t c) {
    return !by_unit[plan->items[c].entry];
  };
  for (uint32_t c = launch.first_item; c < end;) {
    while (c < end && !walked(c)) ++c;
    uint32_t run_end = c;
    while (run_end < end && walked(run_end)) ++run_end;
    AppendBlocks(plan->items, c, run_end, target, &plan->tables[0].blocks);
    c = run_end;
  }
}

// Appends launch `launch` (its layout and stage set) over plan items
// `items`, all of that layout and stage: their items, and the work blocks
// over those items in both tables.
void AppendLaunch(const Plan& host, const std::vector<uint32_t>& items,
                  uint64_t item_elements, Launch launch, DevicePlan* plan) {
  const Layout& l = launch.layout;
  launch.first_item = static_cast<uint32_t>(plan->items.size());
  for (uint32_t i : items) {
    const PlanItem& item = host.items[i];
    const uint32_t index = static_cast<uint32_t>(plan->items.size());
    auto& range = plan->entry_items[item.entry];
    if (range.first == range.second) range.first = index;
    range.second = index + 1;
    DeviceItem c{};
    FillItem(host.entries[item.entry], item.entry, item.begin, item.end, l, &c);
    plan->items.push_back(c);
    plan->item_end.push_back(item.end);
  }
  launch.num_items =
      static_cast<uint32_t>(plan->items.size()) - launch.first_item;
  launch.fp8_first = static_cast<uint32_t>(plan->fp8.size());
  launch.first_unit_task = static_cast<uint32_t>(plan->unit_tasks.size());
  if (l.fp8_recipe != Fp8Recipe::kNone) AppendFp8(host, items, &launch, plan);
  for (int t = 0; t < 2; ++t) {
    std::vector<DeviceBlock>& blocks = plan->tables[t].blocks;
    launch.first_block[t] = static_cast<uint32_t>(blocks.size());
    if (t == 0) {
      AppendUpdateBlocks(plan, launch, UpdateBlockElements(l, item_elements));
    } else {
      AppendBlocks(plan->items, launch.first_item,
                   launch.first_item + launch.num_items,
                   item_elements * kStatsBlockFactor, &blocks);
    }
    launch.num_blocks[t] =
        static_cast<uint32_t>(blocks.size()) - launch.first_block[t];
  }
  plan->launches.push_back(launch);
}

// Recounts the blocks of `blocks` that hold items of `ranges` (sorted,
// merged); returns the recounted blocks' merged index ranges.
std::vector<std::pair<uint32_t, uint32_t>> RecountBlocks(
    const std::vector<DeviceItem>& items,
    const std::vector<std::pair<uint32_t, uint32_t>>& ranges,
    std::vector<DeviceBlock>* blocks) {
  std::vector<std::pair<uint32_t, uint32_t>> dirty;
  for (const auto& [first, end] : ranges) {
    auto b = std::upper_bound(
        blocks->begin(), blocks->end(), first,
        [](uint32_t c, const DeviceBlock& blk) { return c < blk.first; });
    if (b != blocks->begin()) --b;
    for (; b != blocks->end() && b->first < end; ++b) {
      if (b->end <= first) continue;
      CountBlock(items, &*b);
      const uint32_t i = static_cast<uint32_t>(b - blocks->begin());
      dirty.emplace_back(i, i + 1);
    }
  }
  return MergeRanges(std::move(dirty), kCopyGap);
}

}  // namespace

uint64_t UpdateBlockElements(const Layout& l, uint64_t item_elements) {
  return DTypeSize(l.moment_dtype) <= 2 ? 2 * item_elements : item_elements;
}

void BuildDeviceTables(const Group& group, uint64_t item_elements,
                       DevicePlan* plan) {
  const Plan& host = group.plan;
  plan->entry_items.assign(host.entries.size(), {0, 0});
  // One launch per distinct (update pass, stage, layout), by pass, then
  // by stage, then by the layout's first appearance; each covers all the
  // items of its triple. Passes (Plan::pass_of_entry) order parameters
  // over one memory; there is one in the usual case.
  std::vector<Layout> layouts;
  std::vector<uint32_t> layout_of(host.entries.size());
  for (uint32_t e = 0; e < host.entries.size(); ++e) {
    auto it = std::find(layouts.begin(), layouts.end(), host.layouts[e]);
    if (it == layouts.end()) it = layouts.insert(it, host.layouts[e]);
    layout_of[e] = static_cast<uint32_t>(it - layouts.begin());
  }
  const uint64_t per_pass = (uint64_t{kMaxStage} + 1) * layouts.size();
  const auto kind_of = [&](uint32_t entry) -> uint64_t {
    return host.pass_of_entry[entry] * per_pass +
           group.tensors[host.tensor_index[entry]].stage * layouts.size() +
           layout_of[entry];
  };
  std::map<uint64_t, std::vector<uint32_t>> items_of_kind;
  for (uint32_t i = 0; i < host.items.size(); ++i) {
    items_of_kind[kind_of(host.items[i].entry)].push_back(i);
  }
  for (const auto& [kind, items] : items_of_kind) {
    Launch launch;
    launch.layout = layouts[kind % layouts.size()];
    launch.stage = static_cast<uint32_t>(kind % per_pass / layouts.size());
    launch.pass = static_cast<uint32_t>(kind / per_pass);
    AppendLaunch(host, items, item_elements, launch, plan);
  }
  plan->whole_launches = WholeLaunches(plan->launches);
}

std::vector<Launch> WholeLaunches(const std::vector<Launch>& launches) {
  std::vector<Launch> whole;
  for (const Launch& l : launches) {
    if (!whole.empty() && whole.back().layout == l.layout &&
        whole.back().pass == l.pass) {
      Launch& w = whole.back();
      w.num_items += l.num_items;
      w.fp8_count += l.fp8_count;  // adjacent in plan->fp8 too
      w.fp8_units += l.fp8_units;
      w.fp8_amax_words += l.fp8_amax_words;
      w.num_unit_tasks += l.num_unit_tasks;  // adjacent in plan->unit_tasks
      for (int t = 0; t < 2; ++t) w.num_blocks[t] += l.num_blocks[t];
    } else {
      whole.push_back(l);
    }
  }
  return whole;
}

TableChanges RefreshEntries(Group& group, const std::vector<uint32_t>& entries,
                            DevicePlan* plan) {
  TableChanges changes;
  std::vector<std::pair<uint32_t, uint32_t>> ranges;
  ranges.reserve(entries.size());
  for (uint32_t entry : entries) {
    const TensorPointers p =
        group.tensors[group.plan.tensor_index[entry]].Pointers();
    changes.absence_changed |=
        (p.grad == nullptr) != (group.plan.entries[entry].grad == nullptr);
    group.plan.entries[entry] = p;
    const auto [first, end] = plan->entry_items[entry];
    for (uint32_t c = first; c < end; ++c) {
      FillItem(p, entry, plan->items[c].begin, plan->item_end[c],
               group.plan.layouts[entry], &plan->items[c]);
    }
    ranges.emplace_back(first, end);
  }
  changes.items = MergeRanges(std::move(ranges), kCopyGap);
  // New pointers may change which items have tiles, and absent gradients
  // their element counts: recount the work blocks holding those items.
  for (int t = 0; t < 2; ++t) {
    changes.blocks[t] =
        RecountBlocks(plan->items, changes.items, &plan->tables[t].blocks);
  }
  return changes;
}

std::vector<uint32_t> AbsentEntries(const DevicePlan& plan) {
  std::vector<uint32_t> absent = {0};
  for (uint32_t e = 0; e < plan.entry_items.size(); ++e) {
    const auto [first, end] = plan.entry_items[e];
    if (first < end && plan.items[first].grad == nullptr) {
      absent.push_back(e);
    }
  }
  absent[0] = static_cast<uint32_t>(absent.size() - 1);
  return absent;
}

Work LaunchWork(const DevicePlan& plan, const Launch& launch, int table) {
  Work w;
  w.blocks =
      reinterpret_cast<const DeviceBlock*>(plan.tables[table].blocks_d.data()) +
      launch.first_block[table];
  w.num_blocks = launch.num_blocks[table];
  // The unit tasks are the update's (table 0) only.
  w.num_unit_tasks = table == 0 ? launch.num_unit_tasks : 0;
  w.unit_tasks = reinterpret_cast<const UnitTask*>(plan.unit_tasks_d.data()) +
                 launch.first_unit_task;
  w.items = reinterpret_cast<const DeviceItem*>(plan.items_d.data());
  w.missed = reinterpret_cast<const uint32_t*>(plan.missed_d.data());
  w.fp8 = reinterpret_cast<const DeviceFp8Tensor*>(plan.fp8_d.data()) +
          launch.fp8_first;
  w.num_fp8 = table == 0 ? launch.fp8_count : 0;
  return w;
}

Fp8Pass ChooseFp8Pass(const Fp8Geometry& g, uint64_t item_step) {
  if (g.recipe == Fp8Recipe::kTensor) return Fp8Pass::kTensorAmax;
  const uint64_t w = g.block_cols;
  // Every warp block (256 elements from an item's start) starts on a
  // multiple of w.
  const bool starts = item_step % w == 0 && kTileElements % w == 0;
  // ... and then holds whole units of w consecutive elements: in a tensor
  // of one row, units are consecutive runs of w whatever its length (the
  // last one clipped at its end, as the warp block that holds it is); in
  // rows of units of one row, when the columns are whole units.
  const bool whole_cols = g.cols % w == 0;
  const bool row_units = g.rows <= 1 || (g.block_rows == 1 && whole_cols);
  if (row_units && starts) return Fp8Pass::kFused;
  // 128x128 blocks over whole 128-column blocks that the item walk cannot
  // requantize in one pass (several rows, or items not starting on a
  // unit): walked unit by unit, whatever the items.
  if (g.block_rows == kWalkUnitSide && w == kWalkUnitSide && whole_cols) {
    return Fp8Pass::kUnitWalk;
  }
  return Fp8Pass::kElementAmax;
}

uint32_t ItemTiles(const DeviceItem& item, const Layout& layout) {
  auto aligned = [&](const void* p, uint64_t esize) {
    if (p == nullptr) return true;
    return (reinterpret_cast<uint64_t>(p) + item.begin * esize) % 16 == 0;
  };
  const uint64_t xs = layout.MasterBytesPerElement();
  const uint64_t ms = DTypeSize(layout.moment_dtype);
  bool vector = aligned(item.param, DTypeSize(layout.param_dtype)) &&
                aligned(item.grad, DTypeSize(layout.grad_dtype)) &&
                (xs == 0 || aligned(item.master, xs));
  for (const void* slot : item.state) vector = vector && aligned(slot, ms);
  return vector ? static_cast<uint32_t>((item.end - item.begin) / kTileElements)
                : 0;
}

void CountBlock(const std::vector<DeviceItem>& items, DeviceBlock* b) {
  b->tiles = 0;
  b->scalars = 0;
  for (uint32_t c = b->first; c < b->end; ++c) {
    b->tiles += items[c].tiles;
    b->scalars += static_cast<uint32_t>(items[c].end - items[c].begin) -
                  items[c].tiles * kTileElements;
  }
}

void AppendBlocks(const std::vector<DeviceItem>& items, uint32_t first,
                  uint32_t end, uint64_t target,
                  std::vector<DeviceBlock>* out) {
  const size_t start = out->size();
  uint64_t in_block = 0;
  for (uint32_t c = first; c < end; ++c) {
    if (out->size() == start || in_block >= target ||
        out->back().end - out->back().first >= kMaxItemsPerBlock) {
      out->push_back({c, c, 0, 0});
      in_block = 0;
    }
    out->back().end = c + 1;
    in_block += items[c].end - items[c].begin;
  }
  for (size_t b = start; b < out->size(); ++b) CountBlock(items, &(*out)[b]);
}

}  // namespace cuda
}  // namespace optimd
