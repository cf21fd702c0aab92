#include "backends/cuda/cuda_backend.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "backends/cuda/cuda_session.h"
#include "backends/cuda/cuda_status.h"
#include "backends/cuda/device_memory.h"
#include "backends/cuda/device_plan.h"
#include "backends/cuda/device_plan_memory.h"
#include "backends/cuda/device_stream.h"
#include "backends/cuda/driver_fns.h"
#include "backends/cuda/ipc_mapping.h"
#include "backends/cuda/mapping_reaper.h"
#include "backends/cuda/masters.h"
#include "backends/cuda/nccl_job.h"
#include "backends/cuda/step_graph.h"
#include "backends/cuda/step_kernels.h"
#include "backends/cuda/step_records.h"
#include "backends/cuda/vmm_mapping.h"
#include "common/mutex.h"
#include "common/status_macros.h"
#include "core/step_math.h"
#include "kernels/step_cuda.h"

namespace optimd {
namespace {

using cuda::DevicePlan;
using cuda::PlanOf;

// The Backend interface over the pieces of this package: each call sets
// the device, then delegates; Step puts a step's parts in their order.
class CudaBackend final : public Backend {
 public:
  CudaBackend(int device, const CudaBackendOptions& options,
              std::unique_ptr<DeviceStream> stream, const DriverFns& driver)
      : device_(device),
        options_(options),
        driver_(driver),
        stream_(std::move(stream)),
        reaper_(std::make_shared<MappingReaper>(device, stream_->stream())),
        ipc_mappings_(device, reaper_, driver.mem_get_address_range),
        vmm_mappings_(device, reaper_, driver.vmm, options.fd_store) {}

  ~CudaBackend() override { reaper_->StreamEnds(); }

  BackendKind kind() const override { return BackendKind::kCuda; }

  absl::StatusOr<BufferRef> ResolveBuffer(const BufferHandle& handle,
                                          uint64_t alignment,
                                          const std::string& what) override {
    if (handle.kind == BufferHandle::Kind::kCudaVmm) {
      return vmm_mappings_.Resolve(handle, alignment, what);
    }
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
  absl::StatusOr<bool> AbandonSteps(SessionContext* session) override;
  absl::Status WriteParams(Group& group) override;
  absl::Status AdoptWrittenParam(const TensorEntry& t) override;
  // AdoptWrittenParam for each of options.written, in stream order, after
  // the wait for the ready flag of session `s`'s step `ticket`: nothing
  // where that step is abandoned (its trainer gone, its writes maybe
  // partial).
  absl::Status AdoptWritten(CudaSession& s, const StepOptions& options,
                            uint64_t ticket);
  // One tensor's adopt kernel (AdoptWrittenParamRange's rule for its
  // layout), in stream order; nothing where `skip` (device memory, or
  // none) holds non-zero.
  absl::Status LaunchAdopt(const TensorEntry& t, const uint32_t* skip);
  absl::Status SyncGroupCounters(const std::vector<Group*>& groups) override;
  absl::StatusOr<StateStorage> AllocateHostStaging(uint64_t bytes) override {
    OPTIMD_RETURN_IF_CUDA_ERROR(cudaSetDevice(device_));
    return PinnedHostAlloc(bytes);
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
  // The parts of Step after its record is filled, in order: LaunchStep,
  // which waits for the trainer's ready flag, runs the step (its graph,
  // captured once per record) and writes the done flag, then RecordStep
  // (the step's events), a job's communicator held throughout.
  absl::Status LaunchRecorded(CudaSession& s, const std::vector<Group*>& groups,
                              StepRecord& record, const StepOptions& options,
                              bool statistics, uint32_t* progress);
  absl::Status LaunchStep(CudaSession& s, const std::vector<Group*>& groups,
                          StepRecord& record, const StepOptions& options,
                          bool statistics, uint32_t* progress,
                          NcclJob::Lease* lease);
  absl::Status RecordStep(CudaSession& s, StepRecord& record);

  // Constant after construction.
  const int device_;
  const CudaBackendOptions options_;
  const DriverFns driver_;
  const std::unique_ptr<DeviceStream> stream_;
  // Ends the trainer mappings let go of, after the stream's work before;
  // shared with the mappings' deleters (a mapping let go of after the
  // backend ends is closed at once: StreamEnds).
  const std::shared_ptr<MappingReaper> reaper_;

  // AbandonSteps's, from any thread: a non-blocking stream of the device,
  // made on first use (never destroyed: the backend lives as long as the
  // daemon).
  Mutex rescue_mu_;
  RescueStream rescue_ ABSL_GUARDED_BY(rescue_mu_);

  // The device's worker's only.
  uint64_t next_plan_id_ = 1;
  IpcMappingCache ipc_mappings_;
  VmmMappingCache vmm_mappings_;
  StepScratch scratch_;
  // AdoptWritten's word: whether the step whose writes it adopts was
  // abandoned (cuda::LaunchNoteAbandoned), made on first use.
  StateStorage adopt_skip_;
};

absl::StatusOr<StateStorage> CudaBackend::AllocateState(uint64_t bytes) {
  OPTIMD_RETURN_IF_CUDA_ERROR(cudaSetDevice(device_));
  OPTIMD_ASSIGN_OR_RETURN(StateStorage s, DeviceAlloc(device_, bytes));
  if (bytes > 0) {
    OPTIMD_RETURN_IF_CUDA_ERROR(
        cudaMemsetAsync(s.data(), 0, bytes, stream_->stream()));
    OPTIMD_RETURN_IF_ERROR(stream_->Sync());
  }
  return s;
}

absl::Status CudaBackend::PrepareGroup(Group& group) {
  OPTIMD_RETURN_IF_CUDA_ERROR(cudaSetDevice(device_));
  // FP8 parameters' items need no alignment to their scaling units: the
  // units that the update's warp blocks do not hold whole are requantized
  // by an encode pass after it (kernels/fp8_cuda.h).
  BuildPlan(group, options_.item_elements, /*fp8_whole_units=*/false);
  counters().plan_builds.fetch_add(1, std::memory_order_relaxed);
  auto plan = std::make_shared<DevicePlan>();
  plan->id = next_plan_id_++;
  cuda::BuildDeviceTables(group, options_.item_elements, plan.get());
  OPTIMD_RETURN_IF_ERROR(cuda::UploadPlan(device_, stream_->stream(), *plan));
  OPTIMD_RETURN_IF_ERROR(MastersFromParams(*this, group, stream_->stream()));
  OPTIMD_RETURN_IF_ERROR(stream_->Sync());
  group.backend_plan = plan;
  return absl::OkStatus();
}

absl::Status CudaBackend::UpdatePlanEntries(
    Group& group, const std::vector<uint32_t>& entries) {
  if (entries.empty()) return absl::OkStatus();
  DevicePlan* plan = PlanOf(group);
  OPTIMD_RETURN_IF_CUDA_ERROR(cudaSetDevice(device_));
  const cuda::TableChanges changes = cuda::RefreshEntries(group, entries, plan);
  OPTIMD_RETURN_IF_ERROR(
      cuda::UploadTableChanges(stream_->stream(), changes, *plan));
  counters().plan_entry_updates.fetch_add(entries.size(),
                                          std::memory_order_relaxed);
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<SessionContext>> CudaBackend::OpenSession(
    int, const std::string& ready_event, std::string* done_event) {
  OPTIMD_RETURN_IF_CUDA_ERROR(cudaSetDevice(device_));
  OPTIMD_ASSIGN_OR_RETURN(std::unique_ptr<CudaSession> s,
                          OpenCudaSession(device_, stream_->stream(),
                                          ready_event, options_.step_records,
                                          options_.blocking_sync, done_event));
  OPTIMD_RETURN_IF_ERROR(stream_->Sync());
  return std::unique_ptr<SessionContext>(std::move(s));
}

absl::StatusOr<std::string> CudaBackend::JoinJob(SessionContext* session,
                                                 const DeviceJob& job) {
  auto& s = *static_cast<CudaSession*>(session);
  OPTIMD_ASSIGN_OR_RETURN(std::unique_ptr<NcclJob> joined,
                          NcclJob::Join(device_, job));
  s.job = std::move(joined);
  stream_->Follow(s.job);
  return s.job->unique_id();
}

absl::StatusOr<StepOutcome> CudaBackend::Step(SessionContext* session,
                                              const std::vector<Group*>& groups,
                                              const StepOptions& options) {
  auto& s = *static_cast<CudaSession*>(session);
  OPTIMD_RETURN_IF_CUDA_ERROR(cudaSetDevice(device_));
  const uint32_t n = static_cast<uint32_t>(groups.size());
  if (std::max<uint32_t>(n, 1) > scratch_.capacity) {
    OPTIMD_RETURN_IF_ERROR(stream_->Sync());
    OPTIMD_RETURN_IF_ERROR(
        GrowStepScratch(device_, std::max<uint32_t>(n, 1), scratch_));
  }
  const bool statistics = !options.assume_finite || options.max_grad_norm > 0;
  if (options.gather_params && options.staged) {
    return absl::InvalidArgumentError(
        "a staged step (overlap) releases parameters stage by stage, before "
        "a step of sharded state (shard_state) has gathered the other "
        "ranks' parts: step without staged (overlap=False)");
  }
  for (const Group* g : groups) {
    if (options.staged && g->plan.passes() > 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "group '", g->id,
          "' holds parameters over overlapping memory, updated one after "
          "the other; a staged step (overlap) updates by stage instead: "
          "step without staged (overlap=False), or give each parameter "
          "memory of its own"));
    }
  }
  if (s.job != nullptr) {
    OPTIMD_RETURN_IF_ERROR(s.job->AwaitReady(stream_->stream()));
  }

  // The step's record: its earlier step must have completed (this blocks only
  // when more steps than records are in flight).
  const uint64_t seq = s.sequence + 1;
  StepRecord& record = s.records[seq % s.records.size()];
  OPTIMD_RETURN_IF_ERROR(RecycleRecord(s, record, groups));
  // Graphs built for other groups (or other scratch memory) are stale.
  uint32_t* progress = options.staged ? options.step_flags + 2 : nullptr;
  RefreshGraphKey(s, groups, statistics, scratch_.generation, progress);
  // The ranks of a job skip a non-finite step whatever the trainer asked:
  // an all-reduce that ended part-way reads as one (StepOptions).
  const bool apply_nonfinite = options.assume_finite && s.job == nullptr;
  OPTIMD_RETURN_IF_ERROR(FillRecord(record, groups, options, apply_nonfinite,
                                    seq, s.rescue->words()));
  const absl::Status launched =
      LaunchRecorded(s, groups, record, options, statistics, progress);
  // Taken even by a launch that failed part-way: the next step must not
  // refill this record's arguments while what was enqueued may read them.
  s.sequence = seq;
  record.groups = n;
  record.sequence = seq;
  record.grad_scale = EffectiveGradScale(options.grad_scale);
  record.statistics = statistics;
  if (!launched.ok()) {
    record.failed = true;
    if (cudaEventRecord(record.event, stream_->stream()) != cudaSuccess) {
      cudaGetLastError();  // the launch's own error is the one reported
    }
    return launched;
  }
  return ReadOutcome(s, record, groups, options.wait, seq);
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
  return lease.Watch(stream_->stream());
}

absl::Status CudaBackend::LaunchStep(CudaSession& s,
                                     const std::vector<Group*>& groups,
                                     StepRecord& record,
                                     const StepOptions& options,
                                     bool statistics, uint32_t* progress,
                                     NcclJob::Lease* lease) {
  const cudaStream_t stream = stream_->stream();
  OPTIMD_RETURN_IF_CUDA_ERROR(cudaEventRecord(record.queued, stream));
  if (options.step_flags != nullptr) {
    if (s.rescue->NoteWait(options.step_flags, options.step_flags_mapping,
                           options.sequence, s.sequence + 1)) {
      // A step of a gone trainer, abandoned: its flag is ours to write.
      OPTIMD_RETURN_IF_ERROR(
          WriteStepFlag(driver_, stream, options.step_flags, options.sequence));
    }
    OPTIMD_RETURN_IF_ERROR(
        WaitStepFlag(driver_, stream, options.step_flags, options.sequence));
  } else if (s.ready != nullptr) {
    OPTIMD_RETURN_IF_CUDA_ERROR(cudaStreamWaitEvent(stream, s.ready, 0));
  }
  OPTIMD_RETURN_IF_CUDA_ERROR(cudaEventRecord(record.began, stream));
  // The trainer's writes into its parameters are done once it is ready.
  OPTIMD_RETURN_IF_ERROR(AdoptWritten(s, options, s.sequence + 1));
  // 32-byte flags: the step's start and end on the device's global timer,
  // beside the trainer's own stamps (StepRequest.step_flags).
  uint64_t* stamps = options.step_flag_words >= 8
                         ? reinterpret_cast<uint64_t*>(options.step_flags + 4)
                         : nullptr;
  if (stamps != nullptr) {
    OPTIMD_RETURN_IF_ERROR(cuda::LaunchStampGlobalTimer(stamps, stream));
  }
  const auto enqueue = [&](cudaStream_t on) {
    return EnqueueStepKernels(s, groups, record, scratch_, statistics, progress,
                              lease, on);
  };
  if (options_.use_graphs) {
    // Captured once per record and group configuration
    // (CudaSession::graph_key).
    OPTIMD_RETURN_IF_ERROR(LaunchStepGraph(
        &record.exec, stream_->capture_stream(), stream, enqueue));
  } else {
    OPTIMD_RETURN_IF_ERROR(enqueue(stream));
  }
  if (options.gather_params && lease != nullptr) {
    // ZeRO: every rank's updated part reaches every rank's parameters
    // before the done flag (a skipped step broadcasts unchanged parts).
    OPTIMD_RETURN_IF_ERROR(lease->EnqueueGather(groups, stream));
  }
  if (stamps != nullptr) {
    OPTIMD_RETURN_IF_ERROR(cuda::LaunchStampGlobalTimer(stamps + 1, stream));
  }
  if (options.step_flags != nullptr) {
    // The done flag only: a staged step has written its progress.
    OPTIMD_RETURN_IF_ERROR(WriteStepFlag(
        driver_, stream, options.step_flags + 1, options.sequence));
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::RecordStep(CudaSession& s, StepRecord& record) {
  OPTIMD_RETURN_IF_CUDA_ERROR(cudaEventRecord(s.done, stream_->stream()));
  OPTIMD_RETURN_IF_CUDA_ERROR(cudaEventRecord(record.event, stream_->stream()));
  return absl::OkStatus();
}

absl::Status CudaBackend::ReleaseStep(SessionContext* session,
                                      const StepOptions& options) {
  if (options.step_flags == nullptr) return absl::OkStatus();
  auto& s = *static_cast<CudaSession*>(session);
  OPTIMD_RETURN_IF_CUDA_ERROR(cudaSetDevice(device_));
  const bool adopts = options.written != nullptr && !options.written->empty();
  absl::Status adopted;
  // A staged step's trainer resets the progress word, then writes ready:
  // past every stage only after that reset, or its forwards wait forever.
  // A trainer's writes into its parameters are done once it is ready.
  if ((options.step_flag_words > 2 || adopts) && options.sequence_in_order) {
    if (s.rescue->NoteWait(options.step_flags, options.step_flags_mapping,
                           options.sequence, s.sequence)) {
      OPTIMD_RETURN_IF_ERROR(WriteStepFlag(
          driver_, stream_->stream(), options.step_flags, options.sequence));
    }
    OPTIMD_RETURN_IF_ERROR(WaitStepFlag(driver_, stream_->stream(),
                                        options.step_flags, options.sequence));
    // Its failure is reported after the flags are written: the trainer's
    // stream must go on whatever went wrong.
    adopted = AdoptWritten(s, options, s.sequence);
  }
  if (options.step_flag_words > 2) {
    OPTIMD_RETURN_IF_ERROR(WriteStepFlag(
        driver_, stream_->stream(), options.step_flags + 2, kPastEveryStage));
  }
  // The write's memory fence: the trainer's stream, once it sees the flag,
  // sees the step's parameters.
  OPTIMD_RETURN_IF_ERROR(WriteStepFlag(
      driver_, stream_->stream(), options.step_flags + 1, options.sequence));
  return adopted;
}

absl::StatusOr<bool> CudaBackend::AbandonSteps(SessionContext* session) {
  MutexLock lock(&rescue_mu_);
  OPTIMD_RETURN_IF_CUDA_ERROR(cudaSetDevice(device_));
  if (rescue_.event == nullptr) {
    if (rescue_.stream == nullptr) {
      // The highest priority: its reads and writes go before any step's.
      int least = 0, greatest = 0;
      OPTIMD_RETURN_IF_CUDA_ERROR(
          cudaDeviceGetStreamPriorityRange(&least, &greatest));
      OPTIMD_RETURN_IF_CUDA_ERROR(cudaStreamCreateWithPriority(
          &rescue_.stream, cudaStreamNonBlocking, greatest));
    }
    OPTIMD_RETURN_IF_CUDA_ERROR(
        cudaEventCreateWithFlags(&rescue_.event, cudaEventDisableTiming));
  }
  // Bounded: the registry's lock is held meanwhile (SessionRegistry::Reap).
  return static_cast<CudaSession*>(session)->rescue->Rescue(
      driver_, rescue_, absl::Now() + absl::Seconds(2));
}

absl::Status CudaBackend::SyncGroupCounters(const std::vector<Group*>& groups) {
  OPTIMD_RETURN_IF_CUDA_ERROR(cudaSetDevice(device_));
  OPTIMD_RETURN_IF_ERROR(stream_->Sync());
  for (Group* g : groups) {
    OPTIMD_RETURN_IF_ERROR(
        cuda::ReadGroupCounters(stream_->stream(), *PlanOf(*g), *g));
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::SetGroupStep(Group& group, uint64_t step) {
  OPTIMD_RETURN_IF_CUDA_ERROR(cudaSetDevice(device_));
  OPTIMD_RETURN_IF_ERROR(stream_->Sync());
  return cuda::WriteGroupCounters(stream_->stream(), *PlanOf(group), group,
                                  step);
}

absl::Status CudaBackend::WriteParams(Group& group) {
  OPTIMD_RETURN_IF_CUDA_ERROR(cudaSetDevice(device_));
  OPTIMD_RETURN_IF_ERROR(ParamsFromMasters(*this, group, stream_->stream()));
  return stream_->Sync();
}

absl::Status CudaBackend::AdoptWritten(CudaSession& s,
                                       const StepOptions& options,
                                       uint64_t ticket) {
  if (options.written == nullptr || options.written->empty()) {
    return absl::OkStatus();
  }
  const uint32_t* skip = nullptr;
  if (options.step_flags != nullptr) {
    if (adopt_skip_.data() == nullptr) {
      OPTIMD_ASSIGN_OR_RETURN(adopt_skip_,
                              DeviceAlloc(device_, sizeof(uint32_t)));
    }
    auto* word = reinterpret_cast<uint32_t*>(adopt_skip_.data());
    OPTIMD_RETURN_IF_ERROR(cuda::LaunchNoteAbandoned(s.rescue->words(), ticket,
                                                     word, stream_->stream()));
    skip = word;
  }
  for (const TensorEntry* t : *options.written) {
    OPTIMD_RETURN_IF_ERROR(LaunchAdopt(*t, skip));
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::LaunchAdopt(const TensorEntry& t,
                                      const uint32_t* skip) {
  if (t.numel == 0 || t.layout.fp8_recipe != Fp8Recipe::kNone) {
    return absl::OkStatus();
  }
  switch (t.layout.master) {
    case MasterKind::kFp32:
      return cuda::LaunchAdoptWritten(t.layout.param_dtype, t.param.data,
                                      reinterpret_cast<float*>(t.master.data()),
                                      t.numel, stream_->stream(), skip);
    case MasterKind::kRemainder:
      return cuda::LaunchAdoptWrittenRemainder(
          t.param.data, t.master.data(), t.numel, stream_->stream(), skip);
    default:
      return absl::OkStatus();
  }
}

absl::Status CudaBackend::AdoptWrittenParam(const TensorEntry& t) {
  OPTIMD_RETURN_IF_CUDA_ERROR(cudaSetDevice(device_));
  // No wait: the steps after it are queued behind it on the same stream.
  return LaunchAdopt(t, nullptr);
}

absl::Status CudaBackend::CopyToHost(const uint8_t* src, uint8_t* dst,
                                     uint64_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  OPTIMD_RETURN_IF_CUDA_ERROR(cudaSetDevice(device_));
  OPTIMD_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(
      dst, src, bytes, cudaMemcpyDeviceToHost, stream_->stream()));
  return stream_->Sync();
}

absl::Status CudaBackend::CopyFromHost(const uint8_t* src, uint8_t* dst,
                                       uint64_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  OPTIMD_RETURN_IF_CUDA_ERROR(cudaSetDevice(device_));
  OPTIMD_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(
      dst, src, bytes, cudaMemcpyHostToDevice, stream_->stream()));
  return stream_->Sync();
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
  if (options.item_elements == 0 || options.item_elements > (1u << 26) ||
      options.item_elements % cuda::kTileElements != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "item_elements must be a multiple of ", cuda::kTileElements, " in [",
        cuda::kTileElements, ", 2^26], got ", options.item_elements));
  }
  OPTIMD_RETURN_IF_CUDA_ERROR(cudaSetDevice(device));
  OPTIMD_ASSIGN_OR_RETURN(const DriverFns driver, FindDriverFns());
  OPTIMD_ASSIGN_OR_RETURN(std::unique_ptr<DeviceStream> stream,
                          DeviceStream::Create(device));
  return std::unique_ptr<Backend>(
      new CudaBackend(device, options, std::move(stream), driver));
}

}  // namespace optimd
