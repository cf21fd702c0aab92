#include "server/metrics.h"

#include <algorithm>
#include <charconv>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"

namespace optimd {

LatencyHistogram::LatencyHistogram()
    : bounds_({1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2,
               2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1, 2.5, 5, 10}),
      counts_(bounds_.size() + 1, 0) {}

void LatencyHistogram::Observe(double seconds) {
  const size_t i = static_cast<size_t>(
      std::lower_bound(bounds_.begin(), bounds_.end(), seconds) -
      bounds_.begin());
  MutexLock lock(&mu_);
  ++counts_[i];
  ++count_;
  sum_ += seconds;
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
  out->set_sum(sum_);
}

namespace {

// The shortest text that reads back as exactly `v` (Prometheus parses
// floats; StrCat would keep 6 significant digits).
std::string Exact(double v) {
  char buf[32];
  const auto r = std::to_chars(buf, buf + sizeof(buf), v);
  return std::string(buf, r.ptr);
}

std::string Escape(const std::string& s) {
  return absl::StrReplaceAll(s,
                             {{"\\", "\\\\"}, {"\"", "\\\""}, {"\n", "\\n"}});
}

void Histogram(std::string* out, const char* name, const char* help,
               const v1::Histogram& h) {
  absl::StrAppend(out, "# HELP ", name, " ", help, "\n# TYPE ", name,
                  " histogram\n");
  for (int i = 0; i < h.bounds_size(); ++i) {
    absl::StrAppend(out, name, "_bucket{le=\"", Exact(h.bounds(i)), "\"} ",
                    h.counts(i), "\n");
  }
  absl::StrAppend(out, name, "_bucket{le=\"+Inf\"} ", h.count(), "\n", name,
                  "_sum ", Exact(h.sum()), "\n", name, "_count ", h.count(),
                  "\n");
}

void Counter(std::string* out, const char* name, const char* help, uint64_t v,
             const char* type = "counter") {
  absl::StrAppend(out, "# HELP ", name, " ", help, "\n# TYPE ", name, " ", type,
                  "\n", name, " ", v, "\n");
}

}  // namespace

std::string RenderPrometheus(const v1::GetMetricsResponse& m) {
  std::string out;
  Counter(&out, "optimd_steps_total", "Optimizer steps applied.", m.steps());
  Counter(&out, "optimd_skipped_steps_total",
          "Steps skipped for non-finite gradients.", m.skipped_steps());
  Counter(&out, "optimd_plan_builds_total", "Group plans built.",
          m.plan_builds());
  Counter(&out, "optimd_plan_entry_updates_total",
          "Single plan entries updated in place.", m.plan_entry_updates());
  Counter(&out, "optimd_sessions", "Open sessions.", m.sessions(), "gauge");
  Counter(&out, "optimd_state_bytes", "Optimizer state bytes held.",
          m.state_bytes(), "gauge");
  Counter(&out, "optimd_checkpoint_saves_total", "Checkpoints saved.",
          m.checkpoint_saves());
  Counter(&out, "optimd_checkpoint_save_bytes_total", "Checkpoint bytes saved.",
          m.checkpoint_save_bytes());
  Counter(&out, "optimd_checkpoint_loads_total", "Checkpoints loaded.",
          m.checkpoint_loads());
  Counter(&out, "optimd_checkpoint_load_bytes_total",
          "Checkpoint bytes loaded.", m.checkpoint_load_bytes());
  Counter(&out, "optimd_checkpoint_failures_total",
          "Checkpoint calls that failed.", m.checkpoint_failures());
  Histogram(&out, "optimd_step_latency_seconds",
            "Time from a Step request to its reply.", m.step_latency());
  Histogram(&out, "optimd_step_host_seconds",
            "Host time of a Step on its device worker.", m.step_host_time());
  absl::StrAppend(&out,
                  "# HELP optimd_session_state_bytes Optimizer state bytes "
                  "per session.\n# TYPE optimd_session_state_bytes gauge\n");
  for (const auto& s : m.session_infos()) {
    absl::StrAppend(&out, "optimd_session_state_bytes{job_id=\"",
                    Escape(s.job_id()), "\",rank=\"", s.rank(), "\"} ",
                    s.state_bytes(), "\n");
  }
  absl::StrAppend(&out,
                  "# HELP optimd_session_steps_total Steps applied per "
                  "session.\n# TYPE optimd_session_steps_total counter\n");
  for (const auto& s : m.session_infos()) {
    absl::StrAppend(&out, "optimd_session_steps_total{job_id=\"",
                    Escape(s.job_id()), "\",rank=\"", s.rank(), "\"} ",
                    s.steps(), "\n");
  }
  return out;
}

}  // namespace optimd
