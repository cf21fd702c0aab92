#include "server/metrics.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <utility>

#include "prometheus/client_metric.h"
#include "prometheus/metric_type.h"
#include "prometheus/text_serializer.h"

namespace optimd {
namespace {

// `v` as it reads back from the 16 significant digits prometheus-cpp's text
// gives it (RenderPrometheus). A sum below 2^53 ns is unchanged (its value in
// seconds never needs a 17th digit); past it, nanoseconds / 1e9 may need 17,
// and GetMetricsResponse then carries the same 16-digit value as the text
// (at most 5 parts in 10^16 off), so that the two always agree.
double AsWritten(double v) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.16g", v);
  return std::strtod(text, nullptr);
}

}  // namespace

LatencyHistogram::LatencyHistogram()
    : bounds_({1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2,
               2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1, 2.5, 5, 10}),
      counts_(bounds_.size() + 1, 0) {}

void LatencyHistogram::Observe(double seconds) {
  if (!(seconds > 0)) seconds = 0;  // NaN too
  const size_t i = static_cast<size_t>(
      std::lower_bound(bounds_.begin(), bounds_.end(), seconds) -
      bounds_.begin());
  // Durations past 2^63 ns (292 years) are clamped.
  const uint64_t ns = seconds >= 9.2e9
                          ? uint64_t{9200000000000000000u}
                          : static_cast<uint64_t>(std::llround(seconds * 1e9));
  MutexLock lock(&mu_);
  ++counts_[i];
  ++count_;
  sum_ns_ = ns > UINT64_MAX - sum_ns_ ? UINT64_MAX : sum_ns_ + ns;
}

void LatencyHistogram::ToProto(v1::Histogram* out) const {
  MutexLock lock(&mu_);
  uint64_t cumulative = 0;
  for (size_t i = 0; i < bounds_.size(); ++i) {
    cumulative += counts_[i];
    out->add_bounds(bounds_[i]);
    out->add_counts(cumulative);
  }
  out->set_count(count_);
  out->set_sum(AsWritten(static_cast<double>(sum_ns_) / 1e9));
}

namespace {

using prometheus::ClientMetric;
using prometheus::MetricFamily;
using prometheus::MetricType;

MetricFamily Family(const char* name, const char* help, MetricType type) {
  MetricFamily f;
  f.name = name;
  f.help = help;
  f.type = type;
  return f;
}

// A family of one unlabelled counter or gauge. prometheus-cpp holds every
// value as a double: integers are exact up to 2^53, far above any count or
// byte total the daemon reaches.
MetricFamily Scalar(const char* name, const char* help, uint64_t v,
                    MetricType type = MetricType::Counter) {
  MetricFamily f = Family(name, help, type);
  ClientMetric m;
  (type == MetricType::Counter ? m.counter.value : m.gauge.value) =
      static_cast<double>(v);
  f.metric.push_back(std::move(m));
  return f;
}

// The proto's buckets are cumulative already, as the text format wants;
// the serializer adds the +Inf bucket from the total count.
MetricFamily Histogram(const char* name, const char* help,
                       const v1::Histogram& h) {
  MetricFamily f = Family(name, help, MetricType::Histogram);
  ClientMetric m;
  m.histogram.sample_count = h.count();
  m.histogram.sample_sum = h.sum();
  for (int i = 0; i < h.bounds_size() && i < h.counts_size(); ++i) {
    m.histogram.bucket.push_back({h.counts(i), h.bounds(i)});
  }
  f.metric.push_back(std::move(m));
  return f;
}

// The daemon's version and API revision as the labels of a constant 1, the
// Prometheus convention for build information (a query joins on it, and an
// upgrade shows as a new series).
MetricFamily BuildInfo(const v1::GetMetricsResponse& r) {
  MetricFamily f =
      Family("optimd_build_info",
             "The daemon's version and API revision (labels); always 1.",
             MetricType::Gauge);
  ClientMetric m;
  m.label = {{"version", r.daemon_version()},
             {"api_revision", std::to_string(r.api_revision())}};
  m.gauge.value = 1;
  f.metric.push_back(std::move(m));
  return f;
}

// One series per session, labelled job_id and rank (not `job`, which is
// Prometheus's own label for the scrape target).
MetricFamily PerSession(const char* name, const char* help, MetricType type,
                        const v1::GetMetricsResponse& r,
                        uint64_t (v1::SessionInfo::*field)() const) {
  MetricFamily f = Family(name, help, type);
  f.metric.reserve(r.session_infos_size());
  for (const v1::SessionInfo& s : r.session_infos()) {
    ClientMetric m;
    m.label = {{"job_id", s.job_id()}, {"rank", std::to_string(s.rank())}};
    const double v = static_cast<double>((s.*field)());
    (type == MetricType::Counter ? m.counter.value : m.gauge.value) = v;
    f.metric.push_back(std::move(m));
  }
  return f;
}

}  // namespace

std::vector<MetricFamily> MetricFamilies(const v1::GetMetricsResponse& m) {
  std::vector<MetricFamily> out;
  out.push_back(BuildInfo(m));
  out.push_back(
      Scalar("optimd_steps_total", "Optimizer steps applied.", m.steps()));
  out.push_back(Scalar("optimd_skipped_steps_total",
                       "Steps skipped for non-finite gradients.",
                       m.skipped_steps()));
  out.push_back(Scalar("optimd_plan_builds_total", "Group plans built.",
                       m.plan_builds()));
  out.push_back(Scalar("optimd_plan_entry_updates_total",
                       "Single plan entries updated in place.",
                       m.plan_entry_updates()));
  out.push_back(Scalar("optimd_sessions", "Open sessions.", m.sessions(),
                       MetricType::Gauge));
  out.push_back(Scalar("optimd_state_bytes", "Optimizer state bytes held.",
                       m.state_bytes(), MetricType::Gauge));
  out.push_back(Scalar("optimd_metadata_bytes",
                       "Memory estimated for registered tensors' names, "
                       "aliases, shapes and entries.",
                       m.metadata_bytes(), MetricType::Gauge));
  out.push_back(Scalar("optimd_worker_tasks",
                       "Requests waiting for or running on device workers.",
                       m.worker_tasks(), MetricType::Gauge));
  out.push_back(Scalar("optimd_checkpoint_saves_total", "Checkpoints saved.",
                       m.checkpoint_saves()));
  out.push_back(Scalar("optimd_checkpoint_save_bytes_total",
                       "Checkpoint bytes saved.", m.checkpoint_save_bytes()));
  out.push_back(Scalar("optimd_checkpoint_loads_total", "Checkpoints loaded.",
                       m.checkpoint_loads()));
  out.push_back(Scalar("optimd_checkpoint_load_bytes_total",
                       "Checkpoint bytes loaded.", m.checkpoint_load_bytes()));
  out.push_back(Scalar("optimd_checkpoint_failures_total",
                       "Checkpoint calls that failed.",
                       m.checkpoint_failures()));
  out.push_back(Histogram("optimd_step_latency_seconds",
                          "Time from a Step request to its reply.",
                          m.step_latency()));
  out.push_back(Histogram("optimd_step_host_seconds",
                          "Host time of a Step on its device worker.",
                          m.step_host_time()));
  out.push_back(Histogram("optimd_step_device_seconds",
                          "Device time of a step's own work (CUDA).",
                          m.step_device_time()));
  out.push_back(Histogram(
      "optimd_step_ready_wait_seconds",
      "Time the device's stream waited for the trainer's ready flag (CUDA).",
      m.step_ready_wait()));
  out.push_back(PerSession(
      "optimd_session_state_bytes", "Optimizer state bytes per session.",
      MetricType::Gauge, m, &v1::SessionInfo::state_bytes));
  out.push_back(PerSession("optimd_session_steps_total",
                           "Steps applied per session.", MetricType::Counter, m,
                           &v1::SessionInfo::steps));
  return out;
}

std::string RenderPrometheus(const v1::GetMetricsResponse& m) {
  return prometheus::TextSerializer().Serialize(MetricFamilies(m));
}

}  // namespace optimd
