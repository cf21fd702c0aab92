// A registered parameter group: hyperparameters, tensors with their resolved
// buffers and daemon-owned state, the step counter, and the cached plan.
#ifndef OPTIMD_CORE_GROUP_H_
#define OPTIMD_CORE_GROUP_H_

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "core/buffer.h"
#include "core/layout.h"
#include "core/step_types.h"

namespace optimd {

// Limits on what a client may register, so that no request, reply or
// checkpoint header grows without bound (gRPC refuses, and aborts on,
// messages of 2 GiB and more; the safetensors header limit is 100 MiB).
// Group ids and tensor names: at most this many bytes.
inline constexpr size_t kMaxNameBytes = 1024;
// Tensors in one group, and in one session over all its groups.
inline constexpr size_t kMaxTensorsPerSession = size_t{1} << 20;
// Groups in one session.
inline constexpr size_t kMaxGroupsPerSession = 4096;
// Aliases of one tensor (TensorSpec::aliases); a session holds at most
// kMaxTensorsPerSession aliases in all.
inline constexpr size_t kMaxAliasesPerTensor = 64;
// Largest step counter accepted from a client or a checkpoint: exact as a
// double (bias corrections take t as a double) and far from wrapping.
inline constexpr uint64_t kMaxStepCounter = uint64_t{1} << 53;

// Largest optimizer state, and largest total of trainer parameters, one
// session may register (64 PiB each): far beyond any machine, and small
// enough that no size computed from them (checkpoint offsets, replies)
// can wrap around 64 bits.
inline constexpr uint64_t kMaxSessionBytes = uint64_t{1} << 56;

// Adds `n` to *sum; false (and *sum unspecified) when the result does not
// fit in 64 bits.
inline bool AddChecked(uint64_t* sum, uint64_t n) {
  return !__builtin_add_overflow(*sum, n, sum);
}

// A tensor as a client describes it, before validation.
// The largest stage number of a staged step (TensorSpec::stage).
inline constexpr uint32_t kMaxStage = 4095;

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
  // Empty: 1-D.
  std::vector<uint64_t> shape;
  // The stage of a staged step in which it is updated (TensorSpec.stage).
  uint32_t stage = 0;
  // The tensor's other names (a weight tied between modules), each
  // distinct from every name and alias of the session.
  std::vector<std::string> aliases;
  // FP8 parameters: the scaling recipe and the trainer's buffer of scale
  // inverses (Fp8Geometry::ScaleBytes); kNone and unset otherwise.
  Fp8Recipe fp8_recipe = Fp8Recipe::kNone;
  BufferHandle scale_inv;
  // A shard of a larger tensor: its shape and this shard's first index in
  // it, per dimension of `shape` (both empty for a whole tensor).
  std::vector<uint64_t> global_shape;
  std::vector<uint64_t> global_offset;
};

// A group as a client describes it, before validation.
struct GroupSpec {
  std::string id;
  OptimizerHyper hyper;
  MasterRequest master = MasterRequest::kDefault;
  DType moment_dtype = DType::kFloat32;
  // The client left the moment dtype unspecified: each tensor's moments
  // are DefaultMomentDType of its parameter, and moment_dtype is unused.
  bool moment_dtype_default = false;
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
  // The shape checkpoints give the tensor's pieces; empty: [numel].
  std::vector<uint64_t> shape;
  // The stage of a staged step in which it is updated (at most kMaxStage).
  uint32_t stage = 0;
  // Other names of this tensor (TensorSpec::aliases), kept for checkpoints'
  // metadata; state is always addressed by `name`.
  std::vector<std::string> aliases;
  // Where this tensor sits in a larger one (TensorSpec::global_shape and
  // global_offset), kept for checkpoints' metadata; empty for a whole one.
  std::vector<uint64_t> global_shape;
  std::vector<uint64_t> global_offset;
  BufferRef param;  // null data for zero-element tensors
  BufferRef grad;   // null for frozen and zero-element tensors
  // ZeRO (a session with shard_state, core/state_shard.h): this entry is
  // elements [shard_begin, shard_begin + numel) of a trainer tensor of
  // full_numel elements; `param` and `grad` cover those elements only, and
  // `full_param` is the trainer's whole parameter, into which the other
  // ranks' updated elements are gathered after each step (null data when
  // full_numel is 0). Written at registration and by UpdateBuffers.
  bool sharded = false;
  uint64_t shard_begin = 0;
  uint64_t full_numel = 0;
  BufferRef full_param;
  // FP8 parameters: the trainer's scale inverses, written with the
  // parameter; null otherwise.
  BufferRef scale_inv;
  StateSlice master;
  // The optimizer's state slots, the first layout.state_slots of them
  // allocated (none for frozen tensors); core/optimizer.h names them.
  StateSlice state[kMaxStateSlots];
  // kBlock8 moments: fp32 scales, [blocks][state_slots] (Layout::ScaleBytes);
  // empty for other layouts and frozen tensors.
  StateSlice scales;

  // True when the tensor takes part in steps.
  bool Steppable() const { return numel > 0 && !frozen; }
  TensorPointers Pointers() const {
    TensorPointers p;
    p.param = param.data;
    p.grad = grad_absent ? nullptr : grad.data;
    p.master = master.data();
    for (int s = 0; s < kMaxStateSlots; ++s) p.state[s] = state[s].data();
    p.scales = scales.data();
    p.scale_inv = scale_inv.data;
    if (layout.fp8_recipe != Fp8Recipe::kNone) {
      p.fp8 = Fp8Geometry::Of(layout.fp8_recipe, numel, shape);
    }
    return p;
  }
  uint64_t StateBytes() const {
    uint64_t n = master.size() + scales.size();
    for (const StateSlice& s : state) n += s.size();
    return n;
  }
};

// One unit of work: a contiguous element range of one plan entry.
struct PlanItem {
  uint32_t entry = 0;
  uint64_t begin = 0;
  uint64_t end = 0;
};

// A run of consecutive items of about item_elements elements in all: the
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
  // Index into Group::tensors -> its entry, or kNoEntry (not steppable).
  static constexpr uint32_t kNoEntry = ~uint32_t{0};
  std::vector<uint32_t> entry_of_tensor;
  std::vector<TensorPointers> entries;
  std::vector<Layout> layouts;
  std::vector<PlanItem> items;
  std::vector<PlanTask> tasks;
  // Update passes, run one after the other: an entry whose parameter
  // memory overlaps an earlier entry's (two trainer parameters over one
  // storage, tied through .data) is updated in a later pass, as torch
  // steps parameters one after the other; every entry is in pass 0 in the
  // usual case. pass_of_entry[e] is entry e's pass; items are ordered by
  // (pass, entry) and no task spans two passes: pass p's tasks are
  // [pass_tasks[p], pass_tasks[p + 1]). Computed from the pointers at
  // registration.
  std::vector<uint32_t> pass_of_entry;
  std::vector<uint32_t> pass_tasks = {0, 0};
  uint32_t passes() const {
    return static_cast<uint32_t>(pass_tasks.size()) - 1;
  }
};

// The update pass of each of `ranges` (the [begin, end) bytes of each
// entry's parameter, in entry order): 0 for one that overlaps no other; in
// a cluster of ranges linked by overlaps, each member's rank in entry
// order, so that every overlapping pair is updated in entry order. Sorts
// once: O(n log n) whatever the overlaps.
std::vector<uint32_t> UpdatePasses(
    const std::vector<std::pair<uintptr_t, uintptr_t>>& ranges);

// What a backend keeps of a group's plan beside the host Plan; each backend
// derives its own and is the only one to read it.
class BackendPlan {
 public:
  virtual ~BackendPlan() = default;
};

// A registered group. Owned by its Session, read and written only under the
// session's lock (by the session, and by the backend inside PrepareGroup,
// UpdatePlanEntries and Step). Invariants, from registration on:
//  - `tensors` keeps its order and names; index_by_name maps each name to
//    its index (IndexTensors).
//  - hyper.kind never changes, and every tensor's layout.optimizer is it;
//    layout.state_slots == StateSlotCount(hyper) for every tensor (an
//    override that would change the count is refused).
//  - arenas[0] holds the masters, arenas[1 + s] state slot s, the last
//    one block8 scales; a tensor's slices lie inside them, empty when it
//    holds no such state (zero elements; frozen tensors hold no slots).
//  - plan is built from tensors once (BuildPlan, by the backend's
//    PrepareGroup); plan.entries[e] equals
//    tensors[plan.tensor_index[e]].Pointers() once UpdatePlanEntries has
//    run for the entries whose buffers moved.
//  - every tensor's missed_steps is at most `step`.
struct Group {
  std::string id;
  OptimizerHyper hyper;
  DType moment_dtype = DType::kFloat32;
  // Applied steps; the next step runs with t = step + 1.
  uint64_t step = 0;
  std::vector<TensorEntry> tensors;
  Plan plan;
  // The group's state memory: one arena for the masters and one per state
  // slot, each tensor's slice 64-byte aligned. One
  // allocation per kind keeps a group's state contiguous (streaming
  // prefetch, few TLB entries) and makes registration cheap at 1e5 tensors.
  std::vector<StateStorage> arenas;
  // Backend-specific plan data (the CUDA backend's device-resident item
  // table); null on the CPU backend. Set by the backend's PrepareGroup.
  std::shared_ptr<BackendPlan> backend_plan;
  // Its share of --max_metadata_bytes (core/metadata_bytes.h), reserved
  // at registration.
  uint64_t metadata_bytes = 0;

  uint64_t StateBytes() const {
    uint64_t n = 0;
    for (const auto& t : tensors) n += t.StateBytes();
    return n;
  }

  // The index of the tensor named `name` in `tensors`, or tensors.size().
  // Constant time (UpdateBuffers and SetState name many tensors at once).
  size_t FindTensor(const std::string& name) const {
    auto it = index_by_name.find(name);
    return it == index_by_name.end() ? tensors.size() : it->second;
  }
  // NOT_FOUND for `name`, which FindTensor did not find; names the tensor
  // when `name` is one of its aliases (calls take the registered name).
  absl::Status TensorNotFound(const std::string& name,
                              const std::string& what = "") const;

  // Builds the name index; called once `tensors` is final.
  void IndexTensors() {
    index_by_name.clear();
    index_by_name.reserve(tensors.size());
    for (size_t i = 0; i < tensors.size(); ++i) {
      index_by_name.emplace(tensors[i].name, i);
    }
  }
  std::unordered_map<std::string, size_t> index_by_name;
};

// Builds `group.plan` from its tensors, splitting each steppable tensor into
// items of at most `item_elements` (> 0). In a group with block8 moments it
// is rounded up to a multiple of kBlock8Elements: every item then starts on
// a block8 block (core/block8.h) and holds whole blocks and their scales.
// (The CUDA backend's item size is a multiple of 256 anyway.)
// With `fp8_whole_units` (the CPU backend, which requantizes per item) an
// FP8 parameter's items hold whole scaling units (ItemAlignment).
void BuildPlan(Group& group, uint64_t item_elements,
               bool fp8_whole_units = true);

}  // namespace optimd

#endif  // OPTIMD_CORE_GROUP_H_
