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

// Sends requests of random fields through one client: each call to
// SendOne() sends one request (or none, for a close that the dice skip)
// and takes its answer, whatever it is. Every choice comes from `r`, in a
// fixed order, so that a seed replays the same requests. Not thread-safe.
class RandomRequests {
 public:
  // `seg`: a real segment, one of the names that buffer handles use.
  RandomRequests(Random* r, Client* client, const SharedMemoryRegion* seg)
      : r_(*r),
        client_(client),
        seg_(seg),
        segments_{seg->name(), "/optimd-missing", "relative", "/a/b", ""} {}

  // A new session while there is none (and now and then anyway), else a
  // valid group now and then, else one request of a random kind.
  void SendOne() {
    if (client_->session_token().empty() || r_.U(50) == 0) {
      CreateSession();
    } else if (r_.U(8) == 0) {
      RegisterValidGroup();
    } else {
      SendRandomKind();
    }
  }

 private:
  void SendRandomKind() {
    switch (r_.U(9)) {
      case 0:
      case 1:
        RegisterRandomGroup();
        break;
      case 2:
        Step();
        break;
      case 3:
        SetAndGetState();
        break;
      case 4:
        (void)client_->UnregisterGroup(r_.Coin() ? "g" : r_.Name());
        break;
      case 5: {
        v1::GetParamsRequest g;
        if (r_.Coin()) g.add_group_ids(r_.Name());
        (void)client_->GetParams(g);
        break;
      }
      case 6:
        UpdateBuffers();
        break;
      case 7:
        if (r_.U(10) == 0) (void)client_->CloseSession();
        break;
      case 8:
        (void)client_->ListSessions();
        break;
    }
  }

  // A buffer handle left unset, over shared memory (a real segment or a
  // bad name, aligned or random offset and size) or CUDA IPC.
  void FillHandle(v1::BufferHandle* h) {
    const uint64_t kind = r_.U(4);
    if (kind == 0) return;  // unset
    if (kind == 3) {
      auto* c = h->mutable_cuda_ipc();
      c->set_ipc_handle(std::string(r_.U(70), 'x'));
      c->set_device(static_cast<int32_t>(r_.U(3)) - 1);
      c->set_offset(r_.Size());
      c->set_size(r_.Size());
      return;
    }
    auto* s = h->mutable_shared_memory();
    s->set_segment_name(segments_[r_.U(segments_.size())]);
    s->set_offset(r_.Coin() ? 4 * r_.U(1000) : r_.Size());
    s->set_size(r_.Coin() ? 4 * r_.U(1000) : r_.Size());
  }

  void CreateSession() {
    v1::CreateSessionRequest cs;
    cs.set_job_id(r_.Coin() ? "job" : r_.Name());
    cs.set_rank(static_cast<uint32_t>(r_.U(3)));
    cs.set_world_size(static_cast<uint32_t>(r_.U(3)));
    cs.set_device(static_cast<int32_t>(r_.U(3)) - 1);
    cs.set_resume(true);
    if (r_.U(10) == 0) cs.set_ready_event(std::string(r_.U(80), 'e'));
    if (r_.U(4) == 0) {
      cs.set_gradient_sharding(
          static_cast<v1::GradientSharding>(r_.U(4)));  // 3: unknown
    }
    (void)client_->CreateSession(cs);
  }

  // A valid group, so that the other calls also meet real state.
  void RegisterValidGroup() {
    v1::RegisterGroupRequest g;
    g.set_group_id("g" + std::to_string(r_.U(4)));
    g.mutable_hyperparameters()->set_lr(1e-3);
    g.mutable_hyperparameters()->set_amsgrad(r_.Coin());
    // AdamW, SGD (with momentum or without) or Lion.
    g.mutable_hyperparameters()->set_optimizer(
        static_cast<v1::OptimizerKind>(r_.U(4)));
    g.mutable_hyperparameters()->set_momentum(r_.Coin() ? 0.9 : 0);
    g.mutable_hyperparameters()->set_beta2(0.99);
    for (uint64_t t = 1 + r_.U(3); t > 0; --t) {
      auto* ts = g.add_tensors();
      ts->set_name("v" + std::to_string(r_.U(1000)));
      const uint64_t n = r_.U(500);
      ts->set_numel(n);
      ts->set_param_dtype(v1::DTYPE_FLOAT32);
      ts->set_grad_dtype(v1::DTYPE_FLOAT32);
      if (n > 0) {
        *ts->mutable_param() = seg_->Handle(4 * r_.U(100000), 4 * n);
        *ts->mutable_grad() = seg_->Handle(4 * r_.U(100000), 4 * n);
      }
    }
    (void)client_->RegisterGroup(g);
  }

  // A group of random hyperparameters, layout and tensors.
  void RegisterRandomGroup() {
    v1::RegisterGroupRequest g;
    g.set_group_id(r_.Coin() ? "g" : r_.Name());
    auto* h = g.mutable_hyperparameters();
    h->set_lr(r_.Real());
    h->set_beta1(r_.Real());
    h->set_beta2(r_.Coin() ? 0.999 : r_.Real());
    h->set_eps(r_.Real());
    h->set_weight_decay(r_.Real());
    h->set_mode(static_cast<v1::AdamMode>(r_.U(4)));
    h->set_amsgrad(r_.Coin());
    h->set_optimizer(static_cast<v1::OptimizerKind>(r_.U(5)));
    h->set_momentum(r_.Coin() ? 0 : r_.Real());
    h->set_dampening(r_.Real());
    h->set_nesterov(r_.Coin());
    g.mutable_layout()->set_master_weights(
        static_cast<v1::MasterWeights>(r_.U(5)));
    g.mutable_layout()->set_moment_dtype(r_.DType());
    for (uint64_t t = r_.U(4); t > 0; --t) {
      auto* ts = g.add_tensors();
      ts->set_name(r_.Name() + std::to_string(r_.U(3)));
      ts->set_numel(r_.Coin() ? r_.U(300) : r_.Size());
      ts->set_param_dtype(r_.DType());
      ts->set_grad_dtype(r_.DType());
      ts->set_frozen(r_.U(5) == 0);
      ts->set_keep_fp32(r_.U(5) == 0);
      FillHandle(ts->mutable_param());
      FillHandle(ts->mutable_grad());
    }
    (void)client_->RegisterGroup(g);
  }

  // A step of random scales, overrides and buffer updates, unary or over
  // StepStream.
  void Step() {
    v1::StepRequest s;
    s.set_grad_scale(r_.Coin() ? 0 : r_.Real());
    s.set_max_grad_norm(r_.Coin() ? 0 : r_.Real());
    s.set_assume_finite(r_.Coin());
    if (r_.Coin()) {
      auto* o = s.add_overrides();
      o->set_group_id(r_.Coin() ? "g" : r_.Name());
      o->set_lr(r_.Real());
      if (r_.Coin()) o->set_beta1(r_.Real());
      if (r_.Coin()) o->set_momentum(r_.Coin() ? 0 : r_.Real());
    }
    if (r_.U(4) == 0) {
      auto* u = s.add_buffer_updates();
      u->set_group_id("g");
      auto* t = u->add_tensors();
      t->set_name(r_.Name() + std::to_string(r_.U(3)));
      FillHandle(t->mutable_param());
      FillHandle(t->mutable_grad());
    }
    (void)(r_.Coin() ? client_->Step(s) : client_->StreamStep(s));
  }

  // A SetState of one random blob, now and then followed by a GetState.
  void SetAndGetState() {
    v1::SetStateRequest s;
    s.set_group_id(r_.Coin() ? "g" : r_.Name());
    s.set_step(r_.Size());
    auto* t = s.add_tensors();
    t->set_tensor(r_.Name() + std::to_string(r_.U(3)));
    static const char* kKinds[] = {"exp_avg", "exp_avg_sq", "max_exp_avg_sq",
                                   "master", "bogus"};
    t->set_kind(kKinds[r_.U(5)]);
    t->set_dtype(r_.DType());
    t->set_numel(r_.U(300));
    t->set_data(std::string(r_.U(1200), '\x3f'));
    (void)client_->SetState(s);
    if (r_.Coin()) {
      v1::GetStateRequest g;
      g.set_metadata_only(r_.Coin());
      if (r_.Coin()) g.add_tensor_names(r_.Name() + std::to_string(r_.U(3)));
      (void)client_->GetState(g);
    }
  }

  void UpdateBuffers() {
    v1::UpdateBuffersRequest u;
    u.set_group_id(r_.Coin() ? "g" : r_.Name());
    auto* t = u.add_tensors();
    t->set_name(r_.Name() + std::to_string(r_.U(3)));
    FillHandle(t->mutable_param());
    FillHandle(t->mutable_grad());
    (void)client_->UpdateBuffers(u);
  }

  Random& r_;
  Client* const client_;
  const SharedMemoryRegion* const seg_;
  const std::vector<std::string> segments_;  // names for shared memory
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
  RandomRequests requests(&r, client.get(), seg.get());
  int answered = 0;
  for (int i = 0; i < 3000; ++i) {
    requests.SendOne();
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
