// The daemon never crashes on client input: thousands of requests with
// random field values (sizes, offsets, dtypes, names, handles, hyper-
// parameters, state blobs) against the real binary, mixed with valid ones.
// Every call must get an answer, and the daemon must stay healthy and stop
// cleanly. Seeded; the seed is printed, and OPTIMD_TEST_SEED replays it.
#include <cmath>
#include <limits>
#include <random>

#include "client/client.h"
#include "client/shm_tensor.h"
#include "gtest/gtest.h"
#include "testing/test_seed.h"
#include "tests/daemon_process.h"

namespace optimd {
namespace {

class Random {
 public:
  explicit Random(uint32_t seed) : rng_(seed) {}
  uint64_t U(uint64_t n) { return n == 0 ? 0 : rng_() % n; }
  bool Coin() { return U(2) == 0; }
  // Interesting 64-bit values: small, edge, huge.
  uint64_t Size() {
    static const uint64_t kEdges[] = {0,
                                      1,
                                      3,
                                      4,
                                      7,
                                      8,
                                      63,
                                      64,
                                      4096,
                                      (1u << 20) - 4,
                                      1u << 20,
                                      uint64_t{1} << 31,
                                      uint64_t{1} << 48,
                                      ~uint64_t{0},
                                      ~uint64_t{0} - 3};
    return Coin() ? kEdges[U(sizeof(kEdges) / sizeof(kEdges[0]))] : U(1 << 22);
  }
  double Real() {
    static const double kEdges[] = {
        0,           -1,    1e-3,
        0.9,         0.999, 1,
        2,           1e300, std::numeric_limits<double>::infinity(),
        std::nan("")};
    return kEdges[U(sizeof(kEdges) / sizeof(kEdges[0]))];
  }
  std::string Name() {
    static const char* kNames[] = {"w",   "b",        "",    "w",
                                   "x.y", "\xff\xfe", "a/b", "w"};
    return kNames[U(8)];
  }
  // Every dtype of the API (DTYPE_UNSPECIFIED to DTYPE_FLOAT8_E5M2 = 7) and
  // one past the last.
  v1::DType DType() { return static_cast<v1::DType>(U(9)); }

 private:
  std::mt19937_64 rng_;
};

TEST(RandomRequestsTest, DaemonSurvivesAndStaysConsistent) {
  const uint32_t seed = TestSeed();
  Random r(seed);
  // Sessions that say their ranks exchange statistics wait for the
  // others: briefly, so that random steps of a lone rank time out fast.
  auto daemon = DaemonProcess::Start(
      {"--max_state_bytes=100000000", "--rank_timeout_s=0.01"});
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  auto client = *(*daemon)->Connect();
  auto seg = *SharedMemoryRegion::Create(1 << 20);
  std::vector<std::string> segments = {seg->name(), "/optimd-missing",
                                       "relative", "/a/b", ""};
  auto handle = [&](v1::BufferHandle* h) {
    const uint64_t kind = r.U(4);
    if (kind == 0) return;  // unset
    if (kind == 3) {
      auto* c = h->mutable_cuda_ipc();
      c->set_ipc_handle(std::string(r.U(70), 'x'));
      c->set_device(static_cast<int32_t>(r.U(3)) - 1);
      c->set_offset(r.Size());
      c->set_size(r.Size());
      return;
    }
    auto* s = h->mutable_shared_memory();
    s->set_segment_name(segments[r.U(segments.size())]);
    s->set_offset(r.Coin() ? 4 * r.U(1000) : r.Size());
    s->set_size(r.Coin() ? 4 * r.U(1000) : r.Size());
  };
  int answered = 0;
  for (int i = 0; i < 3000; ++i) {
    if (client->session_token().empty() || r.U(50) == 0) {
      v1::CreateSessionRequest cs;
      cs.set_job_id(r.Coin() ? "job" : r.Name());
      cs.set_rank(static_cast<uint32_t>(r.U(3)));
      cs.set_world_size(static_cast<uint32_t>(r.U(3)));
      cs.set_device(static_cast<int32_t>(r.U(3)) - 1);
      cs.set_resume(true);
      if (r.U(10) == 0) cs.set_ready_event(std::string(r.U(80), 'e'));
      if (r.U(4) == 0) {
        cs.set_gradient_sharding(
            static_cast<v1::GradientSharding>(r.U(4)));  // 3: unknown
      }
      (void)client->CreateSession(cs);
      ++answered;
      continue;
    }
    if (r.U(8) == 0) {
      // A valid group, so that the other calls also meet real state.
      v1::RegisterGroupRequest g;
      g.set_group_id("g" + std::to_string(r.U(4)));
      g.mutable_hyperparameters()->set_lr(1e-3);
      g.mutable_hyperparameters()->set_amsgrad(r.Coin());
      // AdamW, SGD (with momentum or without) or Lion.
      g.mutable_hyperparameters()->set_optimizer(
          static_cast<v1::OptimizerKind>(r.U(4)));
      g.mutable_hyperparameters()->set_momentum(r.Coin() ? 0.9 : 0);
      g.mutable_hyperparameters()->set_beta2(0.99);
      for (uint64_t t = 1 + r.U(3); t > 0; --t) {
        auto* ts = g.add_tensors();
        ts->set_name("v" + std::to_string(r.U(1000)));
        const uint64_t n = r.U(500);
        ts->set_numel(n);
        ts->set_param_dtype(v1::DTYPE_FLOAT32);
        ts->set_grad_dtype(v1::DTYPE_FLOAT32);
        if (n > 0) {
          *ts->mutable_param() = seg->Handle(4 * r.U(100000), 4 * n);
          *ts->mutable_grad() = seg->Handle(4 * r.U(100000), 4 * n);
        }
      }
      (void)client->RegisterGroup(g);
      ++answered;
      continue;
    }
    switch (r.U(9)) {
      case 0:
      case 1: {
        v1::RegisterGroupRequest g;
        g.set_group_id(r.Coin() ? "g" : r.Name());
        auto* h = g.mutable_hyperparameters();
        h->set_lr(r.Real());
        h->set_beta1(r.Real());
        h->set_beta2(r.Coin() ? 0.999 : r.Real());
        h->set_eps(r.Real());
        h->set_weight_decay(r.Real());
        h->set_mode(static_cast<v1::AdamMode>(r.U(4)));
        h->set_amsgrad(r.Coin());
        h->set_optimizer(static_cast<v1::OptimizerKind>(r.U(5)));
        h->set_momentum(r.Coin() ? 0 : r.Real());
        h->set_dampening(r.Real());
        h->set_nesterov(r.Coin());
        g.mutable_layout()->set_master_weights(
            static_cast<v1::MasterWeights>(r.U(5)));
        g.mutable_layout()->set_moment_dtype(r.DType());
        for (uint64_t t = r.U(4); t > 0; --t) {
          auto* ts = g.add_tensors();
          ts->set_name(r.Name() + std::to_string(r.U(3)));
          ts->set_numel(r.Coin() ? r.U(300) : r.Size());
          ts->set_param_dtype(r.DType());
          ts->set_grad_dtype(r.DType());
          ts->set_frozen(r.U(5) == 0);
          ts->set_keep_fp32(r.U(5) == 0);
          handle(ts->mutable_param());
          handle(ts->mutable_grad());
        }
        (void)client->RegisterGroup(g);
        break;
      }
      case 2: {
        v1::StepRequest s;
        s.set_grad_scale(r.Coin() ? 0 : r.Real());
        s.set_max_grad_norm(r.Coin() ? 0 : r.Real());
        s.set_assume_finite(r.Coin());
        if (r.Coin()) {
          auto* o = s.add_overrides();
          o->set_group_id(r.Coin() ? "g" : r.Name());
          o->set_lr(r.Real());
          if (r.Coin()) o->set_beta1(r.Real());
          if (r.Coin()) o->set_momentum(r.Coin() ? 0 : r.Real());
        }
        if (r.U(4) == 0) {
          auto* u = s.add_buffer_updates();
          u->set_group_id("g");
          auto* t = u->add_tensors();
          t->set_name(r.Name() + std::to_string(r.U(3)));
          handle(t->mutable_param());
          handle(t->mutable_grad());
        }
        (void)(r.Coin() ? client->Step(s) : client->StreamStep(s));
        break;
      }
      case 3: {
        v1::SetStateRequest s;
        s.set_group_id(r.Coin() ? "g" : r.Name());
        s.set_step(r.Size());
        auto* t = s.add_tensors();
        t->set_tensor(r.Name() + std::to_string(r.U(3)));
        static const char* kKinds[] = {"exp_avg", "exp_avg_sq",
                                       "max_exp_avg_sq", "master", "bogus"};
        t->set_kind(kKinds[r.U(5)]);
        t->set_dtype(r.DType());
        t->set_numel(r.U(300));
        t->set_data(std::string(r.U(1200), '\x3f'));
        (void)client->SetState(s);
        if (r.Coin()) {
          v1::GetStateRequest g;
          g.set_metadata_only(r.Coin());
          if (r.Coin()) g.add_tensor_names(r.Name() + std::to_string(r.U(3)));
          (void)client->GetState(g);
        }
        break;
      }
      case 4:
        (void)client->UnregisterGroup(r.Coin() ? "g" : r.Name());
        break;
      case 5: {
        v1::GetParamsRequest g;
        if (r.Coin()) g.add_group_ids(r.Name());
        (void)client->GetParams(g);
        break;
      }
      case 6: {
        v1::UpdateBuffersRequest u;
        u.set_group_id(r.Coin() ? "g" : r.Name());
        auto* t = u.add_tensors();
        t->set_name(r.Name() + std::to_string(r.U(3)));
        handle(t->mutable_param());
        handle(t->mutable_grad());
        (void)client->UpdateBuffers(u);
        break;
      }
      case 7:
        if (r.U(10) == 0) (void)client->CloseSession();
        break;
      case 8:
        (void)client->ListSessions();
        break;
    }
    ++answered;
  }
  EXPECT_EQ(answered, 3000);
  auto metrics = client->GetMetrics();
  ASSERT_TRUE(metrics.ok()) << metrics.status();
  std::printf("plan builds %llu, steps %llu\n",
              static_cast<unsigned long long>(metrics->plan_builds()),
              static_cast<unsigned long long>(metrics->steps()));
  ASSERT_TRUE((*daemon)->Alive());
  auto fresh = *(*daemon)->Connect();
  auto health = fresh->Health();
  ASSERT_TRUE(health.ok()) << health.status();
  EXPECT_EQ(*health, "SERVING");
  EXPECT_EQ((*daemon)->Stop(), 0);
}

}  // namespace
}  // namespace optimd
