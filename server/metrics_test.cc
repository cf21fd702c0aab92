#include "server/metrics.h"

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <random>
#include <set>
#include <string>

#include "gtest/gtest.h"
#include "prometheus/check_names.h"

namespace optimd {
namespace {

TEST(MetricsTest, HistogramIsCumulative) {
  LatencyHistogram h;
  h.Observe(5e-6);
  h.Observe(2e-4);
  h.Observe(100);
  v1::Histogram p;
  h.ToProto(&p);
  EXPECT_EQ(p.count(), 3u);
  EXPECT_NEAR(p.sum(), 100.000205, 1e-9);
  EXPECT_EQ(p.counts(0), 1u);                    // <= 10us
  EXPECT_EQ(p.counts(p.counts_size() - 1), 2u);  // <= 10s
  for (int i = 1; i < p.counts_size(); ++i)
    EXPECT_GE(p.counts(i), p.counts(i - 1));
}

TEST(MetricsTest, PrometheusText) {
  v1::GetMetricsResponse m;
  m.set_daemon_version("1.2.3");
  m.set_api_revision(9);
  m.set_steps(42);
  m.set_plan_builds(3);
  m.set_checkpoint_saves(2);
  auto* s = m.add_session_infos();
  s->set_job_id("job\"x");
  s->set_rank(1);
  s->set_state_bytes(1024);
  LatencyHistogram h;
  h.Observe(1e-3);
  h.ToProto(m.mutable_step_latency());
  const std::string text = RenderPrometheus(m);
  EXPECT_NE(text.find("# TYPE optimd_build_info gauge\n"
                      "optimd_build_info{version=\"1.2.3\",api_revision=\"9\"}"
                      " 1\n"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("optimd_steps_total 42\n"), std::string::npos);
  EXPECT_NE(text.find("optimd_plan_builds_total 3\n"), std::string::npos);
  EXPECT_NE(text.find("optimd_checkpoint_saves_total 2\n"), std::string::npos);
  EXPECT_NE(text.find("# TYPE optimd_step_latency_seconds histogram"),
            std::string::npos);
  EXPECT_NE(text.find("optimd_step_latency_seconds_bucket{le=\"+Inf\"} 1\n"),
            std::string::npos);
  EXPECT_NE(
      text.find(
          "optimd_session_state_bytes{job_id=\"job\\\"x\",rank=\"1\"} 1024"),
      std::string::npos);
  // Full precision: the sum reads back exactly.
  EXPECT_NE(text.find("optimd_step_latency_seconds_sum 0.001\n"),
            std::string::npos);
  m.mutable_step_latency()->set_sum(1234.56789012345);
  EXPECT_NE(RenderPrometheus(m).find("_sum 1234.56789012345\n"),
            std::string::npos);
}

// The value of the line of `text` that starts with `name` and a space, as
// a Prometheus parser reads it (strtod), or NaN when there is none.
double ValueOf(const std::string& text, const std::string& name) {
  const size_t at = text.find("\n" + name + " ");
  if (at == std::string::npos) return std::nan("");
  return std::strtod(text.c_str() + at + name.size() + 2, nullptr);
}

// Histogram sums read back from the text as the very doubles the daemon
// holds, although prometheus-cpp writes 16 significant digits: a sum of
// doubles often needs 17 (0.1 + 0.2 is 0.30000000000000004), one of whole
// nanoseconds never does.
TEST(MetricsTest, HistogramSumsKeepFullPrecisionInTheText) {
  std::mt19937_64 random(7);
  for (int trial = 0; trial < 200; ++trial) {
    LatencyHistogram h;
    uint64_t ns = 0;
    for (int i = 0; i < 10; ++i) {
      const uint64_t d = random() % 100000000;  // up to 0.1 s
      ns += d;
      h.Observe(static_cast<double>(d) * 1e-9);
    }
    v1::GetMetricsResponse m;
    h.ToProto(m.mutable_step_latency());
    ASSERT_EQ(m.step_latency().sum(), static_cast<double>(ns) / 1e9);
    const std::string text = RenderPrometheus(m);
    ASSERT_EQ(ValueOf(text, "optimd_step_latency_seconds_sum"),
              m.step_latency().sum())
        << text;
  }
  LatencyHistogram h;
  h.Observe(0.1);
  h.Observe(0.2);
  v1::GetMetricsResponse m;
  h.ToProto(m.mutable_step_host_time());
  EXPECT_EQ(m.step_host_time().sum(), 0.3);
  // Nothing negative or NaN enters the sum.
  h.Observe(-1);
  h.Observe(std::nan(""));
  v1::Histogram after;
  h.ToProto(&after);
  EXPECT_EQ(after.sum(), 0.3);
  EXPECT_EQ(after.count(), 4u);
}

// The same over the whole range of a sum: below 2^53 ns (104 days) every
// sum reads back unchanged; past it, where nanoseconds / 1e9 may need 17
// digits, the reply's sum is itself the 16-digit value the text carries,
// so a scrape and GetMetrics still agree exactly.
TEST(MetricsTest, HistogramSumsReadBackAtEveryMagnitude) {
  std::mt19937_64 random(11);
  int past_2_53 = 0;
  for (int trial = 0; trial < 20000; ++trial) {
    LatencyHistogram h;
    // Log-uniform durations from 1 ns to the 9.2e9 s clamp, a few each.
    const int n = 1 + static_cast<int>(random() % 3);
    uint64_t ns = 0;
    for (int i = 0; i < n; ++i) {
      const double seconds = std::pow(
          10.0, std::uniform_real_distribution<double>(-9, 9.96)(random));
      const uint64_t d = static_cast<uint64_t>(std::llround(seconds * 1e9));
      ns = ns + d < ns ? UINT64_MAX : ns + d;
      h.Observe(seconds);
    }
    v1::GetMetricsResponse m;
    h.ToProto(m.mutable_step_latency());
    const double sum = m.step_latency().sum();
    if (ns < (uint64_t{1} << 53)) {
      ASSERT_EQ(sum, static_cast<double>(ns) / 1e9) << ns;
    } else {
      ++past_2_53;
      ASSERT_NEAR(sum, static_cast<double>(ns) / 1e9, 1e-15 * sum) << ns;
    }
    const std::string text = RenderPrometheus(m);
    ASSERT_EQ(ValueOf(text, "optimd_step_latency_seconds_sum"), sum)
        << ns << "\n"
        << text;
  }
  EXPECT_GT(past_2_53, 1000);
}

// Every family the daemon has exposed so far, by name and type: a renamed or
// dropped series breaks dashboards, so it must be a decision, not a side
// effect.
TEST(MetricsTest, EveryFamilyKeepsItsNameAndType) {
  v1::GetMetricsResponse m;
  m.add_session_infos()->set_job_id("j");
  std::set<std::string> seen;
  for (const prometheus::MetricFamily& f : MetricFamilies(m)) {
    EXPECT_TRUE(prometheus::CheckMetricName(f.name)) << f.name;
    for (const auto& metric : f.metric) {
      for (const auto& label : metric.label) {
        EXPECT_TRUE(prometheus::CheckLabelName(label.name)) << label.name;
      }
    }
    seen.insert(f.name + " " + std::to_string(static_cast<int>(f.type)));
  }
  const auto type = [](prometheus::MetricType t) {
    return " " + std::to_string(static_cast<int>(t));
  };
  const auto counter = type(prometheus::MetricType::Counter);
  const auto gauge = type(prometheus::MetricType::Gauge);
  const auto histogram = type(prometheus::MetricType::Histogram);
  EXPECT_EQ(seen, (std::set<std::string>{
                      "optimd_build_info" + gauge,
                      "optimd_steps_total" + counter,
                      "optimd_skipped_steps_total" + counter,
                      "optimd_plan_builds_total" + counter,
                      "optimd_plan_entry_updates_total" + counter,
                      "optimd_sessions" + gauge,
                      "optimd_state_bytes" + gauge,
                      "optimd_metadata_bytes" + gauge,
                      "optimd_worker_tasks" + gauge,
                      "optimd_checkpoint_saves_total" + counter,
                      "optimd_checkpoint_save_bytes_total" + counter,
                      "optimd_checkpoint_loads_total" + counter,
                      "optimd_checkpoint_load_bytes_total" + counter,
                      "optimd_checkpoint_failures_total" + counter,
                      "optimd_step_latency_seconds" + histogram,
                      "optimd_step_host_seconds" + histogram,
                      "optimd_step_device_seconds" + histogram,
                      "optimd_step_ready_wait_seconds" + histogram,
                      "optimd_session_state_bytes" + gauge,
                      "optimd_session_steps_total" + counter,
                  }));
}

// Values as the text carries them: integers exact up to 2^53, label values
// escaped, bucket bounds as Prometheus's own clients write them.
TEST(MetricsTest, TextValuesAndLabels) {
  v1::GetMetricsResponse m;
  m.set_state_bytes(uint64_t{1} << 53);
  m.set_checkpoint_load_bytes(123456789012345);
  auto* s = m.add_session_infos();
  s->set_job_id("a\\b\n\"c");
  s->set_rank(3);
  s->set_steps(7);
  LatencyHistogram h;
  h.Observe(3e-4);
  h.ToProto(m.mutable_step_host_time());
  const std::string text = RenderPrometheus(m);
  EXPECT_NE(text.find("\noptimd_state_bytes 9007199254740992\n"),
            std::string::npos);
  EXPECT_NE(text.find("\noptimd_checkpoint_load_bytes_total 123456789012345\n"),
            std::string::npos);
  EXPECT_NE(text.find("\noptimd_session_steps_total{job_id=\"a\\\\b\\n\\\"c\","
                      "rank=\"3\"} 7\n"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("\noptimd_step_host_seconds_bucket{le=\"0.00025\"} 0\n"
                      "optimd_step_host_seconds_bucket{le=\"0.0005\"} 1\n"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("# HELP optimd_sessions Open sessions.\n"
                      "# TYPE optimd_sessions gauge\noptimd_sessions 0\n"),
            std::string::npos);
}

}  // namespace
}  // namespace optimd
