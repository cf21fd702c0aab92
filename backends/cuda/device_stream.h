// The stream of one GPU, on which every session of the device steps, and
// the stream step graphs are captured on (it runs no work of its own). A
// host wait for the device's stream is bounded while it carries steps of
// jobs (nccl_job.h): such a step waiting for ranks that are gone would hold
// the stream forever, so after the longest timeout of those jobs every one
// of them is ended, which lets the stream go on. Thread-safe.
#ifndef OPTIMD_BACKENDS_CUDA_DEVICE_STREAM_H_
#define OPTIMD_BACKENDS_CUDA_DEVICE_STREAM_H_

#include <cuda_runtime.h>

#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "backends/cuda/nccl_job.h"
#include "common/mutex.h"

namespace optimd {

class DeviceStream {
 public:
  // Both streams of GPU `device` (the caller's current device).
  static absl::StatusOr<std::unique_ptr<DeviceStream>> Create(int device);
  // Waits for the stream's work, then destroys both streams.
  ~DeviceStream();
  DeviceStream(const DeviceStream&) = delete;
  DeviceStream& operator=(const DeviceStream&) = delete;

  cudaStream_t stream() const { return stream_; }
  cudaStream_t capture_stream() const { return capture_stream_; }

  // Bounds Sync by `job`'s timeout while the job lives (its steps run on
  // the stream).
  void Follow(const std::shared_ptr<NcclJob>& job) ABSL_LOCKS_EXCLUDED(mu_);

  // Waits for the stream; past the longest timeout of the jobs followed,
  // ends them first.
  absl::Status Sync() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  DeviceStream(int device, cudaStream_t stream, cudaStream_t capture_stream)
      : device_(device), stream_(stream), capture_stream_(capture_stream) {}

  // Constant after construction.
  const int device_;
  const cudaStream_t stream_;
  const cudaStream_t capture_stream_;

  Mutex mu_;
  std::vector<std::weak_ptr<NcclJob>> jobs_ ABSL_GUARDED_BY(mu_);
};

}  // namespace optimd

#endif  // OPTIMD_BACKENDS_CUDA_DEVICE_STREAM_H_
