// Daemon metrics: latency histograms and the Prometheus text rendering of a
// GetMetricsResponse.
#ifndef OPTIMD_SERVER_METRICS_H_
#define OPTIMD_SERVER_METRICS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "common/mutex.h"
#include "optimd/v1/optimd.pb.h"

namespace optimd {

// A latency histogram with fixed bucket bounds (seconds). Thread-safe.
class LatencyHistogram {
 public:
  // Buckets from 10 microseconds to 10 seconds, roughly x2.5 apart.
  LatencyHistogram();

  void Observe(double seconds) ABSL_LOCKS_EXCLUDED(mu_);
  void ToProto(v1::Histogram* out) const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  const std::vector<double> bounds_;
  mutable Mutex mu_;
  std::vector<uint64_t> counts_ ABSL_GUARDED_BY(mu_);  // per bucket, +Inf last
  uint64_t count_ ABSL_GUARDED_BY(mu_) = 0;
  double sum_ ABSL_GUARDED_BY(mu_) = 0;
};

// Renders every field of `m` (except prometheus_text) in the Prometheus
// text exposition format, version 0.0.4.
std::string RenderPrometheus(const v1::GetMetricsResponse& m);

}  // namespace optimd

#endif  // OPTIMD_SERVER_METRICS_H_
