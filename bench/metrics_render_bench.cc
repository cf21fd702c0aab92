// Cost of rendering the daemon's Prometheus text (server/metrics.h) for a
// GetMetricsResponse with N sessions and both latency histograms filled:
// best and median of 10 rounds of `--renders` renders, microseconds each.
//
//   bazel run --config=nocuda //bench:metrics_render_bench -- 100 1000
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "server/metrics.h"

namespace {

optimd::v1::GetMetricsResponse Fill(int sessions) {
  optimd::v1::GetMetricsResponse m;
  m.set_steps(123456789);
  m.set_plan_builds(400);
  m.set_sessions(sessions);
  m.set_state_bytes(uint64_t{1} << 40);
  optimd::LatencyHistogram latency, host;
  for (int i = 0; i < 10000; ++i) {
    latency.Observe(1e-4 * (1 + i % 97));
    host.Observe(3e-5 * (1 + i % 89));
  }
  latency.ToProto(m.mutable_step_latency());
  host.ToProto(m.mutable_step_host_time());
  for (int i = 0; i < sessions; ++i) {
    auto* s = m.add_session_infos();
    s->set_job_id("job-" + std::to_string(i / 8));
    s->set_rank(i % 8);
    s->set_state_bytes(uint64_t{3} << 30);
    s->set_steps(100000 + i);
  }
  return m;
}

}  // namespace

int main(int argc, char** argv) {
  const int sessions = argc > 1 ? std::atoi(argv[1]) : 100;
  const int renders = argc > 2 ? std::atoi(argv[2]) : 1000;
  const optimd::v1::GetMetricsResponse m = Fill(sessions);
  size_t bytes = 0;
  std::vector<double> rounds;
  for (int r = 0; r < 10; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < renders; ++i)
      bytes = optimd::RenderPrometheus(m).size();
    const std::chrono::duration<double, std::micro> dt =
        std::chrono::steady_clock::now() - t0;
    rounds.push_back(dt.count() / renders);
  }
  std::sort(rounds.begin(), rounds.end());
  std::printf("sessions %d, %zu bytes: best %.1f us, median %.1f us\n",
              sessions, bytes, rounds.front(), rounds[rounds.size() / 2]);
  return 0;
}
