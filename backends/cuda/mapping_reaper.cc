#include "backends/cuda/mapping_reaper.h"

#include <pthread.h>

#include <utility>

namespace optimd {

MappingReaper::MappingReaper(int device, cudaStream_t stream)
    : device_(device), stream_(stream), thread_([this] { Loop(); }) {
  pthread_setname_np(thread_.native_handle(), "optimd-unmap");
}

MappingReaper::~MappingReaper() {
  {
    MutexLock lock(&mu_);
    stop_ = true;
    DrainLocked();
  }
  thread_.join();
}

void MappingReaper::StreamEnds() {
  MutexLock lock(&mu_);
  stream_gone_ = true;
  DrainLocked();
}

void MappingReaper::DrainLocked() {
  if (abandon_) return;  // given up on once already
  if (!mu_.AwaitWithDeadline(
          +[](MappingReaper* r)
               ABSL_NO_THREAD_SAFETY_ANALYSIS { return r->queue_.empty(); },
          this, absl::Now() + kDrainBound)) {
    abandon_ = true;
  }
}

void MappingReaper::Retire(std::function<void()> end) {
  bool stream_gone;
  {
    MutexLock lock(&mu_);
    stream_gone = stream_gone_;
  }
  cudaSetDevice(device_);
  if (stream_gone || cudaStreamQuery(stream_) == cudaSuccess) {
    End(end);
    return;
  }
  cudaEvent_t event = nullptr;
  if (cudaEventCreateWithFlags(&event, cudaEventDisableTiming) != cudaSuccess ||
      cudaEventRecord(event, stream_) != cudaSuccess) {
    cudaGetLastError();  // reported by the wait below, if it persists
    if (event != nullptr) cudaEventDestroy(event);
    cudaStreamSynchronize(stream_);
    End(end);
    return;
  }
  MutexLock lock(&mu_);
  queue_.push_back(Pending{event, std::move(end)});
}

void MappingReaper::End(const std::function<void()>& end) {
  end();
  ended_.fetch_add(1, std::memory_order_acq_rel);
}

int MappingReaper::pending() const {
  MutexLock lock(&mu_);
  return static_cast<int>(queue_.size());
}

bool MappingReaper::AwaitEvent(cudaEvent_t event) {
  // Polled, a millisecond apart, so that the destructor can end the wait;
  // a blocking wait could outlive the daemon's end on a stream that never
  // finishes (a collective whose peer is gone).
  while (cudaEventQuery(event) == cudaErrorNotReady) {
    MutexLock lock(&mu_);
    if (mu_.AwaitWithDeadline(
            +[](MappingReaper* r)
                 ABSL_NO_THREAD_SAFETY_ANALYSIS { return r->abandon_; },
            this, absl::Now() + absl::Milliseconds(1))) {
      return false;
    }
  }
  return true;
}

void MappingReaper::Loop() {
  cudaSetDevice(device_);
  for (;;) {
    Pending next;
    {
      MutexLock lock(&mu_);
      mu_.Await(
          +[](MappingReaper* r) ABSL_NO_THREAD_SAFETY_ANALYSIS {
            return r->stop_ || !r->queue_.empty();
          },
          this);
      if (queue_.empty() || abandon_) return;
      next = queue_.front();
    }
    // An error of the stream's (a fault) ends the wait too: the work before
    // the event is over either way.
    if (!AwaitEvent(next.event)) return;
    cudaEventDestroy(next.event);
    End(next.end);
    MutexLock lock(&mu_);
    queue_.pop_front();
  }
}

}  // namespace optimd
