#include "server/metrics.h"

#include "gtest/gtest.h"

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

}  // namespace
}  // namespace optimd
