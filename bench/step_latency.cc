// Step round trip over the daemon's Unix socket for a trivial group (one
// tensor of 16 elements): p50 and p99 of the client-observed latency.
//
//   bazel-bin/bench/step_latency --target=unix:/path [--device=-1|0]
//
// --device=-1 uses shared memory (CPU backend); --device=N CUDA IPC buffers
// of a forked trainer process (CUDA backend).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "client/client.h"
#include "client/shm_tensor.h"
#include "testing/ipc_trainer.h"

ABSL_FLAG(std::string, target, "", "Daemon address.");
ABSL_FLAG(int, device, -1, "-1: CPU backend; N: CUDA device N.");
ABSL_FLAG(int, steps, 2000, "Timed steps.");
ABSL_FLAG(bool, wait, false, "StepRequest.wait (CUDA).");
ABSL_FLAG(bool, stream, false, "Step over StepStream instead of unary Step.");

namespace optimd {
namespace {

// Steps before the timed ones, left out of the percentiles.
constexpr int kWarmUpSteps = 200;

// Opens the benchmark's session, of job "latency" on `device`. False, with
// the reason on stderr, when the daemon refuses it.
bool OpenSession(Client* client, int device) {
  v1::CreateSessionRequest cs;
  cs.set_job_id("latency");
  cs.set_world_size(1);
  cs.set_device(device);
  if (auto s = client->CreateSession(cs); !s.ok()) {
    std::fprintf(stderr, "%s\n", s.status().ToString().c_str());
    return false;
  }
  return true;
}

// Group "g" of one fp32 tensor "w" of 16 elements: over the shared-memory
// segment it creates in `shm` for the CPU backend (device < 0), else over
// a CUDA allocation of `trainer`. Param at offset 0, grad at 1024.
v1::RegisterGroupRequest TrivialGroup(
    int device, IpcTrainer* trainer, std::unique_ptr<SharedMemoryRegion>* shm) {
  v1::RegisterGroupRequest rg;
  rg.set_group_id("g");
  rg.mutable_hyperparameters()->set_lr(1e-3);
  auto* t = rg.add_tensors();
  t->set_name("w");
  t->set_numel(16);
  t->set_param_dtype(v1::DTYPE_FLOAT32);
  t->set_grad_dtype(v1::DTYPE_FLOAT32);
  if (device < 0) {
    *shm = *SharedMemoryRegion::Create(4096);
    *t->mutable_param() = (*shm)->Handle(0, 64);
    *t->mutable_grad() = (*shm)->Handle(1024, 64);
  } else {
    auto p = trainer->Alloc(4096);
    auto* ipc = t->mutable_param()->mutable_cuda_ipc();
    ipc->set_ipc_handle(p->ipc_handle);
    ipc->set_device(device);
    ipc->set_size(64);
    auto* gipc = t->mutable_grad()->mutable_cuda_ipc();
    *gipc = *ipc;
    gipc->set_offset(1024);
  }
  return rg;
}

// Steps the session kWarmUpSteps + --steps times (unary or over
// StepStream, as --stream says) and gives the round trips after the
// warm-up, in microseconds, sorted. False, with the reason on stderr, on
// the first step that fails.
bool TimeSteps(Client* client, std::vector<double>* us) {
  v1::StepRequest sr;
  sr.set_wait(absl::GetFlag(FLAGS_wait));
  for (int i = 0; i < kWarmUpSteps + absl::GetFlag(FLAGS_steps); ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    auto r =
        absl::GetFlag(FLAGS_stream) ? client->StreamStep(sr) : client->Step(sr);
    const auto t1 = std::chrono::steady_clock::now();
    if (!r.ok()) {
      std::fprintf(stderr, "%s\n", r.status().ToString().c_str());
      return false;
    }
    if (i >= kWarmUpSteps)
      us->push_back(std::chrono::duration<double>(t1 - t0).count() * 1e6);
  }
  std::sort(us->begin(), us->end());
  return true;
}

// The client's view: p50, p99 and max of the sorted round trips `us`.
void PrintRoundTrip(const std::vector<double>& us, int device) {
  std::printf(
      "%s round trip (%s backend, %zu steps%s): p50 %.1f us, p99 "
      "%.1f us, max %.1f us\n",
      absl::GetFlag(FLAGS_stream) ? "StepStream" : "Step",
      device < 0 ? "cpu" : "cuda", us.size(),
      absl::GetFlag(FLAGS_wait) ? ", wait" : "", us[us.size() / 2],
      us[us.size() * 99 / 100], us.back());
}

// The daemon's own view: host time per Step on its worker (all steps of
// this run, warm-up included, unless other clients step too). Nothing is
// printed when the daemon gives no metrics.
void PrintDaemonHostTime(Client* client) {
  auto m = client->GetMetrics();
  if (!m.ok()) return;
  const auto& h = m->step_host_time();
  uint64_t half = (h.count() + 1) / 2;
  double p50 = 0;
  for (int i = 0; i < h.bounds_size(); ++i) {
    if (h.counts(i) >= half) {
      p50 = h.bounds(i);
      break;
    }
  }
  std::printf(
      "daemon host time per Step (metrics): mean %.1f us, p50 <= "
      "%.0f us over %llu steps\n",
      h.count() ? h.sum() / h.count() * 1e6 : 0.0, p50 * 1e6,
      static_cast<unsigned long long>(h.count()));
}

}  // namespace
}  // namespace optimd

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const int device = absl::GetFlag(FLAGS_device);
  std::unique_ptr<optimd::IpcTrainer> trainer;
  if (device >= 0) {
    auto t = optimd::IpcTrainer::Start(device, 4096);
    if (!t.ok()) return 1;
    trainer = *std::move(t);
  }
  auto client = optimd::Client::Create(absl::GetFlag(FLAGS_target));
  if (!client.ok()) {
    std::fprintf(stderr, "%s\n", client.status().ToString().c_str());
    return 1;
  }
  if (!optimd::OpenSession(client->get(), device)) return 1;
  // The segment of the CPU backend's tensor, kept until the end.
  std::unique_ptr<optimd::SharedMemoryRegion> shm;
  const optimd::v1::RegisterGroupRequest rg =
      optimd::TrivialGroup(device, trainer.get(), &shm);
  if (auto r = (*client)->RegisterGroup(rg); !r.ok()) {
    std::fprintf(stderr, "%s\n", r.status().ToString().c_str());
    return 1;
  }
  std::vector<double> us;
  if (!optimd::TimeSteps(client->get(), &us)) return 1;
  optimd::PrintRoundTrip(us, device);
  optimd::PrintDaemonHostTime(client->get());
  (void)(*client)->CloseSession();
  return 0;
}
