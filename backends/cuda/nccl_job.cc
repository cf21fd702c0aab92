#include "backends/cuda/nccl_job.h"

#include <chrono>
#include <cstring>
#include <thread>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status_macros.h"
#include "core/state_shard.h"

namespace optimd {
namespace {

absl::Status NcclError(ncclResult_t r, const std::string& what) {
  return absl::InternalError(
      absl::StrCat(what, ": NCCL error ", r, ": ", ncclGetErrorString(r)));
}

// Broadcasts per NCCL group call of a parameter gather: one group per
// step for models of up to this many tensor parts, bounded so that no
// group call grows with the model.
constexpr int kGatherOpsPerGroup = 512;

// Polls done() every 50 us (the first millisecond by yielding only) until
// it returns true or `deadline` passes; returns whether it did.
template <class Done>
bool PollUntil(absl::Time deadline, Done done) {
  const absl::Time start = absl::Now();
  while (!done()) {
    const absl::Time now = absl::Now();
    if (now >= deadline) return false;
    if (now - start < absl::Milliseconds(1)) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
  return true;
}

}  // namespace

absl::StatusOr<std::unique_ptr<NcclJob>> NcclJob::Join(
    int device, const Backend::DeviceJob& job) {
  if (job.rank != 0 && job.unique_id.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "rank ", job.rank,
        " of a CUDA job with gradient_sharding needs the nccl_unique_id that "
        "rank 0's CreateSession returned"));
  }
  if (!job.unique_id.empty() && job.unique_id.size() != sizeof(ncclUniqueId)) {
    return absl::InvalidArgumentError(
        absl::StrCat("nccl_unique_id must be ", sizeof(ncclUniqueId),
                     " bytes, got ", job.unique_id.size()));
  }
  std::unique_ptr<NcclJob> j(new NcclJob(device, job));
  ncclUniqueId id;
  if (job.unique_id.empty()) {
    const ncclResult_t r = ncclGetUniqueId(&id);
    if (r != ncclSuccess) return NcclError(r, "making the job's unique id");
  } else {
    std::memcpy(&id, job.unique_id.data(), sizeof(id));
  }
  j->unique_id_.assign(reinterpret_cast<const char*>(&id), sizeof(id));
  if (cudaSetDevice(device) != cudaSuccess ||
      cudaMalloc(&j->warm_d_, 3 * sizeof(double)) != cudaSuccess ||
      cudaMemset(j->warm_d_, 0, 3 * sizeof(double)) != cudaSuccess ||
      // The memset runs on the legacy stream, which the daemon's
      // non-blocking stream does not wait for: done before any step.
      cudaStreamSynchronize(cudaStreamLegacy) != cudaSuccess) {
    return absl::InternalError(
        absl::StrCat("cannot prepare the job's communicator on device ", device,
                     ": ", cudaGetErrorString(cudaGetLastError())));
  }
  // Non-blocking: the other ranks join later; steps wait (AwaitReady).
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  const ncclResult_t r =
      ncclCommInitRankConfig(&j->comm_, static_cast<int>(job.world_size), id,
                             static_cast<int>(job.rank), &config);
  if (r != ncclSuccess && r != ncclInProgress) {
    j->comm_ = nullptr;
    return NcclError(r, absl::StrCat("joining ", j->Name()));
  }
  j->joined_ = absl::Now();
  NcclJob* raw = j.get();
  j->watchdog_ = std::thread([raw] { raw->WatchSteps(); });
  return j;
}

NcclJob::~NcclJob() {
  {
    MutexLock lock(&mu_);
    stopping_ = true;
  }
  if (watchdog_.joinable()) watchdog_.join();
  // Abort, not destroy: it never waits for ranks that may be gone.
  Abort("the session closed");
  MutexLock lock(&mu_);
  for (auto& [event, since] : pending_) cudaEventDestroy(event);
  for (cudaEvent_t event : spare_events_) cudaEventDestroy(event);
  if (warm_d_ != nullptr) cudaFree(warm_d_);
}

absl::Status NcclJob::Ended() const {
  MutexLock lock(&mu_);
  return ended_;
}

absl::Status NcclJob::Lease::status() const {
  job_.mu_.AssertHeld();
  return job_.ended_;
}

absl::Status NcclJob::Lease::EnqueueAllReduce(double* values,
                                              cudaStream_t stream) {
  job_.mu_.AssertHeld();
  return job_.EnqueueAllReduceLocked(values, stream);
}

absl::Status NcclJob::Lease::Watch(cudaStream_t stream) {
  NcclJob& j = job_;
  j.mu_.AssertHeld();
  cudaEvent_t event = nullptr;
  if (!j.spare_events_.empty()) {
    event = j.spare_events_.back();
    j.spare_events_.pop_back();
  } else if (cudaEventCreateWithFlags(&event, cudaEventDisableTiming) !=
             cudaSuccess) {
    return absl::InternalError("cannot create an event to follow a step");
  }
  if (cudaEventRecord(event, stream) != cudaSuccess) {
    j.spare_events_.push_back(event);
    return absl::InternalError("cannot record an event to follow a step");
  }
  j.pending_.emplace_back(event, absl::Now());
  return absl::OkStatus();
}

void NcclJob::WatchSteps() {
  cudaSetDevice(device_);
  for (;;) {
    cudaEvent_t oldest = nullptr;
    absl::Time since;
    {
      MutexLock lock(&mu_);
      if (stopping_) return;
      if (!pending_.empty()) std::tie(oldest, since) = pending_.front();
    }
    if (oldest == nullptr) {
      absl::SleepFor(absl::Milliseconds(1));
      continue;
    }
    if (cudaEventQuery(oldest) != cudaErrorNotReady) {
      MutexLock lock(&mu_);
      pending_.pop_front();
      spare_events_.push_back(oldest);
      continue;
    }
    if (absl::Now() - since > job_.timeout) {
      Abort(absl::StrCat("a step waited more than ",
                         absl::FormatDuration(job_.timeout),
                         " for the other ranks' same step"));
    }
    absl::SleepFor(absl::Microseconds(200));
  }
}

std::string NcclJob::Name() const {
  return absl::StrCat("rank ", job_.rank, " of ", job_.world_size,
                      " in the job's NCCL communicator");
}

bool NcclJob::contributes_norm() const {
  return job_.sharding == GradientSharding::kSharded || job_.shard_state ||
         job_.rank == 0;
}

absl::Status NcclJob::Lease::EnqueueGather(const std::vector<Group*>& groups,
                                           cudaStream_t stream) {
  job_.mu_.AssertHeld();
  return job_.EnqueueGatherLocked(groups, stream);
}

absl::Status NcclJob::EndGatherGroupLocked() {
  const ncclResult_t r = ncclGroupEnd();
  if (r == ncclInProgress) {
    return SettleLocked(absl::Now() + job_.timeout,
                        "take the step's parameter gather");
  }
  if (r != ncclSuccess) {
    return NcclError(r, absl::StrCat(Name(), ": the parameter gather"));
  }
  return absl::OkStatus();
}

absl::Status NcclJob::EnqueueGatherLocked(const std::vector<Group*>& groups,
                                          cudaStream_t stream) {
  OPTIMD_RETURN_IF_ERROR(ended_);
  int ops = 0;
  for (const Group* g : groups) {
    std::vector<uint64_t> numels;
    numels.reserve(g->tensors.size());
    for (const TensorEntry& t : g->tensors) numels.push_back(t.full_numel);
    for (const OwnedPart& part : PartitionAll(numels, job_.world_size)) {
      const TensorEntry& t = g->tensors[part.tensor];
      if (t.frozen || !t.sharded) continue;
      const uint64_t size = DTypeSize(t.layout.param_dtype);
      uint8_t* p = t.full_param.data + part.range.begin * size;
      if (ops == 0) ncclGroupStart();
      const ncclResult_t res =
          ncclBroadcast(p, p, part.range.count * size, ncclUint8,
                        static_cast<int>(part.rank), comm_, stream);
      if (res != ncclSuccess && res != ncclInProgress) {
        ncclGroupEnd();
        return NcclError(res, absl::StrCat(Name(), ": the parameter gather"));
      }
      if (++ops == kGatherOpsPerGroup) {
        OPTIMD_RETURN_IF_ERROR(EndGatherGroupLocked());
        ops = 0;
      }
    }
  }
  return ops > 0 ? EndGatherGroupLocked() : absl::OkStatus();
}

absl::Status NcclJob::SettleLocked(absl::Time deadline, const char* what) {
  ncclResult_t state = ncclInProgress;
  const bool settled = PollUntil(deadline, [&] {
    const ncclResult_t r = ncclCommGetAsyncError(comm_, &state);
    if (r != ncclSuccess) state = r;
    return state != ncclInProgress;
  });
  if (!settled) {
    AbortLocked(absl::StrCat("the other ranks did not ", what, " within ",
                             absl::FormatDuration(job_.timeout)));
    return absl::DeadlineExceededError(
        absl::StrCat(Name(), ": ", ended_.message()));
  }
  if (state != ncclSuccess) {
    const absl::Status e = NcclError(state, absl::StrCat(Name(), ": ", what));
    AbortLocked(std::string(e.message()));
    return e;
  }
  return absl::OkStatus();
}

absl::Status NcclJob::AwaitReady(cudaStream_t stream) {
  OPTIMD_RETURN_IF_ERROR(Ended());
  if (ready_) return absl::OkStatus();
  const absl::Time deadline = joined_ + job_.timeout;
  cudaEvent_t event = nullptr;
  {
    MutexLock lock(&mu_);
    OPTIMD_RETURN_IF_ERROR(ended_);
    OPTIMD_RETURN_IF_ERROR(SettleLocked(deadline, "join"));
    // The first collective makes the connections: not inside a capture.
    OPTIMD_RETURN_IF_ERROR(EnqueueAllReduceLocked(warm_d_, stream));
    if (cudaEventCreateWithFlags(&event, cudaEventDisableTiming) !=
            cudaSuccess ||
        cudaEventRecord(event, stream) != cudaSuccess) {
      if (event != nullptr) cudaEventDestroy(event);
      return absl::InternalError("recording the warm-up all-reduce failed");
    }
  }
  const bool done = PollUntil(
      deadline, [&] { return cudaEventQuery(event) != cudaErrorNotReady; });
  if (!done) {
    Abort(absl::StrCat("the other ranks did not make their connections within ",
                       absl::FormatDuration(job_.timeout)));
  }
  const cudaError_t e = cudaEventSynchronize(event);
  cudaEventDestroy(event);
  if (const absl::Status ended = Ended(); !ended.ok()) {
    return absl::DeadlineExceededError(ended.message());
  }
  if (e != cudaSuccess) {
    return absl::InternalError(
        absl::StrCat("the warm-up all-reduce failed: ", cudaGetErrorString(e)));
  }
  ready_ = true;
  return absl::OkStatus();
}

absl::Status NcclJob::EnqueueAllReduceLocked(double* values,
                                             cudaStream_t stream) {
  OPTIMD_RETURN_IF_ERROR(ended_);
  const ncclResult_t r =
      ncclAllReduce(values, values, 3, ncclFloat64, ncclSum, comm_, stream);
  if (r == ncclInProgress) {
    return SettleLocked(absl::Now() + job_.timeout,
                        "take the step's all-reduce");
  }
  if (r != ncclSuccess) {
    return NcclError(r, absl::StrCat(Name(), ": the step's all-reduce"));
  }
  return absl::OkStatus();
}

absl::Status NcclJob::Wait(cudaEvent_t event) {
  const bool done = PollUntil(absl::Now() + job_.timeout, [&] {
    return cudaEventQuery(event) != cudaErrorNotReady;
  });
  if (!done) {
    Abort(absl::StrCat("a step waited more than ",
                       absl::FormatDuration(job_.timeout),
                       " for the other ranks' same step"));
  }
  const cudaError_t e = cudaEventSynchronize(event);
  if (!done) {
    return absl::DeadlineExceededError(
        absl::StrCat(Name(), ": ", Ended().message()));
  }
  if (e != cudaSuccess) {
    return absl::InternalError(
        absl::StrCat("a step of ", Name(), " failed: ", cudaGetErrorString(e)));
  }
  return absl::OkStatus();
}

void NcclJob::Abort(const std::string& why) {
  MutexLock lock(&mu_);
  AbortLocked(why);
}

void NcclJob::AbortLocked(const std::string& why) {
  if (!ended_.ok()) return;
  ended_ = absl::FailedPreconditionError(
      absl::StrCat("the job's NCCL communicator was ended: ", why,
                   "; close this session and start the job's ranks again"));
  // From any thread: NCCL's way to end collectives that wait for peers.
  if (comm_ != nullptr) ncclCommAbort(comm_);
}

}  // namespace optimd
