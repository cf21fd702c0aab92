#include "backends/cuda/cuda_backend.h"

#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "backends/cuda/cuda_session.h"
#include "backends/cuda/cuda_status.h"
#include "backends/cuda/device_plan.h"
#include "backends/cuda/ipc_mapping.h"
#include "backends/cuda/nccl_job.h"
#include "backends/cuda/step_graph.h"
#include "common/mutex.h"
#include "common/status_macros.h"
#include "core/fp8_quantize.h"
#include "core/step_math.h"
#include "kernels/fp8_cuda.h"
#include "kernels/step_cuda.h"

namespace optimd {
namespace {

using cuda::BlockTable;
using cuda::DeviceBlock;
using cuda::DeviceChunk;
using cuda::DeviceGroupState;
using cuda::DevicePlan;
using cuda::Launch;
using cuda::LaunchWork;
using cuda::PlanOf;

using StreamValue32Fn = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t,
                                     unsigned int);

// Driver entry points the runtime does not wrap, found once through
// cudaGetDriverEntryPointByVersion (the daemon never links libcuda).
struct DriverFns {
  MemGetAddressRangeFn mem_get_address_range = nullptr;
  StreamValue32Fn stream_wait_value32 = nullptr;
  StreamValue32Fn stream_write_value32 = nullptr;
};

// Device memory with a cudaFree deleter.
absl::StatusOr<StateStorage> DeviceAlloc(int device, uint64_t bytes) {
  if (bytes == 0) return StateStorage();
  void* p = nullptr;
  const cudaError_t e = cudaMalloc(&p, bytes);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot allocate ", bytes, " bytes on GPU ", device, ": ",
                     cudaGetErrorString(e)));
  }
  return StateStorage(static_cast<uint8_t*>(p), bytes, [device](uint8_t* q) {
    cudaSetDevice(device);
    cudaFree(q);
  });
}

// A progress word's value past every stage (the trainer's waits compare
// with cuStreamWaitValue32's cyclic >=, so values stay below 2^31).
constexpr uint32_t kPastEveryStage = 0x7FFFFFFF;

class CudaBackend final : public Backend {
 public:
  CudaBackend(int device, const CudaBackendOptions& options,
              cudaStream_t stream, cudaStream_t capture_stream,
              const DriverFns& driver)
      : device_(device),
        options_(options),
        stream_(stream),
        capture_stream_(capture_stream),
        driver_(driver),
        ipc_mappings_(device, stream, driver.mem_get_address_range) {}

  ~CudaBackend() override {
    cudaSetDevice(device_);
    cudaStreamSynchronize(stream_);
    cudaStreamDestroy(stream_);
    cudaStreamDestroy(capture_stream_);
  }

  BackendKind kind() const override { return BackendKind::kCuda; }

  absl::StatusOr<BufferRef> ResolveBuffer(const BufferHandle& handle,
                                          uint64_t alignment,
                                          const std::string& what) override {
    return ipc_mappings_.Resolve(handle, alignment, what);
  }
  absl::StatusOr<StateStorage> AllocateState(uint64_t bytes) override;
  absl::Status PrepareGroup(Group& group) override;
  absl::Status UpdatePlanEntries(Group& group,
                                 const std::vector<uint32_t>& entries) override;
  absl::StatusOr<std::unique_ptr<SessionContext>> OpenSession(
      int device, const std::string& ready_event,
      std::string* done_event) override;
  absl::StatusOr<std::string> JoinJob(SessionContext* session,
                                      const DeviceJob& job) override;
  absl::StatusOr<StepOutcome> Step(SessionContext* session,
                                   const std::vector<Group*>& groups,
                                   const StepOptions& options) override;
  absl::Status ReleaseStep(SessionContext* session,
                           const StepOptions& options) override;
  absl::Status WriteParams(Group& group) override;
  absl::Status SyncGroupCounters(const std::vector<Group*>& groups) override;
  absl::StatusOr<StateStorage> AllocateHostStaging(uint64_t bytes) override {
    OPTIMD_RETURN_IF_CUDA_ERROR(cudaSetDevice(device_));
    void* p = nullptr;
    const cudaError_t e = cudaMallocHost(&p, std::max<uint64_t>(bytes, 1));
    if (e != cudaSuccess) {
      cudaGetLastError();
      return absl::ResourceExhaustedError(absl::StrCat(
          "cannot allocate ", bytes,
          " bytes of pinned host memory: ", cudaGetErrorString(e)));
    }
    return StateStorage(static_cast<uint8_t*>(p), bytes,
                        [](uint8_t* q) { cudaFreeHost(q); });
  }
  absl::Status SetGroupStep(Group& group, uint64_t step) override;
  absl::Status CheckMappings(
      const std::vector<std::shared_ptr<const void>>&) override {
    return absl::OkStatus();
  }
  absl::Status CopyToHost(const uint8_t* src, uint8_t* dst,
                          uint64_t bytes) override;
  absl::Status CopyFromHost(const uint8_t* src, uint8_t* dst,
                            uint64_t bytes) override;

 private:
  absl::Status UploadPlan(DevicePlan& plan);
  // One stream memory operation on stream_ (wait or write of a step flag).
  absl::Status StreamValue(StreamValue32Fn fn, uint32_t* word, uint32_t value,
                           unsigned int flags);
  // Uploads the list of the plan's entries without a gradient, if it
  // changed.
  absl::Status UploadAbsent(DevicePlan& plan);
  absl::Status EnsureScratch(uint32_t groups);
  // Waits for stream_. A job's step waiting for ranks that are gone would
  // hold it forever: after the longest job timeout every job of this
  // backend is ended, which lets the stream go on.
  absl::Status SyncStream() ABSL_LOCKS_EXCLUDED(mu_);
  // Waits for a step's event of session `s` (bounded for a job's steps).
  absl::Status WaitStep(CudaSession& s, cudaEvent_t event);
  // Enqueues a step's kernels for `groups` on `stream`, with `record`'s
  // arguments and report; with `progress`, a staged step's updates; with
  // `lease` (a job's session), the ranks' all-reduce.
  absl::Status EnqueueStep(CudaSession& s, const std::vector<Group*>& groups,
                           const StepRecord& record, bool statistics,
                           uint32_t* progress, NcclJob::Lease* lease,
                           cudaStream_t stream);
  // The updates of every group stage by stage, writing *progress = s + 1
  // after stage s (past every stage after the last).
  absl::Status EnqueueStagedUpdates(const std::vector<Group*>& groups,
                                    uint32_t* progress, cudaStream_t stream);
  // The update of one launch, then the requantization of its FP8
  // parameters.
  absl::Status LaunchUpdate(const Group& group, const Launch& launch,
                            cudaStream_t stream);
  absl::Status Fp8MasterFromParam(const TensorEntry& t);
  absl::Status Fp8ParamFromMaster(const TensorEntry& t);
  // The parts of Step, in order. RecycleRecord: waits for the record's
  // earlier step and reads it if unread. Then RefreshGraphKey and
  // FillRecord (cuda_session.h). LaunchRecorded: LaunchStep, which waits
  // for the trainer's ready flag, runs the step (its graph, captured once
  // per record) and writes the done flag, then RecordStep (the step's
  // events), a job's communicator held throughout. Outcome: the step's
  // own outcome (wait) or the last completed one's.
  absl::Status RecycleRecord(CudaSession& s, StepRecord& record,
                             const std::vector<Group*>& groups);
  absl::Status LaunchRecorded(CudaSession& s, const std::vector<Group*>& groups,
                              StepRecord& record, const StepOptions& options,
                              bool statistics, uint32_t* progress);
  absl::Status LaunchStep(CudaSession& s, const std::vector<Group*>& groups,
                          StepRecord& record, const StepOptions& options,
                          bool statistics, uint32_t* progress,
                          NcclJob::Lease* lease);
  absl::Status RecordStep(CudaSession& s, StepRecord& record);
  absl::StatusOr<StepOutcome> Outcome(CudaSession& s, StepRecord& record,
                                      const std::vector<Group*>& groups,
                                      bool wait, uint64_t seq);

  const int device_;
  const CudaBackendOptions options_;
  const cudaStream_t stream_;
  // Never runs work: step graphs are captured on it.
  const cudaStream_t capture_stream_;
  const DriverFns driver_;
  uint64_t next_plan_id_ = 1;
  IpcMappingCache ipc_mappings_;

  Mutex mu_;
  // The jobs of this backend's sessions (SyncStream).
  std::vector<std::weak_ptr<NcclJob>> jobs_ ABSL_GUARDED_BY(mu_);

  // Per-step scratch: per group of the stepping session, its sum of squares
  // and a device copy of its arguments.
  StateStorage sums_d_, steps_d_;
  uint32_t scratch_capacity_ = 0;
  uint64_t scratch_generation_ = 0;  // bumped when reallocated
};

absl::StatusOr<StateStorage> CudaBackend::AllocateState(uint64_t bytes) {
  OPTIMD_RETURN_IF_CUDA_ERROR(cudaSetDevice(device_));
  OPTIMD_ASSIGN_OR_RETURN(StateStorage s, DeviceAlloc(device_, bytes));
  if (bytes > 0) {
    OPTIMD_RETURN_IF_CUDA_ERROR(cudaMemsetAsync(s.data(), 0, bytes, stream_));
    OPTIMD_RETURN_IF_ERROR(SyncStream());
  }
  return s;
}

absl::Status CudaBackend::UploadPlan(DevicePlan& plan) {
  OPTIMD_ASSIGN_OR_RETURN(
      plan.chunks_d,
      DeviceAlloc(device_, std::max<uint64_t>(1, plan.chunks.size()) *
                               sizeof(DeviceChunk)));
  for (BlockTable& t : plan.tables) {
    OPTIMD_ASSIGN_OR_RETURN(
        t.blocks_d,
        DeviceAlloc(device_, std::max<uint64_t>(1, t.blocks.size()) *
                                 sizeof(DeviceBlock)));
    OPTIMD_RETURN_IF_CUDA_ERROR(
        cudaMemcpyAsync(t.blocks_d.data(), t.blocks.data(),
                        t.blocks.size() * sizeof(DeviceBlock),
                        cudaMemcpyHostToDevice, stream_));
  }
  // One partial per work block of the statistics pass.
  OPTIMD_ASSIGN_OR_RETURN(
      plan.partials_d,
      DeviceAlloc(device_, std::max<uint64_t>(1, plan.tables[1].blocks.size()) *
                               sizeof(double)));
  OPTIMD_ASSIGN_OR_RETURN(plan.state_d,
                          DeviceAlloc(device_, sizeof(DeviceGroupState)));
  OPTIMD_ASSIGN_OR_RETURN(plan.scalars_d,
                          DeviceAlloc(device_, sizeof(cuda::DeviceScalars)));
  OPTIMD_RETURN_IF_CUDA_ERROR(
      cudaMemcpyAsync(plan.chunks_d.data(), plan.chunks.data(),
                      plan.chunks.size() * sizeof(DeviceChunk),
                      cudaMemcpyHostToDevice, stream_));
  OPTIMD_RETURN_IF_CUDA_ERROR(cudaMemsetAsync(
      plan.state_d.data(), 0, sizeof(DeviceGroupState), stream_));
  const uint64_t entries = plan.entry_chunks.size();
  OPTIMD_ASSIGN_OR_RETURN(
      plan.missed_d,
      DeviceAlloc(device_, std::max<uint64_t>(1, entries) * sizeof(uint32_t)));
  OPTIMD_RETURN_IF_CUDA_ERROR(
      cudaMemsetAsync(plan.missed_d.data(), 0, plan.missed_d.size(), stream_));
  OPTIMD_ASSIGN_OR_RETURN(
      plan.absent_d, DeviceAlloc(device_, (entries + 1) * sizeof(uint32_t)));
  OPTIMD_ASSIGN_OR_RETURN(
      plan.fp8_d, DeviceAlloc(device_, std::max<uint64_t>(1, plan.fp8.size()) *
                                           sizeof(cuda::DeviceFp8Tensor)));
  OPTIMD_RETURN_IF_CUDA_ERROR(
      cudaMemcpyAsync(plan.fp8_d.data(), plan.fp8.data(),
                      plan.fp8.size() * sizeof(cuda::DeviceFp8Tensor),
                      cudaMemcpyHostToDevice, stream_));
  return UploadAbsent(plan);
}

absl::Status CudaBackend::UploadAbsent(DevicePlan& plan) {
  std::vector<uint32_t> absent = cuda::AbsentEntries(plan);
  if (absent == plan.absent) return absl::OkStatus();
  plan.absent = std::move(absent);
  // Pageable: staged when enqueued, so plan.absent may change right after.
  OPTIMD_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(
      plan.absent_d.data(), plan.absent.data(),
      plan.absent.size() * sizeof(uint32_t), cudaMemcpyHostToDevice, stream_));
  return absl::OkStatus();
}

absl::Status CudaBackend::PrepareGroup(Group& group) {
  OPTIMD_RETURN_IF_CUDA_ERROR(cudaSetDevice(device_));
  // FP8 parameters are requantized per scaling unit by a kernel of their
  // own after the update (LaunchUpdate), so their chunks need no alignment.
  BuildPlan(group, options_.chunk_elements, /*fp8_whole_units=*/false);
  counters().plan_builds.fetch_add(1, std::memory_order_relaxed);
  auto plan = std::make_shared<DevicePlan>();
  plan->id = next_plan_id_++;
  cuda::BuildDeviceTables(group, options_.chunk_elements, plan.get());
  OPTIMD_RETURN_IF_ERROR(UploadPlan(*plan));
  // Master weights from the parameters (remainders start at zero).
  for (const TensorEntry& t : group.tensors) {
    if (t.numel > 0 && t.layout.fp8_recipe != Fp8Recipe::kNone) {
      OPTIMD_RETURN_IF_ERROR(Fp8MasterFromParam(t));
    } else if (t.numel > 0 && t.layout.master == MasterKind::kFp32) {
      OPTIMD_RETURN_IF_ERROR(cuda::LaunchConvert(
          t.layout.param_dtype, t.param.data, DType::kFloat32, t.master.data(),
          t.numel, stream_));
    }
  }
  OPTIMD_RETURN_IF_ERROR(SyncStream());
  group.backend_plan = plan;
  return absl::OkStatus();
}

absl::Status CudaBackend::UpdatePlanEntries(
    Group& group, const std::vector<uint32_t>& entries) {
  if (entries.empty()) return absl::OkStatus();
  auto* plan = PlanOf(group);
  OPTIMD_RETURN_IF_CUDA_ERROR(cudaSetDevice(device_));
  const cuda::TableChanges changes = cuda::RefreshEntries(group, entries, plan);
  // Copies from pageable memory are staged when enqueued, so the host
  // tables may change again at once; stream order puts them after the
  // steps already queued and before the next.
  auto* chunks_d = reinterpret_cast<DeviceChunk*>(plan->chunks_d.data());
  for (const auto& [first, end] : changes.chunks) {
    OPTIMD_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(
        chunks_d + first, &plan->chunks[first],
        (end - first) * sizeof(DeviceChunk), cudaMemcpyHostToDevice, stream_));
  }
  // The work blocks holding those chunks, recounted.
  for (int t = 0; t < 2; ++t) {
    const BlockTable& table = plan->tables[t];
    auto* blocks_d = reinterpret_cast<DeviceBlock*>(table.blocks_d.data());
    for (const auto& [first, end] : changes.blocks[t]) {
      OPTIMD_RETURN_IF_CUDA_ERROR(
          cudaMemcpyAsync(blocks_d + first, &table.blocks[first],
                          (end - first) * sizeof(DeviceBlock),
                          cudaMemcpyHostToDevice, stream_));
    }
  }
  // The absent list walks every entry: only when some absence changed, so
  // that moved gradients cost the host about their own number.
  if (changes.absence_changed) OPTIMD_RETURN_IF_ERROR(UploadAbsent(*plan));
  counters().plan_entry_updates.fetch_add(entries.size(),
                                          std::memory_order_relaxed);
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<SessionContext>> CudaBackend::OpenSession(
    int device, const std::string& ready_event, std::string* done_event) {
  OPTIMD_RETURN_IF_CUDA_ERROR(cudaSetDevice(device_));
  auto s = std::make_unique<CudaSession>();
  s->stream = stream_;
  if (!ready_event.empty()) {
    if (ready_event.size() != sizeof(cudaIpcEventHandle_t)) {
      return absl::InvalidArgumentError(
          absl::StrCat("ready_event must be a ", sizeof(cudaIpcEventHandle_t),
                       "-byte cudaIpcEventHandle_t"));
    }
    cudaIpcEventHandle_t h;
    std::memcpy(&h, ready_event.data(), sizeof(h));
    const cudaError_t e = cudaIpcOpenEventHandle(&s->ready, h);
    if (e != cudaSuccess) {
      cudaGetLastError();
      s->ready = nullptr;
      return absl::InvalidArgumentError(absl::StrCat(
          "cannot open the trainer's ready_event (", cudaGetErrorName(e),
          "); it must come from cudaIpcGetEventHandle on an event created "
          "with cudaEventInterprocess | cudaEventDisableTiming on GPU ",
          device_));
    }
  }
  OPTIMD_RETURN_IF_CUDA_ERROR(cudaEventCreateWithFlags(
      &s->done, cudaEventDisableTiming | cudaEventInterprocess));
  cudaIpcEventHandle_t done_handle;
  OPTIMD_RETURN_IF_CUDA_ERROR(cudaIpcGetEventHandle(&done_handle, s->done));
  done_event->assign(reinterpret_cast<const char*>(&done_handle),
                     sizeof(done_handle));
  OPTIMD_ASSIGN_OR_RETURN(s->totals_d,
                          DeviceAlloc(device_, sizeof(DeviceGroupState)));
  OPTIMD_RETURN_IF_CUDA_ERROR(cudaMemsetAsync(
      s->totals_d.data(), 0, sizeof(DeviceGroupState), stream_));
  s->records.resize(std::max(2, options_.step_records));
  for (StepRecord& record : s->records) {
    for (cudaEvent_t* e : {&record.queued, &record.began, &record.event}) {
      OPTIMD_RETURN_IF_CUDA_ERROR(cudaEventCreate(e));  // timing events
    }
  }
  OPTIMD_RETURN_IF_ERROR(SyncStream());
  s->last.known = false;
  return std::unique_ptr<SessionContext>(std::move(s));
}

absl::Status CudaBackend::EnsureScratch(uint32_t groups) {
  if (groups <= scratch_capacity_) return absl::OkStatus();
  OPTIMD_RETURN_IF_ERROR(SyncStream());
  const uint32_t cap = std::max<uint32_t>(groups, 2 * scratch_capacity_);
  // Each group's sum, then the job's total, non-finite and rank counts.
  OPTIMD_ASSIGN_OR_RETURN(sums_d_,
                          DeviceAlloc(device_, (cap + 3) * sizeof(double)));
  OPTIMD_ASSIGN_OR_RETURN(steps_d_,
                          DeviceAlloc(device_, cap * sizeof(cuda::GroupStep)));
  scratch_capacity_ = cap;
  ++scratch_generation_;
  return absl::OkStatus();
}

absl::Status CudaBackend::LaunchUpdate(const Group& group, const Launch& launch,
                                       cudaStream_t stream) {
  const auto* plan = PlanOf(group);
  auto* scalars = reinterpret_cast<cuda::DeviceScalars*>(
      const_cast<uint8_t*>(plan->scalars_d.data()));
  OPTIMD_RETURN_IF_ERROR(
      cuda::LaunchUpdate(group.hyper.kind, group.hyper.adamw, launch.layout,
                         LaunchWork(*plan, launch, 0), scalars, stream));
  if (launch.fp8_count == 0) return absl::OkStatus();
  const auto* fp8 =
      reinterpret_cast<const cuda::DeviceFp8Tensor*>(plan->fp8_d.data());
  return cuda::LaunchFp8Requantize(
      fp8 + launch.fp8_first, launch.fp8_count, launch.fp8_units, scalars,
      reinterpret_cast<const uint32_t*>(plan->absent_d.data()), stream);
}

// FP8 parameters at registration and GetParams, through host memory (not
// on the step's path): the CPU reference's conversions, so that the
// masters and codes are the same on both backends.
absl::Status CudaBackend::Fp8MasterFromParam(const TensorEntry& t) {
  TensorPointers p = t.Pointers();
  std::vector<uint8_t> codes(t.numel), scales(p.fp8.ScaleBytes());
  std::vector<float> master(t.numel);
  OPTIMD_RETURN_IF_ERROR(CopyToHost(t.param.data, codes.data(), codes.size()));
  OPTIMD_RETURN_IF_ERROR(
      CopyToHost(t.scale_inv.data, scales.data(), scales.size()));
  p.param = codes.data();
  p.scale_inv = scales.data();
  p.master = master.data();
  DequantizeFp8Range(t.layout.param_dtype, p, 0, t.numel);
  return CopyFromHost(reinterpret_cast<const uint8_t*>(master.data()),
                      t.master.data(), t.numel * 4);
}

absl::Status CudaBackend::Fp8ParamFromMaster(const TensorEntry& t) {
  TensorPointers p = t.Pointers();
  std::vector<uint8_t> codes(t.numel), scales(p.fp8.ScaleBytes());
  std::vector<float> master(t.numel);
  OPTIMD_RETURN_IF_ERROR(CopyToHost(
      t.master.data(), reinterpret_cast<uint8_t*>(master.data()), t.numel * 4));
  p.param = codes.data();
  p.scale_inv = scales.data();
  p.master = master.data();
  QuantizeFp8Range(t.layout.param_dtype, p, 0, t.numel);
  OPTIMD_RETURN_IF_ERROR(CopyFromHost(codes.data(), t.param.data, t.numel));
  return CopyFromHost(scales.data(), t.scale_inv.data, scales.size());
}

absl::Status CudaBackend::EnqueueStagedUpdates(
    const std::vector<Group*>& groups, uint32_t* progress,
    cudaStream_t stream) {
  // Each plan's launches are sorted by stage: walk them all in step.
  std::vector<size_t> next(groups.size(), 0);
  const auto launches = [&](size_t g) -> const std::vector<Launch>& {
    return PlanOf(*groups[g])->launches;
  };
  for (;;) {
    uint32_t stage = kMaxStage + 1;
    for (size_t g = 0; g < groups.size(); ++g) {
      if (next[g] < launches(g).size()) {
        stage = std::min(stage, launches(g)[next[g]].stage);
      }
    }
    if (stage > kMaxStage) break;
    uint32_t later = kMaxStage + 1;  // the next stage after this one
    for (size_t g = 0; g < groups.size(); ++g) {
      const std::vector<Launch>& launches_of = launches(g);
      for (;
           next[g] < launches_of.size() && launches_of[next[g]].stage == stage;
           ++next[g]) {
        OPTIMD_RETURN_IF_ERROR(
            LaunchUpdate(*groups[g], launches_of[next[g]], stream));
      }
      if (next[g] < launches_of.size())
        later = std::min(later, launches_of[next[g]].stage);
    }
    // After the last stage: past every stage, so that a wait for a stage
    // without steppable tensors (frozen, no gradient) ends too.
    OPTIMD_RETURN_IF_ERROR(cuda::LaunchWriteProgress(
        progress, later > kMaxStage ? kPastEveryStage : stage + 1, stream));
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::EnqueueStep(CudaSession& s,
                                      const std::vector<Group*>& groups,
                                      const StepRecord& record, bool statistics,
                                      uint32_t* progress, NcclJob::Lease* lease,
                                      cudaStream_t stream) {
  const uint32_t n = static_cast<uint32_t>(groups.size());
  double* sums = reinterpret_cast<double*>(sums_d_.data());
  auto* steps = reinterpret_cast<cuda::GroupStep*>(steps_d_.data());
  for (uint32_t g = 0; g < (statistics ? n : 0); ++g) {
    auto* plan = PlanOf(*groups[g]);
    auto* partials = reinterpret_cast<double*>(plan->partials_d.data());
    for (const Launch& launch : plan->whole_launches) {
      OPTIMD_RETURN_IF_ERROR(cuda::LaunchGradSumSquares(
          launch.layout.grad_dtype, LaunchWork(*plan, launch, 1),
          partials + launch.first_block[1], stream));
    }
  }
  OPTIMD_RETURN_IF_ERROR(cuda::LaunchReduceSums(
      record.args, steps, n, statistics,
      s.job == nullptr || s.job->contributes_norm(), sums, stream));
  if (lease != nullptr) {
    OPTIMD_RETURN_IF_ERROR(lease->EnqueueAllReduce(sums + n, stream));
  }
  const uint32_t ranks = s.job == nullptr ? 1 : s.job->world_size();
  OPTIMD_RETURN_IF_ERROR(
      cuda::LaunchMakeScalars(steps, n, sums, ranks, stream));
  if (progress != nullptr) {
    OPTIMD_RETURN_IF_ERROR(EnqueueStagedUpdates(groups, progress, stream));
  } else {
    for (const Group* g : groups) {
      auto* plan = PlanOf(*g);
      for (const Launch& launch : plan->whole_launches) {
        OPTIMD_RETURN_IF_ERROR(LaunchUpdate(*g, launch, stream));
      }
    }
  }
  return cuda::LaunchCommitSteps(
      steps, n, sums, ranks,
      reinterpret_cast<DeviceGroupState*>(s.totals_d.data()), record.host,
      stream);
}

absl::Status CudaBackend::RecycleRecord(CudaSession& s, StepRecord& record,
                                        const std::vector<Group*>& groups) {
  if (record.sequence != 0) {
    OPTIMD_RETURN_IF_ERROR(WaitStep(s, record.event));
    if (record.sequence > s.last_sequence) {
      StepOutcome ignored;
      OPTIMD_RETURN_IF_ERROR(ReadRecord(s, record, groups, &ignored));
    }
    record.sequence = 0;
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::LaunchStep(CudaSession& s,
                                     const std::vector<Group*>& groups,
                                     StepRecord& record,
                                     const StepOptions& options,
                                     bool statistics, uint32_t* progress,
                                     NcclJob::Lease* lease) {
  OPTIMD_RETURN_IF_CUDA_ERROR(cudaEventRecord(record.queued, stream_));
  if (options.step_flags != nullptr) {
    OPTIMD_RETURN_IF_ERROR(StreamValue(driver_.stream_wait_value32,
                                       options.step_flags, options.sequence,
                                       CU_STREAM_WAIT_VALUE_GEQ));
  } else if (s.ready != nullptr) {
    OPTIMD_RETURN_IF_CUDA_ERROR(cudaStreamWaitEvent(stream_, s.ready, 0));
  }
  OPTIMD_RETURN_IF_CUDA_ERROR(cudaEventRecord(record.began, stream_));
  if (!options_.use_graphs) {
    OPTIMD_RETURN_IF_ERROR(
        EnqueueStep(s, groups, record, statistics, progress, lease, stream_));
  } else {
    if (record.exec == nullptr) {
      // Once per record and group configuration (CudaSession::graph_key).
      OPTIMD_ASSIGN_OR_RETURN(
          record.exec,
          CaptureStepGraph(capture_stream_, [&](cudaStream_t stream) {
            return EnqueueStep(s, groups, record, statistics, progress, lease,
                               stream);
          }));
    }
    OPTIMD_RETURN_IF_CUDA_ERROR(cudaGraphLaunch(record.exec, stream_));
  }
  if (options.gather_params && lease != nullptr) {
    // ZeRO: every rank's updated part reaches every rank's parameters
    // before the done flag (a skipped step broadcasts unchanged parts).
    OPTIMD_RETURN_IF_ERROR(lease->EnqueueGather(groups, stream_));
  }
  if (options.step_flags != nullptr) {
    // The done flag only: a staged step has written its progress.
    OPTIMD_RETURN_IF_ERROR(StreamValue(driver_.stream_write_value32,
                                       options.step_flags + 1, options.sequence,
                                       CU_STREAM_WRITE_VALUE_DEFAULT));
  }
  return absl::OkStatus();
}

absl::StatusOr<StepOutcome> CudaBackend::Outcome(
    CudaSession& s, StepRecord& record, const std::vector<Group*>& groups,
    bool wait, uint64_t seq) {
  StepOutcome out;
  if (wait) {
    OPTIMD_RETURN_IF_ERROR(WaitStep(s, record.event));
    OPTIMD_RETURN_IF_ERROR(ReadRecord(s, record, groups, &out));
    out.current = true;
    out.timing_fresh = true;
  } else {
    // Steps complete in stream order: the oldest unread record first, up to
    // the first one still running.
    StepRecord* newest = nullptr;
    for (uint64_t q = s.last_sequence + 1; q <= seq; ++q) {
      StepRecord& r = s.records[q % s.records.size()];
      if (r.sequence != q) continue;
      const cudaError_t e = cudaEventQuery(r.event);
      if (e == cudaErrorNotReady) break;
      OPTIMD_RETURN_IF_CUDA_ERROR(e);
      newest = &r;
    }
    if (newest != nullptr) {
      OPTIMD_RETURN_IF_ERROR(ReadRecord(s, *newest, groups, &out));
    }
    out = s.last;
    out.current = s.last_sequence == seq;
    out.timing_fresh = newest != nullptr;
  }
  return out;
}

absl::StatusOr<std::string> CudaBackend::JoinJob(SessionContext* session,
                                                 const DeviceJob& job) {
  auto& s = *static_cast<CudaSession*>(session);
  OPTIMD_ASSIGN_OR_RETURN(std::unique_ptr<NcclJob> joined,
                          NcclJob::Join(device_, job));
  s.job = std::move(joined);
  MutexLock lock(&mu_);
  jobs_.erase(std::remove_if(
                  jobs_.begin(), jobs_.end(),
                  [](const std::weak_ptr<NcclJob>& j) { return j.expired(); }),
              jobs_.end());
  jobs_.push_back(s.job);
  return s.job->unique_id();
}

absl::Status CudaBackend::WaitStep(CudaSession& s, cudaEvent_t event) {
  if (s.job != nullptr) return s.job->Wait(event);
  OPTIMD_RETURN_IF_CUDA_ERROR(cudaEventSynchronize(event));
  return absl::OkStatus();
}

absl::Status CudaBackend::SyncStream() {
  std::vector<std::shared_ptr<NcclJob>> jobs;
  {
    MutexLock lock(&mu_);
    for (const auto& weak : jobs_) {
      if (auto j = weak.lock()) jobs.push_back(std::move(j));
    }
  }
  if (jobs.empty()) {
    OPTIMD_RETURN_IF_CUDA_ERROR(cudaStreamSynchronize(stream_));
    return absl::OkStatus();
  }
  absl::Duration longest;
  for (const auto& j : jobs) longest = std::max(longest, j->timeout());
  const absl::Time deadline = absl::Now() + longest;
  cudaError_t e;
  while ((e = cudaStreamQuery(stream_)) == cudaErrorNotReady &&
         absl::Now() < deadline) {
    absl::SleepFor(absl::Microseconds(100));
  }
  if (e == cudaErrorNotReady) {
    for (const auto& j : jobs) {
      j->Abort("the device's stream waited for its ranks longer than " +
               absl::FormatDuration(longest));
    }
  }
  OPTIMD_RETURN_IF_CUDA_ERROR(cudaStreamSynchronize(stream_));
  return absl::OkStatus();
}

absl::StatusOr<StepOutcome> CudaBackend::Step(SessionContext* session,
                                              const std::vector<Group*>& groups,
                                              const StepOptions& options) {
  auto& s = *static_cast<CudaSession*>(session);
  OPTIMD_RETURN_IF_CUDA_ERROR(cudaSetDevice(device_));
  const uint32_t n = static_cast<uint32_t>(groups.size());
  OPTIMD_RETURN_IF_ERROR(EnsureScratch(std::max<uint32_t>(n, 1)));
  const bool statistics = !options.assume_finite || options.max_grad_norm > 0;
  if (options.gather_params && options.staged) {
    return absl::InvalidArgumentError(
        "a staged step (overlap) releases parameters stage by stage, before "
        "a step of sharded state (shard_state) has gathered the other "
        "ranks' parts: step without staged (overlap=False)");
  }
  if (s.job != nullptr) OPTIMD_RETURN_IF_ERROR(s.job->AwaitReady(stream_));

  // The step's record: its earlier step must have completed (this blocks only
  // when more steps than records are in flight).
  const uint64_t seq = s.sequence + 1;
  StepRecord& record = s.records[seq % s.records.size()];
  OPTIMD_RETURN_IF_ERROR(RecycleRecord(s, record, groups));
  // Graphs built for other groups (or other scratch memory) are stale.
  uint32_t* progress = options.staged ? options.step_flags + 2 : nullptr;
  RefreshGraphKey(s, groups, statistics, scratch_generation_, progress);
  // The ranks of a job skip a non-finite step whatever the trainer asked:
  // an all-reduce that ended part-way reads as one (StepOptions).
  const bool apply_nonfinite = options.assume_finite && s.job == nullptr;
  OPTIMD_RETURN_IF_ERROR(FillRecord(record, groups, options, apply_nonfinite));
  OPTIMD_RETURN_IF_ERROR(
      LaunchRecorded(s, groups, record, options, statistics, progress));
  s.sequence = seq;
  record.groups = n;
  record.sequence = seq;
  record.grad_scale = EffectiveGradScale(options.grad_scale);
  record.statistics = statistics;
  return Outcome(s, record, groups, options.wait, seq);
}

absl::Status CudaBackend::LaunchRecorded(CudaSession& s,
                                         const std::vector<Group*>& groups,
                                         StepRecord& record,
                                         const StepOptions& options,
                                         bool statistics, uint32_t* progress) {
  if (s.job == nullptr) {
    OPTIMD_RETURN_IF_ERROR(
        LaunchStep(s, groups, record, options, statistics, progress, nullptr));
    return RecordStep(s, record);
  }
  // The job cannot end while its collectives are enqueued; its watchdog
  // follows the step (a rank that is gone ends the job: the trainer's
  // stream goes on, later steps are refused).
  NcclJob::Lease lease(*s.job);
  OPTIMD_RETURN_IF_ERROR(lease.status());
  OPTIMD_RETURN_IF_ERROR(
      LaunchStep(s, groups, record, options, statistics, progress, &lease));
  OPTIMD_RETURN_IF_ERROR(RecordStep(s, record));
  return lease.Watch(stream_);
}

absl::Status CudaBackend::RecordStep(CudaSession& s, StepRecord& record) {
  OPTIMD_RETURN_IF_CUDA_ERROR(cudaEventRecord(s.done, stream_));
  OPTIMD_RETURN_IF_CUDA_ERROR(cudaEventRecord(record.event, stream_));
  return absl::OkStatus();
}

absl::Status CudaBackend::StreamValue(StreamValue32Fn fn, uint32_t* word,
                                      uint32_t value, unsigned int flags) {
  const CUresult r = fn(reinterpret_cast<CUstream>(stream_),
                        reinterpret_cast<CUdeviceptr>(word), value, flags);
  if (r != CUDA_SUCCESS) {
    return absl::InternalError(absl::StrCat(
        "a stream memory operation on the step flags failed (CUresult ", r,
        ")"));
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::ReleaseStep(SessionContext*,
                                      const StepOptions& options) {
  if (options.step_flags == nullptr) return absl::OkStatus();
  OPTIMD_RETURN_IF_CUDA_ERROR(cudaSetDevice(device_));
  if (options.step_flag_words > 2) {
    OPTIMD_RETURN_IF_ERROR(StreamValue(driver_.stream_write_value32,
                                       options.step_flags + 2, kPastEveryStage,
                                       CU_STREAM_WRITE_VALUE_DEFAULT));
  }
  // The default write is preceded by a memory fence: the trainer's stream,
  // once it sees the flag, sees the step's parameters.
  return StreamValue(driver_.stream_write_value32, options.step_flags + 1,
                     options.sequence, CU_STREAM_WRITE_VALUE_DEFAULT);
}

absl::Status CudaBackend::SyncGroupCounters(const std::vector<Group*>& groups) {
  OPTIMD_RETURN_IF_CUDA_ERROR(cudaSetDevice(device_));
  OPTIMD_RETURN_IF_ERROR(SyncStream());
  for (Group* g : groups) {
    auto* plan = PlanOf(*g);
    DeviceGroupState state;
    OPTIMD_RETURN_IF_CUDA_ERROR(cudaMemcpy(
        &state, plan->state_d.data(), sizeof(state), cudaMemcpyDeviceToHost));
    g->step = state.step;
    std::vector<uint32_t> missed(g->plan.entries.size());
    OPTIMD_RETURN_IF_CUDA_ERROR(cudaMemcpy(missed.data(), plan->missed_d.data(),
                                           missed.size() * sizeof(uint32_t),
                                           cudaMemcpyDeviceToHost));
    for (uint32_t e = 0; e < missed.size(); ++e) {
      g->tensors[g->plan.tensor_index[e]].missed_steps = missed[e];
    }
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::SetGroupStep(Group& group, uint64_t step) {
  OPTIMD_RETURN_IF_CUDA_ERROR(cudaSetDevice(device_));
  auto* plan = PlanOf(group);
  DeviceGroupState state;
  OPTIMD_RETURN_IF_ERROR(SyncStream());
  OPTIMD_RETURN_IF_CUDA_ERROR(cudaMemcpy(
      &state, plan->state_d.data(), sizeof(state), cudaMemcpyDeviceToHost));
  state.step = step;
  OPTIMD_RETURN_IF_CUDA_ERROR(cudaMemcpy(
      plan->state_d.data(), &state, sizeof(state), cudaMemcpyHostToDevice));
  group.step = step;
  std::vector<uint32_t> missed(group.plan.entries.size());
  for (uint32_t e = 0; e < missed.size(); ++e) {
    missed[e] = static_cast<uint32_t>(std::min<uint64_t>(
        group.tensors[group.plan.tensor_index[e]].missed_steps,
        std::numeric_limits<uint32_t>::max()));
  }
  OPTIMD_RETURN_IF_CUDA_ERROR(cudaMemcpy(plan->missed_d.data(), missed.data(),
                                         missed.size() * sizeof(uint32_t),
                                         cudaMemcpyHostToDevice));
  return absl::OkStatus();
}

absl::Status CudaBackend::WriteParams(Group& group) {
  OPTIMD_RETURN_IF_CUDA_ERROR(cudaSetDevice(device_));
  for (const TensorEntry& t : group.tensors) {
    if (t.numel > 0 && t.layout.fp8_recipe != Fp8Recipe::kNone) {
      OPTIMD_RETURN_IF_ERROR(Fp8ParamFromMaster(t));
    } else if (t.numel > 0 && t.layout.master == MasterKind::kFp32) {
      OPTIMD_RETURN_IF_ERROR(cuda::LaunchConvert(
          DType::kFloat32, t.master.data(), t.layout.param_dtype, t.param.data,
          t.numel, stream_));
    }
  }
  OPTIMD_RETURN_IF_ERROR(SyncStream());
  return absl::OkStatus();
}

absl::Status CudaBackend::CopyToHost(const uint8_t* src, uint8_t* dst,
                                     uint64_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  OPTIMD_RETURN_IF_CUDA_ERROR(cudaSetDevice(device_));
  OPTIMD_RETURN_IF_CUDA_ERROR(
      cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream_));
  OPTIMD_RETURN_IF_ERROR(SyncStream());
  return absl::OkStatus();
}

absl::Status CudaBackend::CopyFromHost(const uint8_t* src, uint8_t* dst,
                                       uint64_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  OPTIMD_RETURN_IF_CUDA_ERROR(cudaSetDevice(device_));
  OPTIMD_RETURN_IF_CUDA_ERROR(
      cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream_));
  OPTIMD_RETURN_IF_ERROR(SyncStream());
  return absl::OkStatus();
}

}  // namespace

int CudaDeviceCount(std::string* why) {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    cudaGetLastError();
    *why = absl::StrCat(cudaGetErrorName(e), ": ", cudaGetErrorString(e));
    return 0;
  }
  if (n == 0) *why = "no CUDA devices";
  return n;
}

absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(
    int device, const CudaBackendOptions& options) {
  if (options.chunk_elements == 0 || options.chunk_elements > (1u << 26) ||
      options.chunk_elements % cuda::kTileElements != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "chunk_elements must be a multiple of ", cuda::kTileElements, " in [",
        cuda::kTileElements, ", 2^26], got ", options.chunk_elements));
  }
  OPTIMD_RETURN_IF_CUDA_ERROR(cudaSetDevice(device));
  DriverFns driver;
  const std::pair<const char*, void**> wanted[] = {
      {"cuMemGetAddressRange",
       reinterpret_cast<void**>(&driver.mem_get_address_range)},
      {"cuStreamWaitValue32",
       reinterpret_cast<void**>(&driver.stream_wait_value32)},
      {"cuStreamWriteValue32",
       reinterpret_cast<void**>(&driver.stream_write_value32)}};
  for (const auto& [name, fn] : wanted) {
    cudaDriverEntryPointQueryResult found;
    OPTIMD_RETURN_IF_CUDA_ERROR(cudaGetDriverEntryPointByVersion(
        name, fn, 12000, cudaEnableDefault, &found));
    if (found != cudaDriverEntryPointSuccess || *fn == nullptr) {
      return absl::FailedPreconditionError(
          absl::StrCat("the CUDA driver has no ", name));
    }
  }
  cudaStream_t stream, capture_stream;
  OPTIMD_RETURN_IF_CUDA_ERROR(
      cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const cudaError_t e =
      cudaStreamCreateWithFlags(&capture_stream, cudaStreamNonBlocking);
  if (e != cudaSuccess) cudaStreamDestroy(stream);
  OPTIMD_RETURN_IF_CUDA_ERROR(e);
  return std::unique_ptr<Backend>(
      new CudaBackend(device, options, stream, capture_stream, driver));
}

}  // namespace optimd
