#include "backends/cuda/device_stream.h"

#include <algorithm>
#include <string>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "backends/cuda/cuda_status.h"

namespace optimd {

absl::StatusOr<std::unique_ptr<DeviceStream>> DeviceStream::Create(int device) {
  cudaStream_t stream, capture_stream;
  OPTIMD_RETURN_IF_CUDA_ERROR(
      cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const cudaError_t e =
      cudaStreamCreateWithFlags(&capture_stream, cudaStreamNonBlocking);
  if (e != cudaSuccess) cudaStreamDestroy(stream);
  OPTIMD_RETURN_IF_CUDA_ERROR(e);
  return std::unique_ptr<DeviceStream>(
      new DeviceStream(device, stream, capture_stream));
}

DeviceStream::~DeviceStream() {
  cudaSetDevice(device_);
  cudaStreamSynchronize(stream_);
  cudaStreamDestroy(stream_);
  cudaStreamDestroy(capture_stream_);
}

void DeviceStream::Follow(const std::shared_ptr<NcclJob>& job) {
  MutexLock lock(&mu_);
  jobs_.erase(std::remove_if(
                  jobs_.begin(), jobs_.end(),
                  [](const std::weak_ptr<NcclJob>& j) { return j.expired(); }),
              jobs_.end());
  jobs_.push_back(job);
}

absl::Status DeviceStream::Sync() {
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

}  // namespace optimd
