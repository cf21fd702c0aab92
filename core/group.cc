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
    const uint32_t entry = static_cast<uint32_t>(plan.entries.size());
    plan.entry_of_tensor[i] = entry;
    plan.tensor_index.push_back(i);
    plan.entries.push_back(t.Pointers());
    plan.layouts.push_back(t.layout);
    const uint64_t item = fp8_whole_units
                              ? ItemElements(plan.entries.back(), item_elements)
                              : item_elements;
    for (uint64_t b = 0; b < t.numel; b += item) {
      plan.items.push_back({entry, b, std::min(t.numel, b + item)});
    }
  }
  uint64_t in_task = 0;
  for (uint32_t i = 0; i < plan.items.size(); ++i) {
    if (plan.tasks.empty() || in_task >= item_elements) {
      plan.tasks.push_back({i, i});
      in_task = 0;
    }
    plan.tasks.back().end_item = i + 1;
    in_task += plan.items[i].end - plan.items[i].begin;
  }
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
