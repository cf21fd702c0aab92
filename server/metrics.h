// Daemon metrics: latency histograms, and a GetMetricsResponse as Prometheus
// metric families and text (through prometheus-cpp, Debian's
// prometheus-cpp-dev).
#ifndef OPTIMD_SERVER_METRICS_H_
#define OPTIMD_SERVER_METRICS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "common/mutex.h"
#include "optimd/v1/optimd.pb.h"
#include "prometheus/metric_family.h"

namespace optimd {

// A latency histogram with fixed bucket bounds (seconds). Thread-safe.
//
// The sum is kept in whole nanoseconds: exact (a sum of doubles drifts), and
// its value in seconds, the nearest double to nanoseconds / 1e9, is a decimal
// of at most 16 significant digits below 2^53 ns (104 days of summed
// latency), so the 16 digits prometheus-cpp writes read back as the very
// same double (see RenderPrometheus). Past 2^53 ns, ToProto gives the sum
// as those 16 digits read back, so that the text still carries it exactly.
class LatencyHistogram {
 public:
  // Buckets from 10 microseconds to 10 seconds, roughly x2.5 apart.
  LatencyHistogram();

  // Counts `seconds`, rounded to the nanosecond for the sum; a negative or
  // NaN duration counts as 0.
  void Observe(double seconds) ABSL_LOCKS_EXCLUDED(mu_);
  void ToProto(v1::Histogram* out) const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  const std::vector<double> bounds_;
  mutable Mutex mu_;
  std::vector<uint64_t> counts_ ABSL_GUARDED_BY(mu_);  // per bucket, +Inf last
  uint64_t count_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t sum_ns_ ABSL_GUARDED_BY(mu_) = 0;
};

// The fields of `m` as Prometheus metric families: the daemon's version and
// API revision (optimd_build_info, labels of a constant 1), then in the
// order of the proto the counters and gauges, the histograms, and
// per-session state bytes and steps labelled job_id and rank. The response
// is already a snapshot, so the families are built from it directly rather
// than through a prometheus::Registry of live metrics.
std::vector<prometheus::MetricFamily> MetricFamilies(
    const v1::GetMetricsResponse& m);

// MetricFamilies(m) in the Prometheus text exposition format, version
// 0.0.4, by prometheus::TextSerializer. It writes values to 16 significant
// digits (prometheus-cpp 1.0 sets that precision itself; only scientific
// notation, which would also rewrite every bucket's `le` label, gets 17),
// which is full precision for every value the daemon has: integers up to
// 2^53, and histogram sums kept in nanoseconds (LatencyHistogram) read back
// as the same doubles GetMetricsResponse carries.
std::string RenderPrometheus(const v1::GetMetricsResponse& m);

}  // namespace optimd

#endif  // OPTIMD_SERVER_METRICS_H_
