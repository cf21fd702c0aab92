// A registered parameter group: hyperparameters, tensors with their resolved
// buffers and daemon-owned state, the step counter, and the cached plan.
#ifndef OPTIMD_CORE_GROUP_H_
#define OPTIMD_CORE_GROUP_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "core/buffer.h"
#include "core/layout.h"
#include "kernels/adamw_cpu.h"

namespace optimd {

// A tensor as a client describes it, before validation.
struct TensorSpec {
  std::string name;
  uint64_t numel = 0;
  DType param_dtype = DType::kFloat32;
  bool param_dtype_set = false;
  BufferHandle param;
  DType grad_dtype = DType::kFloat32;
  bool grad_dtype_set = false;
  BufferHandle grad;
  bool keep_fp32 = false;
  bool frozen = false;
  // No gradient buffer yet (see TensorEntry::grad_absent).
  bool grad_absent = false;
};

// A group as a client describes it, before validation.
struct GroupSpec {
  std::string id;
  AdamWHyper hyper;
  MasterRequest master = MasterRequest::kDefault;
  DType moment_dtype = DType::kFloat32;
  std::vector<TensorSpec> tensors;
};

// A tensor's share of one of its group's state arenas. Non-owning.
class StateSlice {
 public:
  StateSlice() = default;
  StateSlice(uint8_t* data, uint64_t size) : data_(data), size_(size) {}
  uint8_t* data() const { return data_; }
  uint64_t size() const { return size_; }

 private:
  uint8_t* data_ = nullptr;
  uint64_t size_ = 0;
};

// One registered tensor. Owned by its Group.
struct TensorEntry {
  std::string name;
  uint64_t numel = 0;
  Layout layout;
  bool keep_fp32 = false;
  bool frozen = false;
  // The trainer has no gradient for it now (torch's .grad is None): the
  // tensor stays in the plan but its entry carries no gradient pointer, so
  // backends leave it out of statistics and updates. Written only by
  // Session::UpdateBuffers.
  bool grad_absent = false;
  // Applied steps of the group in which this tensor had no gradient. Its
  // own step count, torch's per-parameter `step` (what its bias correction
  // uses), is the group's step minus this. Advanced by the backend (on the
  // CUDA backend on the device; SyncGroupCounters brings it here) and set
  // by state loads.
  uint64_t missed_steps = 0;
  BufferRef param;  // null data for zero-element tensors
  BufferRef grad;   // null for frozen and zero-element tensors
  StateSlice master;
  StateSlice exp_avg;
  StateSlice exp_avg_sq;
  StateSlice max_exp_avg_sq;

  // True when the tensor takes part in steps.
  bool Steppable() const { return numel > 0 && !frozen; }
  TensorPointers Pointers() const {
    TensorPointers p;
    p.param = param.data;
    p.grad = grad_absent ? nullptr : grad.data;
    p.master = master.data();
    p.exp_avg = exp_avg.data();
    p.exp_avg_sq = exp_avg_sq.data();
    p.max_exp_avg_sq = max_exp_avg_sq.data();
    return p;
  }
  uint64_t StateBytes() const {
    return master.size() + exp_avg.size() + exp_avg_sq.size() +
           max_exp_avg_sq.size();
  }
};

// One unit of work: a contiguous element range of one plan entry.
struct PlanItem {
  uint32_t entry = 0;
  uint64_t begin = 0;
  uint64_t end = 0;
};

// A run of consecutive items of about chunk_elements elements in all: the
// unit a worker thread takes. Small tensors share a task, so per-task
// overhead stays small at 1e5 tensors.
struct PlanTask {
  uint32_t first_item = 0;
  uint32_t end_item = 0;  // exclusive
};

// The launch description of a group's step, built once at registration and
// reused every step. Entries hold resolved pointers of steppable tensors
// only; zero-element and frozen tensors never enter a plan.
struct Plan {
  std::vector<uint32_t> tensor_index;  // entry -> index into Group::tensors
  std::vector<TensorPointers> entries;
  std::vector<Layout> layouts;
  std::vector<PlanItem> items;
  std::vector<PlanTask> tasks;
  uint64_t elements = 0;
};

struct Group {
  std::string id;
  AdamWHyper hyper;
  MasterRequest master_request = MasterRequest::kDefault;
  DType moment_dtype = DType::kFloat32;
  // Applied steps; the next step runs with t = step + 1.
  uint64_t step = 0;
  std::vector<TensorEntry> tensors;
  // Tensor name -> index into `tensors`; set with `tensors` at registration.
  absl::flat_hash_map<std::string, uint32_t> index_by_name;
  Plan plan;
  // The group's state memory: one arena per kind of state (master, exp_avg,
  // exp_avg_sq, max_exp_avg_sq), each tensor's slice 64-byte aligned. One
  // allocation per kind keeps a group's state contiguous (streaming
  // prefetch, few TLB entries) and makes registration cheap at 1e5 tensors.
  std::vector<StateStorage> arenas;
  // Backend-specific plan data (the CUDA backend's device-resident chunk
  // table); null on the CPU backend.
  std::shared_ptr<void> backend_plan;

  uint64_t StateBytes() const {
    uint64_t n = 0;
    for (const auto& t : tensors) n += t.StateBytes();
    return n;
  }
};

// Builds `group.plan` from its tensors, splitting each steppable tensor into
// items of at most `chunk_elements`.
void BuildPlan(Group& group, uint64_t chunk_elements);

}  // namespace optimd

#endif  // OPTIMD_CORE_GROUP_H_
