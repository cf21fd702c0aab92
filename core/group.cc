#include "core/group.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "core/backend.h"
#include "core/block8.h"

namespace optimd {

namespace {

// Elements per item of a tensor: item_elements, or for an FP8 parameter
// a multiple of its item alignment (at least one), so that every item
// holds whole scaling units (core/fp8_recipe.h); per-tensor scaling: the
// whole tensor.
uint64_t ItemElements(const TensorPointers& t, uint64_t item_elements) {
  if (t.fp8.recipe == Fp8Recipe::kNone) return item_elements;
  const uint64_t align = t.fp8.ItemAlignment();
  return std::max<uint64_t>(1, item_elements / align) * align;
}

}  // namespace

absl::Status Group::TensorNotFound(const std::string& name,
                                   const std::string& what) const {
  for (const TensorEntry& t : tensors) {
    if (std::find(t.aliases.begin(), t.aliases.end(), name) !=
        t.aliases.end()) {
      return absl::NotFoundError(absl::StrCat(
          what, "tensor '", name, "' is an alias of '", t.name, "' in group '",
          id, "': name the tensor '", t.name, "'"));
    }
  }
  return absl::NotFoundError(
      absl::StrCat(what, "tensor '", name, "' is not in group '", id, "'"));
}

std::vector<uint32_t> UpdatePasses(
    const std::vector<std::pair<uintptr_t, uintptr_t>>& ranges) {
  std::vector<uint32_t> pass(ranges.size(), 0);
  std::vector<uint32_t> by_begin(ranges.size());
  for (uint32_t e = 0; e < by_begin.size(); ++e) by_begin[e] = e;
  std::sort(by_begin.begin(), by_begin.end(), [&](uint32_t a, uint32_t b) {
    return ranges[a].first < ranges[b].first;
  });
  for (size_t first = 0; first < by_begin.size();) {
    // The cluster [first, last): ranges each overlapping the ones before.
    size_t last = first + 1;
    uintptr_t end = ranges[by_begin[first]].second;
    while (last < by_begin.size() && ranges[by_begin[last]].first < end) {
      end = std::max(end, ranges[by_begin[last]].second);
      ++last;
    }
    if (last - first > 1) {
      std::sort(by_begin.begin() + first, by_begin.begin() + last);
      for (size_t k = first; k < last; ++k) {
        pass[by_begin[k]] = static_cast<uint32_t>(k - first);
      }
    }
    first = last;
  }
  return pass;
}

namespace {

// The update passes of `plan`'s entries (UpdatePasses over their
// parameters' bytes).
std::vector<uint32_t> EntryPasses(const Group& group, const Plan& plan) {
  std::vector<std::pair<uintptr_t, uintptr_t>> ranges;
  ranges.reserve(plan.entries.size());
  for (uint32_t e = 0; e < plan.entries.size(); ++e) {
    const auto begin = reinterpret_cast<uintptr_t>(plan.entries[e].param);
    const uint64_t numel = group.tensors[plan.tensor_index[e]].numel;
    ranges.emplace_back(begin,
                        begin + numel * DTypeSize(plan.layouts[e].param_dtype));
  }
  return UpdatePasses(ranges);
}

// Appends tasks over plan.items [first, end): runs of consecutive items of
// about item_elements elements.
void AppendTasks(uint32_t first, uint32_t end, uint64_t item_elements,
                 Plan* plan) {
  uint64_t in_task = 0;
  for (uint32_t i = first; i < end; ++i) {
    if (i == first || in_task >= item_elements) {
      plan->tasks.push_back({i, i});
      in_task = 0;
    }
    plan->tasks.back().end_item = i + 1;
    in_task += plan->items[i].end - plan->items[i].begin;
  }
}

}  // namespace

void BuildPlan(Group& group, uint64_t item_elements, bool fp8_whole_units) {
  const bool block8 =
      std::any_of(group.tensors.begin(), group.tensors.end(),
                  [](const TensorEntry& t) { return t.layout.block8(); });
  if (block8) {
    item_elements = (item_elements + kBlock8Elements - 1) / kBlock8Elements *
                    kBlock8Elements;
  }
  Plan plan;
  plan.entry_of_tensor.assign(group.tensors.size(), Plan::kNoEntry);
  for (uint32_t i = 0; i < group.tensors.size(); ++i) {
    const TensorEntry& t = group.tensors[i];
    if (!t.Steppable()) continue;
    plan.entry_of_tensor[i] = static_cast<uint32_t>(plan.entries.size());
    plan.tensor_index.push_back(i);
    plan.entries.push_back(t.Pointers());
    plan.layouts.push_back(t.layout);
  }
  plan.pass_of_entry = EntryPasses(group, plan);
  // Items by (pass, entry): entry order within a pass (all of them in
  // pass 0 in the usual case); tasks begin anew with each pass.
  std::vector<uint32_t> order(plan.entries.size());
  for (uint32_t e = 0; e < order.size(); ++e) order[e] = e;
  std::stable_sort(order.begin(), order.end(), [&](uint32_t a, uint32_t b) {
    return plan.pass_of_entry[a] < plan.pass_of_entry[b];
  });
  plan.pass_tasks.assign(1, 0);
  uint32_t pass_first_item = 0;
  for (size_t k = 0; k < order.size(); ++k) {
    const uint32_t entry = order[k];
    const uint64_t numel = group.tensors[plan.tensor_index[entry]].numel;
    const uint64_t item = fp8_whole_units
                              ? ItemElements(plan.entries[entry], item_elements)
                              : item_elements;
    for (uint64_t b = 0; b < numel; b += item) {
      plan.items.push_back({entry, b, std::min(numel, b + item)});
    }
    if (k + 1 == order.size() ||
        plan.pass_of_entry[order[k + 1]] != plan.pass_of_entry[entry]) {
      const auto end_item = static_cast<uint32_t>(plan.items.size());
      AppendTasks(pass_first_item, end_item, item_elements, &plan);
      plan.pass_tasks.push_back(static_cast<uint32_t>(plan.tasks.size()));
      pass_first_item = end_item;
    }
  }
  if (order.empty()) plan.pass_tasks.push_back(0);
  group.plan = std::move(plan);
}

uint64_t HostMemoryAvailable() {
  // Line by line: some lines (HugePages_*) have no unit.
  std::ifstream in("/proc/meminfo");
  std::string line;
  while (std::getline(in, line)) {
    unsigned long long kib = 0;
    if (std::sscanf(line.c_str(), "MemAvailable: %llu kB", &kib) == 1) {
      return static_cast<uint64_t>(kib) * 1024;
    }
  }
  return 0;
}

absl::Status CheckHostMemory(uint64_t bytes, const std::string& what) {
  const uint64_t available = HostMemoryAvailable();
  if (available == 0 || bytes <= available) return absl::OkStatus();
  return absl::ResourceExhaustedError(
      absl::StrCat(what, " needs ", bytes, " more bytes but the machine has ",
                   available, " bytes of memory available"));
}

absl::StatusOr<StateStorage> Backend::AllocateHostStaging(uint64_t bytes) {
  constexpr uint64_t kAlign = 64;
  const uint64_t rounded = (bytes + kAlign - 1) / kAlign * kAlign;
  OPTIMD_RETURN_IF_ERROR(CheckHostMemory(rounded, "a host copy of the state"));
  void* p = std::aligned_alloc(kAlign, rounded);
  if (p == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot allocate ", bytes, " bytes of host memory"));
  }
  return StateStorage(static_cast<uint8_t*>(p), bytes,
                      [](uint8_t* q) { std::free(q); });
}

}  // namespace optimd
