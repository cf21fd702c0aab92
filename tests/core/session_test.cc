#include "core/session.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "backends/cpu/cpu_backend.h"
#include "checkpoint/key_names.h"
#include "checkpoint/session_checkpoint.h"
#include "client/shm_tensor.h"
#include "core/metadata_bytes.h"
#include "core/session_registry.h"
#include "gtest/gtest.h"

namespace optimd {
namespace {

BufferHandle Handle(const SharedMemoryRegion& r, uint64_t off, uint64_t size) {
  BufferHandle h;
  h.kind = BufferHandle::Kind::kSharedMemory;
  h.segment_name = r.name();
  h.offset = off;
  h.size = size;
  return h;
}

std::unique_ptr<SessionContext> Context(Backend* backend) {
  std::string done;
  return *backend->OpenSession(-1, "", &done);
}

class SessionTest : public ::testing::Test {
 protected:
  SessionTest()
      : backend_(CpuBackend::Options{2, 64}),
        budget_(1 << 20),
        session_(SessionIdentity{"job", 0, 1, -1}, &backend_, &budget_,
                 Context(&backend_)) {
    params_ = *SharedMemoryRegion::Create(4096);
    grads_ = *SharedMemoryRegion::Create(4096);
  }

  // Registers group "g" of one bf16 tensor "w" of 8 elements (parameters
  // 1, gradients 0.5, no weight decay; an fp32 master in the daemon) and
  // steps it once.
  void RegisterBf16AndStep() {
    TensorSpec t;
    t.name = "w";
    t.numel = 8;
    t.param_dtype = t.grad_dtype = DType::kBFloat16;
    t.param_dtype_set = t.grad_dtype_set = true;
    t.param = Handle(*params_, 0, 16);
    t.grad = Handle(*grads_, 0, 16);
    GroupSpec spec;
    spec.id = "g";
    spec.hyper.weight_decay = 0;
    spec.tensors = {t};
    for (int i = 0; i < 8; ++i) {
      params_->as<uint16_t>()[i] = FloatToBFloat16(1.0f);
      grads_->as<uint16_t>()[i] = FloatToBFloat16(0.5f);
    }
    ASSERT_TRUE(session_.RegisterGroup(spec).ok());
    ASSERT_TRUE(session_.Step({}).ok());
  }

  TensorSpec Fp32Tensor(const std::string& name, uint64_t numel,
                        uint64_t offset) {
    TensorSpec t;
    t.name = name;
    t.numel = numel;
    t.param_dtype_set = t.grad_dtype_set = true;
    t.param = Handle(*params_, offset, numel * 4);
    t.grad = Handle(*grads_, offset, numel * 4);
    return t;
  }

  // Registers group "g" of fp32 tensors "a" and "b", 8 elements each.
  void RegisterGroupAB() {
    GroupSpec spec;
    spec.id = "g";
    spec.tensors = {Fp32Tensor("a", 8, 0), Fp32Tensor("b", 8, 64)};
    ASSERT_TRUE(session_.RegisterGroup(spec).ok());
  }

  CpuBackend backend_;
  StateBudget budget_;
  Session session_;
  std::unique_ptr<SharedMemoryRegion> params_, grads_;
};

TEST_F(SessionTest, RegisterStepAndCountPlans) {
  GroupSpec spec;
  spec.id = "g";
  spec.tensors = {Fp32Tensor("a", 100, 0), Fp32Tensor("empty", 0, 0),
                  Fp32Tensor("b", 3, 512)};
  spec.tensors[1].param = spec.tensors[1].grad = BufferHandle();
  auto r = session_.RegisterGroup(spec);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->state_bytes, 103u * 8);
  EXPECT_EQ(r->plan_items, 3u);  // 100 elements in items of 64, plus b
  EXPECT_EQ(backend_.counters().plan_builds.load(), 1u);
  for (int i = 0; i < 100; ++i) grads_->as<float>()[i] = 1.0f;
  for (int step = 1; step <= 3; ++step) {
    auto s = session_.Step({});
    ASSERT_TRUE(s.ok()) << s.status();
    EXPECT_FALSE(s->outcome.skipped);
    EXPECT_EQ(s->group_steps[0].second, static_cast<uint64_t>(step));
  }
  EXPECT_EQ(backend_.counters().plan_builds.load(), 1u);  // never rebuilt
  EXPECT_LT(params_->as<float>()[0], 0.0f);
  EXPECT_EQ(session_.Info().steps, 3u);
}

TEST_F(SessionTest, NonFiniteGradientSkipsEverything) {
  GroupSpec g1;
  g1.id = "g1";
  g1.tensors = {Fp32Tensor("a", 4, 0)};
  GroupSpec g2;
  g2.id = "g2";
  g2.tensors = {Fp32Tensor("b", 4, 64)};
  ASSERT_TRUE(session_.RegisterGroup(g1).ok());
  ASSERT_TRUE(session_.RegisterGroup(g2).ok());
  for (int i = 0; i < 4; ++i) {
    params_->as<float>()[i] = params_->as<float>()[16 + i] = 1.0f;
    grads_->as<float>()[i] = grads_->as<float>()[16 + i] = 0.5f;
  }
  grads_->as<float>()[17] = std::numeric_limits<float>::infinity();
  std::vector<uint8_t> before(params_->data(), params_->data() + 4096);
  auto s = session_.Step({});
  ASSERT_TRUE(s.ok());
  EXPECT_TRUE(s->outcome.skipped);
  EXPECT_EQ(s->group_steps[0].second, 0u);
  EXPECT_EQ(s->group_steps[1].second, 0u);
  EXPECT_EQ(std::memcmp(before.data(), params_->data(), 4096), 0);
  EXPECT_EQ(session_.Info().skipped_steps, 1u);
  grads_->as<float>()[17] = 0.5f;
  s = session_.Step({});
  ASSERT_TRUE(s.ok());
  EXPECT_FALSE(s->outcome.skipped);
  EXPECT_EQ(s->group_steps[1].second, 1u);
}

TEST_F(SessionTest, FailedRegistrationChangesNothing) {
  GroupSpec spec;
  spec.id = "g";
  spec.tensors = {Fp32Tensor("a", 4, 0), Fp32Tensor("b", 4, 4090)};
  auto r = session_.RegisterGroup(spec);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("'b'"), absl::string_view::npos);
  EXPECT_TRUE(session_.Info().group_ids.empty());
  EXPECT_EQ(budget_.used(), 0u);
  EXPECT_EQ(backend_.segments().OpenSegments(), 0);
  // The same names are free to use afterwards.
  spec.tensors[1] = Fp32Tensor("b", 4, 16);
  EXPECT_TRUE(session_.RegisterGroup(spec).ok());
}

// A CUDA handle given to the CPU backend is refused for its kind, before
// its size is looked at, at registration and in an update.
TEST_F(SessionTest, AHandleOfAnotherBackendIsRefusedByItsKind) {
  GroupSpec spec;
  spec.id = "g";
  spec.tensors = {Fp32Tensor("a", 4, 0)};
  spec.tensors[0].grad = BufferHandle{};
  spec.tensors[0].grad.kind = BufferHandle::Kind::kCudaIpc;
  auto r = session_.RegisterGroup(spec);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("needs a shared_memory grad buffer"),
            absl::string_view::npos)
      << r.status();
  EXPECT_TRUE(session_.Info().group_ids.empty());

  spec.tensors = {Fp32Tensor("a", 4, 0)};
  ASSERT_TRUE(session_.RegisterGroup(spec).ok());
  BufferUpdate update;
  update.tensor = "a";
  update.param.kind = BufferHandle::Kind::kCudaVmm;
  const absl::Status s = session_.UpdateBuffers("g", {update});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("needs a shared_memory param buffer"),
            absl::string_view::npos)
      << s;
}

// The registry's tensor-name rule (the daemon's: checkpoint keys that
// would collide) is every new session's, applied against the session's
// registered names too, and a refused group changes nothing.
TEST_F(SessionTest, RegistrysTensorNameRuleAppliesToItsSessions) {
  SessionRegistry registry(&backend_, &budget_);
  registry.set_tensor_name_rule(CheckCheckpointKeys);
  auto created = registry.Create({"names", 0, 1, -1}, false);
  ASSERT_TRUE(created.ok()) << created.status();
  Session& session = *created->session;
  GroupSpec spec;
  spec.id = "g";
  spec.tensors = {Fp32Tensor("w", 4, 0), Fp32Tensor("w.exp_avg", 4, 64)};
  auto r = session.RegisterGroup(spec);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("collide"), std::string::npos)
      << r.status();
  EXPECT_TRUE(session.Info().group_ids.empty());
  EXPECT_EQ(budget_.used(), 0u);
  spec.tensors = {Fp32Tensor("w", 4, 0)};
  ASSERT_TRUE(session.RegisterGroup(spec).ok());
  spec.id = "h";
  spec.tensors = {Fp32Tensor("w.master", 4, 64)};
  EXPECT_EQ(session.RegisterGroup(spec).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(session.Info().group_ids, std::vector<std::string>{"g"});
  // A session made without the registry has no such rule.
  EXPECT_TRUE(session_.RegisterGroup(spec).ok());
}

// RunAfterNextStep's function runs once, after the first step that
// succeeds, never after a refused one.
TEST_F(SessionTest, AfterNextStepRunsOnceAfterASuccessfulStep) {
  GroupSpec spec;
  spec.id = "g";
  spec.tensors = {Fp32Tensor("a", 4, 0)};
  ASSERT_TRUE(session_.RegisterGroup(spec).ok());
  int runs = 0;
  session_.RunAfterNextStep([&runs] { ++runs; });
  StepRequestSpec refused;
  refused.refused = absl::InvalidArgumentError("refused by the test");
  EXPECT_EQ(session_.Step(refused).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(runs, 0);
  ASSERT_TRUE(session_.Step({}).ok());
  EXPECT_EQ(runs, 1);
  ASSERT_TRUE(session_.Step({}).ok());
  EXPECT_EQ(runs, 1);
}

TEST_F(SessionTest, BudgetIsEnforcedAndReleased) {
  StateBudget small(100);
  Session s(SessionIdentity{"j", 0, 1, -1}, &backend_, &small,
            Context(&backend_));
  GroupSpec spec;
  spec.id = "big";
  spec.tensors = {Fp32Tensor("a", 20, 0)};  // 160 bytes of state
  EXPECT_EQ(s.RegisterGroup(spec).status().code(),
            absl::StatusCode::kResourceExhausted);
  spec.tensors = {Fp32Tensor("a", 10, 0)};  // 80 bytes
  ASSERT_TRUE(s.RegisterGroup(spec).ok());
  EXPECT_EQ(small.used(), 80u);
  ASSERT_TRUE(s.UnregisterGroup("big").ok());
  EXPECT_EQ(small.used(), 0u);
  EXPECT_EQ(s.UnregisterGroup("big").code(), absl::StatusCode::kNotFound);
}

// Names and aliases hold the daemon's memory too: a group whose aliases
// pass --max_metadata_bytes is refused, changing nothing, within the state
// budget; the metadata is given back with the group and with the session.
TEST_F(SessionTest, MetadataBudgetIsEnforcedAndReleased) {
  GroupSpec spec;
  spec.id = "named";
  spec.tensors = {Fp32Tensor("a", 10, 0)};
  const uint64_t plain = GroupMetadataBytes(spec);
  for (int i = 0; i < 64; ++i) {
    spec.tensors[0].aliases.push_back(std::to_string(i) +
                                      std::string(1000, 'x'));
  }
  const uint64_t aliased = GroupMetadataBytes(spec);
  EXPECT_GT(aliased, plain + 2 * 64 * 1000);
  StateBudget small(0, aliased - 1);
  {
    Session s(SessionIdentity{"j", 0, 1, -1}, &backend_, &small,
              Context(&backend_));
    auto r = s.RegisterGroup(spec);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted);
    EXPECT_NE(r.status().message().find("--max_metadata_bytes"),
              absl::string_view::npos)
        << r.status();
    EXPECT_TRUE(s.Info().group_ids.empty());
    EXPECT_EQ(small.used(), 0u);
    EXPECT_EQ(small.metadata_used(), 0u);
    spec.tensors[0].aliases.resize(1);
    ASSERT_TRUE(s.RegisterGroup(spec).ok());
    const uint64_t one_alias = GroupMetadataBytes(spec);
    EXPECT_EQ(small.metadata_used(), one_alias);
    EXPECT_EQ(small.used(), 80u);
    ASSERT_TRUE(s.UnregisterGroup("named").ok());
    EXPECT_EQ(small.metadata_used(), 0u);
    ASSERT_TRUE(s.RegisterGroup(spec).ok());
  }
  EXPECT_EQ(small.metadata_used(), 0u);  // the session's destructor
  EXPECT_EQ(small.used(), 0u);
}

// LockedSession::ReserveSnapshot: one host copy of the parameters and
// state per snapshot, at most kMaxLiveSnapshots at once, each given back
// when its reservation goes.
TEST_F(SessionTest, SnapshotReservationsAreBoundedAndGivenBack) {
  GroupSpec spec;
  spec.id = "g";
  spec.tensors = {Fp32Tensor("a", 10, 0)};  // 40 bytes of parameters
  ASSERT_TRUE(session_.RegisterGroup(spec).ok());
  const uint64_t state = budget_.used();  // 80 bytes: the two moments
  ASSERT_EQ(state, 80u);
  std::vector<SnapshotReservation> held;
  session_.WithLockedState([&](LockedSession& locked) {
    for (int i = 0; i < kMaxLiveSnapshots; ++i) {
      auto r = locked.ReserveSnapshot();
      ASSERT_TRUE(r.ok()) << r.status();
      EXPECT_EQ(r->bytes(), 120u);
      held.push_back(*std::move(r));
    }
    EXPECT_EQ(locked.ReserveSnapshot().status().code(),
              absl::StatusCode::kResourceExhausted);
  });
  EXPECT_EQ(budget_.used(), state + 2 * 120);
  held.pop_back();
  EXPECT_EQ(budget_.used(), state + 120);
  session_.WithLockedState([&](LockedSession& locked) {
    EXPECT_TRUE(locked.ReserveSnapshot().ok());  // given back at once
  });
  held.clear();
  EXPECT_EQ(budget_.used(), state);
}

// A snapshot's header holds every tensor's names and shapes: each snapshot
// reserves the session's metadata bytes again, refused past
// --max_metadata_bytes with nothing held, and given back with it.
TEST_F(SessionTest, SnapshotsReserveTheirHeadersMetadata) {
  GroupSpec spec;
  spec.id = "g";
  spec.tensors = {Fp32Tensor("a", 10, 0)};
  const uint64_t metadata = GroupMetadataBytes(spec);
  StateBudget budget(0, 2 * metadata + metadata / 2);
  Session s(SessionIdentity{"j", 0, 1, -1}, &backend_, &budget,
            Context(&backend_));
  ASSERT_TRUE(s.RegisterGroup(spec).ok());
  ASSERT_EQ(budget.metadata_used(), metadata);
  std::vector<SnapshotReservation> held;
  s.WithLockedState([&](LockedSession& locked) {
    auto r = locked.ReserveSnapshot();
    ASSERT_TRUE(r.ok()) << r.status();
    held.push_back(*std::move(r));
    EXPECT_EQ(budget.metadata_used(), 2 * metadata);
    const uint64_t state = budget.used();
    auto refused = locked.ReserveSnapshot();
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
    EXPECT_NE(refused.status().message().find("--max_metadata_bytes"),
              absl::string_view::npos)
        << refused.status();
    EXPECT_EQ(budget.metadata_used(), 2 * metadata);
    EXPECT_EQ(budget.used(), state);
  });
  held.clear();
  EXPECT_EQ(budget.metadata_used(), metadata);
}

// What a session keeps for a layer above goes first when the session goes:
// its state is still reserved while an attachment ends (a background
// save's writing thread may still read it).
TEST_F(SessionTest, AttachmentsGoBeforeTheSessionsState) {
  struct Probe : SessionAttachment {
    ~Probe() override { *used_at_end = budget->used(); }
    StateBudget* budget = nullptr;
    uint64_t* used_at_end = nullptr;
  };
  uint64_t used_at_end = 0;
  {
    Session s(SessionIdentity{"j", 1, 2, -1}, &backend_, &budget_,
              Context(&backend_));
    GroupSpec spec;
    spec.id = "g";
    spec.tensors = {Fp32Tensor("a", 10, 0)};
    ASSERT_TRUE(s.RegisterGroup(spec).ok());
    Probe& probe = s.Attachment<Probe>();
    EXPECT_EQ(&s.Attachment<Probe>(), &probe);  // one per type
    probe.budget = &budget_;
    probe.used_at_end = &used_at_end;
  }
  EXPECT_EQ(used_at_end, 80u);
  EXPECT_EQ(budget_.used(), 0u);
}

TEST_F(SessionTest, OnRetireCallsOnceAtRetireOrAtOnce) {
  int first = 0, forgotten = 0, late = 0;
  session_.OnRetire([&] { ++first; });
  const uint64_t id = session_.OnRetire([&] { ++forgotten; });
  session_.ForgetOnRetire(id);
  EXPECT_FALSE(session_.retired());
  session_.Retire();
  session_.Retire();  // once
  EXPECT_TRUE(session_.retired());
  EXPECT_EQ(first, 1);
  EXPECT_EQ(forgotten, 0);
  session_.OnRetire([&] { ++late; });  // retired already: at once
  EXPECT_EQ(late, 1);
}

// Two parameters over one memory (tied through .data), each with its own
// gradient, in one group: stepped one after the other as torch steps them,
// which is what two groups (stepped in order) give. More threads than
// tasks of either, so that without the order they may meet mid-step (the
// plan's order itself: core/group_test.cc).
TEST(SessionOrderTest, ParametersOverOneMemoryAreSteppedOneAfterTheOther) {
  CpuBackend backend(CpuBackend::Options{8, 4096});
  StateBudget budget(1 << 20);
  constexpr uint64_t kNumel = 4 * 4096;
  std::vector<uint8_t> results[2];
  for (int grouping = 0; grouping < 2; ++grouping) {
    Session session(SessionIdentity{"job", 0, 1, -1}, &backend, &budget,
                    Context(&backend));
    auto params = *SharedMemoryRegion::Create(kNumel * 4);
    auto grads = *SharedMemoryRegion::Create(2 * kNumel * 4);
    for (uint64_t i = 0; i < kNumel; ++i) {
      params->as<float>()[i] = 0.001f * static_cast<float>(i);
      grads->as<float>()[i] = 1.0f;
      grads->as<float>()[kNumel + i] = -0.25f * static_cast<float>(i % 7);
    }
    TensorSpec tensors[2];
    for (int k = 0; k < 2; ++k) {
      tensors[k].name = k == 0 ? "w" : "v";
      tensors[k].numel = kNumel;
      tensors[k].param_dtype_set = tensors[k].grad_dtype_set = true;
      tensors[k].param = Handle(*params, 0, kNumel * 4);
      tensors[k].grad = Handle(*grads, k * kNumel * 4, kNumel * 4);
    }
    GroupSpec first, second;
    first.id = "first";
    second.id = "second";
    first.tensors = {tensors[0]};
    (grouping == 0 ? first : second).tensors.push_back(tensors[1]);
    ASSERT_TRUE(session.RegisterGroup(first).ok());
    if (grouping == 1) {
      ASSERT_TRUE(session.RegisterGroup(second).ok());
    }
    for (int step = 0; step < 10; ++step) ASSERT_TRUE(session.Step({}).ok());
    results[grouping].assign(params->data(), params->data() + kNumel * 4);
  }
  EXPECT_EQ(results[0], results[1]);
}

TEST_F(SessionTest, UpdateBuffersTouchesOnlyThatEntry) {
  ASSERT_NO_FATAL_FAILURE(RegisterGroupAB());
  auto other = *SharedMemoryRegion::Create(64);
  BufferUpdate u;
  u.tensor = "b";
  u.grad = Handle(*other, 0, 32);
  ASSERT_TRUE(session_.UpdateBuffers("g", {u}).ok());
  EXPECT_EQ(backend_.counters().plan_entry_updates.load(), 1u);
  EXPECT_EQ(backend_.counters().plan_builds.load(), 1u);
  u.grad = Handle(*other, 0, 16);  // wrong size
  EXPECT_EQ(session_.UpdateBuffers("g", {u}).code(),
            absl::StatusCode::kInvalidArgument);
  u.tensor = "zzz";
  EXPECT_EQ(session_.UpdateBuffers("g", {u}).code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(session_.UpdateBuffers("nope", {}).code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(backend_.counters().plan_entry_updates.load(), 1u);
}

// Mappings of this process whose file is shared-memory segment `name`.
int MappingsOf(const std::string& name) {
  std::ifstream maps("/proc/self/maps");
  const std::string file = "/dev/shm/" + name.substr(name.rfind('/') + 1);
  int n = 0;
  for (std::string line; std::getline(maps, line);) {
    n += absl::EndsWith(line, file) ? 1 : 0;
  }
  return n;
}

// A gradient the trainer freed (marked absent) keeps its mapping among the
// recent ones until memory is said to be released: at the next step, or
// at once by UpdateBuffers' memory_released (an out-of-memory error's
// release).
TEST_F(SessionTest, UpdateBuffersThatReleaseMemoryCloseUnusedMappings) {
  ASSERT_NO_FATAL_FAILURE(RegisterGroupAB());
  auto other = *SharedMemoryRegion::Create(64);
  BufferUpdate moved;
  moved.tensor = "b";
  moved.grad = Handle(*other, 0, 32);
  ASSERT_TRUE(session_.UpdateBuffers("g", {moved}).ok());
  ASSERT_EQ(MappingsOf(other->name()), 2) << "the test's and the session's";
  BufferUpdate absent;
  absent.tensor = "b";
  absent.grad_absent = true;
  ASSERT_TRUE(session_.UpdateBuffers("g", {absent}).ok());
  EXPECT_EQ(MappingsOf(other->name()), 2) << "closed before a release";
  ASSERT_TRUE(session_.UpdateBuffers("g", {}, /*memory_released=*/true).ok());
  EXPECT_EQ(MappingsOf(other->name()), 1) << "still mapped after a release";
  auto s = session_.Step(StepRequestSpec());
  ASSERT_TRUE(s.ok()) << s.status();  // "a" alone
}

// A step's buffer updates are all checked before any applies: a bad one of
// a later group, or a group named twice, leaves an earlier group's buffers
// where they were.
TEST_F(SessionTest, StepBufferUpdatesOfSeveralGroupsAllOrNone) {
  GroupSpec g1, g2;
  g1.id = "g1";
  g1.tensors = {Fp32Tensor("a", 8, 0)};
  g2.id = "g2";
  g2.tensors = {Fp32Tensor("b", 8, 64)};
  ASSERT_TRUE(session_.RegisterGroup(g1).ok());
  ASSERT_TRUE(session_.RegisterGroup(g2).ok());
  for (int i = 0; i < 16; ++i) grads_->as<float>()[i] = 0.5f;
  auto other = *SharedMemoryRegion::Create(64);
  for (int i = 0; i < 8; ++i) other->as<float>()[i] = NAN;
  BufferUpdate moved;
  moved.tensor = "a";
  moved.grad = Handle(*other, 0, 32);
  BufferUpdate unknown;
  unknown.tensor = "nope";
  unknown.grad_absent = true;
  StepRequestSpec bad;
  bad.buffer_updates = {{"g1", {moved}}, {"g2", {unknown}}};
  EXPECT_EQ(session_.Step(bad).status().code(), absl::StatusCode::kNotFound);
  // Two updates of one group: which would win is left to their order.
  BufferUpdate stays;
  stays.tensor = "a";
  stays.grad = Handle(*grads_, 0, 32);
  StepRequestSpec twice;
  twice.buffer_updates = {{"g1", {moved}}, {"g1", {stays}}};
  const absl::Status refused = session_.Step(twice).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.message().find("names group 'g1' twice"), std::string::npos)
      << refused;
  // g1's gradient is still the finite one: the step is not skipped.
  auto s = session_.Step({});
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_FALSE(s->outcome.skipped) << "the refused step moved g1's gradient";
}

// A bf16 parameter keeps an fp32 master in the daemon. Values the trainer
// writes into the parameter (a weight load, a clip) reach the master with
// an update that says so (param_written), and the next step starts from
// them, as torch's steps from the written tensor; without it the step
// writes the old master over them.
TEST_F(SessionTest, WrittenParameterSetsItsMaster) {
  ASSERT_NO_FATAL_FAILURE(RegisterBf16AndStep());
  uint16_t* p = params_->as<uint16_t>();
  auto masters = [&] {
    std::vector<float> out;
    auto state = session_.ReadState({"g"}, true, {}, uint64_t{1} << 20);
    EXPECT_TRUE(state.ok()) << state.status();
    for (const StateBlob& b : (*state)[0].tensors) {
      if (b.kind != "master") continue;
      EXPECT_EQ(b.dtype, DType::kFloat32);
      const float* m = reinterpret_cast<const float*>(b.data.data());
      out.assign(m, m + b.numel);
    }
    return out;
  };
  const std::vector<float> stepped = masters();
  ASSERT_EQ(stepped.size(), 8u);
  EXPECT_NE(stepped[0], BFloat16ToFloat(p[0])) << "the master is the param";
  BufferUpdate written;
  written.tensor = "w";
  written.param_written = true;
  // Nothing written: the masters keep their bits (more than the bf16
  // parameter holds).
  ASSERT_TRUE(session_.UpdateBuffers("g", {written}).ok());
  EXPECT_EQ(masters(), stepped);
  // Elements 0..5 written; 6 and 7 keep their masters.
  for (int i = 0; i < 6; ++i) p[i] = FloatToBFloat16(5.0f);
  ASSERT_TRUE(session_.UpdateBuffers("g", {written}).ok());
  const std::vector<float> now = masters();
  ASSERT_EQ(now.size(), 8u);
  for (int i = 0; i < 6; ++i) EXPECT_EQ(now[i], 5.0f) << i;
  EXPECT_EQ(now[6], stepped[6]);
  EXPECT_EQ(now[7], stepped[7]);
  ASSERT_TRUE(session_.Step({}).ok());
  for (int i = 0; i < 6; ++i) {
    EXPECT_NEAR(BFloat16ToFloat(p[i]), 5.0f, 0.1f) << "stepped from the "
                                                      "old master";
  }
}

// param_written may ride with a step's buffer updates: the step adopts
// the written values before its update, and so does a step that skips or
// fails, since the trainer's writes stand whatever happens to the step.
TEST_F(SessionTest, WrittenParameterRidesWithTheStep) {
  ASSERT_NO_FATAL_FAILURE(RegisterBf16AndStep());
  uint16_t* p = params_->as<uint16_t>();
  uint16_t* g = grads_->as<uint16_t>();
  auto master = [&](int i) {
    auto state = session_.ReadState({"g"}, true, {}, uint64_t{1} << 20);
    EXPECT_TRUE(state.ok()) << state.status();
    for (const StateBlob& b : (*state)[0].tensors) {
      if (b.kind == "master") {
        return reinterpret_cast<const float*>(b.data.data())[i];
      }
    }
    ADD_FAILURE() << "no master";
    return 0.0f;
  };
  const float kept = master(7);
  BufferUpdate written;
  written.tensor = "w";
  written.param_written = true;
  StepRequestSpec step;
  step.buffer_updates = {{"g", {written}}};
  // Stepped from the written values; element 7 from its master.
  for (int i = 0; i < 7; ++i) p[i] = FloatToBFloat16(5.0f);
  const uint64_t entry_updates = backend_.counters().plan_entry_updates.load();
  ASSERT_TRUE(session_.Step(step).ok());
  for (int i = 0; i < 7; ++i) {
    EXPECT_NEAR(BFloat16ToFloat(p[i]), 5.0f, 0.1f) << i;
  }
  // A write moves no buffer: the plan's entries stay (on CUDA, no upload).
  EXPECT_EQ(backend_.counters().plan_entry_updates.load(), entry_updates);
  EXPECT_LT(master(7), kept) << "element 7 was not stepped from its master";
  // A step that fails after its updates were applied still adopts.
  p[0] = FloatToBFloat16(7.0f);
  StepRequestSpec failing = step;
  failing.options.grad_scale = -1;
  EXPECT_EQ(session_.Step(failing).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(master(0), 7.0f);
  // And so does a step skipped for a non-finite gradient.
  p[1] = FloatToBFloat16(9.0f);
  g[2] = FloatToBFloat16(std::numeric_limits<float>::quiet_NaN());
  auto skipped = session_.Step(step);
  ASSERT_TRUE(skipped.ok()) << skipped.status();
  EXPECT_TRUE(skipped->outcome.skipped);
  EXPECT_EQ(master(1), 9.0f);
}

// A tensor whose gradient is absent (torch's .grad is None) is not stepped:
// its parameter, moments and the norm ignore it, while its neighbour steps
// as if it were alone; given a gradient again, it steps again.
TEST_F(SessionTest, AbsentGradientIsNotStepped) {
  GroupSpec spec;
  spec.id = "g";
  spec.hyper.weight_decay = 0.1;
  spec.tensors = {Fp32Tensor("a", 8, 0), Fp32Tensor("b", 8, 64),
                  Fp32Tensor("c", 8, 128)};
  spec.tensors[2].grad_absent = true;  // no gradient before its first use
  spec.tensors[2].grad = BufferHandle();
  ASSERT_TRUE(session_.RegisterGroup(spec).ok());
  for (int i = 0; i < 48; ++i) {
    params_->as<float>()[i] = 1.0f;
    grads_->as<float>()[i] = 3.0f;
  }
  BufferUpdate absent;
  absent.tensor = "b";
  absent.grad_absent = true;
  ASSERT_TRUE(session_.UpdateBuffers("g", {absent}).ok());
  StepRequestSpec step;
  step.options.max_grad_norm = 1e9;  // statistics on: the norm is reported
  auto s = session_.Step(step);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_DOUBLE_EQ(s->outcome.grad_norm, std::sqrt(8 * 9.0));  // "a" only
  for (int i = 0; i < 8; ++i) {
    EXPECT_LT(params_->as<float>()[i], 1.0f);
    EXPECT_EQ(params_->as<float>()[16 + i], 1.0f) << "b moved";
    EXPECT_EQ(params_->as<float>()[32 + i], 1.0f) << "c moved";
  }
  auto state = session_.ReadState({"g"});
  ASSERT_TRUE(state.ok());
  for (const StateBlob& b : (*state)[0].tensors) {
    if (b.tensor == "a" || b.kind == "master") continue;  // master: the param
    for (char c : b.data) ASSERT_EQ(c, 0) << b.tensor << "." << b.kind;
  }
  // Both get their gradients back; after one more step "b" and "c" hold
  // what one step from the start gives, as "a" did.
  const float a_after_one = params_->as<float>()[0];
  BufferUpdate back_b, back_c;
  back_b.tensor = "b";
  back_b.grad = Handle(*grads_, 64, 32);
  back_c.tensor = "c";
  back_c.grad = Handle(*grads_, 128, 32);
  ASSERT_TRUE(session_.UpdateBuffers("g", {back_b, back_c}).ok());
  ASSERT_TRUE(session_.Step(step).ok());
  EXPECT_LT(params_->as<float>()[16], 1.0f);
  EXPECT_LT(params_->as<float>()[32], 1.0f);
  EXPECT_LT(params_->as<float>()[0], a_after_one);
  BufferUpdate both;
  both.tensor = "b";
  both.grad_absent = true;
  both.grad = Handle(*grads_, 64, 32);
  EXPECT_EQ(session_.UpdateBuffers("g", {both}).code(),
            absl::StatusCode::kInvalidArgument);
}

// Step flags order CUDA streams; a CPU session refuses them, and a step
// numbered without them is refused too, changing nothing.
TEST_F(SessionTest, StepFlagsAreForCudaSessions) {
  GroupSpec spec;
  spec.id = "g";
  spec.tensors = {Fp32Tensor("a", 8, 0)};
  ASSERT_TRUE(session_.RegisterGroup(spec).ok());
  StepRequestSpec step;
  step.sequence = 1;
  auto r = session_.Step(step);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(r.status().message().find("step_flags"), absl::string_view::npos);
  step.step_flags = Handle(*grads_, 0, 8);
  r = session_.Step(step);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("CPU"), absl::string_view::npos);
  EXPECT_EQ(session_.Info().steps, 0u);
}

TEST_F(SessionTest, ShapeMustHoldNumel) {
  GroupSpec spec;
  spec.id = "g";
  spec.tensors = {Fp32Tensor("a", 12, 0)};
  for (const std::vector<uint64_t>& bad :
       {std::vector<uint64_t>{5, 2},
        std::vector<uint64_t>{1ull << 33, 1ull << 33, 0},
        std::vector<uint64_t>(65, 1)}) {
    spec.tensors[0].shape = bad;
    auto r = session_.RegisterGroup(spec);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find("shape"), absl::string_view::npos);
  }
  EXPECT_TRUE(session_.Info().group_ids.empty());
  spec.tensors[0].shape = {3, 1, 4};
  EXPECT_TRUE(session_.RegisterGroup(spec).ok());
}

// A shard's place in its whole tensor (global_shape and global_offset) has
// one entry per dimension of its shape and lies inside the whole; every
// other placement is INVALID_ARGUMENT naming the tensor and registers
// nothing.
TEST_F(SessionTest, ShardPlaceMustHoldTheShard) {
  GroupSpec spec;
  spec.id = "g";
  spec.tensors = {Fp32Tensor("a", 12, 0)};
  spec.tensors[0].shape = {3, 4};
  using Dims = std::vector<uint64_t>;
  const std::vector<std::pair<Dims, Dims>> bad = {
      {{6, 4}, {}},                       // an offset missing
      {{}, {0, 0}},                       // a whole shape missing
      {{12}, {0}},                        // fewer dimensions than the shard
      {{6, 4}, {4, 0}},                   // past the end of a dimension
      {{6, 3}, {0, 0}},                   // a dimension smaller than the shard
      {{6, 4}, {~uint64_t{0}, 0}},        // an offset that wraps
      {{1ull << 40, 1ull << 40}, {0, 0}}  // a whole past 64 bits
  };
  for (const auto& [whole, offset] : bad) {
    spec.tensors[0].global_shape = whole;
    spec.tensors[0].global_offset = offset;
    auto r = session_.RegisterGroup(spec);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find("tensor 'a': global_shape"),
              absl::string_view::npos)
        << r.status();
  }
  EXPECT_TRUE(session_.Info().group_ids.empty());
  spec.tensors[0].global_shape = {6, 4};
  spec.tensors[0].global_offset = {3, 0};
  EXPECT_TRUE(session_.RegisterGroup(spec).ok());
}

// A tied weight's other names (aliases) are names like any other: each
// refused with INVALID_ARGUMENT and a message naming the problem when
// empty, too long, too many, or already taken in the session; accepted
// ones are freed with their group.
TEST_F(SessionTest, AliasesAreCheckedLikeNames) {
  GroupSpec first;
  first.id = "first";
  first.tensors = {Fp32Tensor("other", 4, 256)};
  first.tensors[0].aliases = {"other.alias"};
  ASSERT_TRUE(session_.RegisterGroup(first).ok());
  GroupSpec spec;
  spec.id = "g";
  spec.tensors = {Fp32Tensor("emb", 4, 0), Fp32Tensor("b", 4, 64)};
  const std::vector<std::pair<std::vector<std::string>, std::string>> bad = {
      {{""}, "is empty"},
      {{std::string(kMaxNameBytes + 1, 'x')}, "longer than"},
      {std::vector<std::string>(kMaxAliasesPerTensor + 1, "y"), "aliases; at"},
      {{"emb"}, "the tensor's own name"},
      // Tensor b, checked after emb's aliases, finds its name taken.
      {{"b"}, "tensor name 'b' is already an alias of another tensor"},
      {{"other"}, "another tensor's name"},
      {{"head", "head"}, "already an alias"},
      {{"other.alias"}, "already an alias"},
  };
  for (const auto& [aliases, message] : bad) {
    SCOPED_TRACE(message);
    spec.tensors[0].aliases = aliases;
    auto r = session_.RegisterGroup(spec);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find(message), absl::string_view::npos)
        << r.status();
  }
  EXPECT_EQ(session_.Info().group_ids.size(), 1u);
  spec.tensors[0].aliases = {"head.weight", "decoder.weight"};
  ASSERT_TRUE(session_.RegisterGroup(spec).ok());
  // Calls name the tensor by its registered name; an alias is named back.
  BufferUpdate by_alias;
  by_alias.tensor = "decoder.weight";
  by_alias.grad_absent = true;
  const absl::Status aliased = session_.UpdateBuffers("g", {by_alias});
  EXPECT_EQ(aliased.code(), absl::StatusCode::kNotFound);
  EXPECT_NE(aliased.message().find("is an alias of 'emb'"),
            absl::string_view::npos)
      << aliased;
  // Taken now; free again once the group is gone.
  GroupSpec again;
  again.id = "again";
  again.tensors = {Fp32Tensor("head.weight", 4, 128)};
  EXPECT_EQ(session_.RegisterGroup(again).status().code(),
            absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(session_.UnregisterGroup("g").ok());
  EXPECT_TRUE(session_.RegisterGroup(again).ok());
}

TEST_F(SessionTest, StageAboveTheLimitIsRefusedAndStagedStepsNeedFlags) {
  GroupSpec spec;
  spec.id = "g";
  spec.tensors = {Fp32Tensor("a", 12, 0)};
  spec.tensors[0].stage = kMaxStage + 1;
  auto r = session_.RegisterGroup(spec);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("stage"), absl::string_view::npos);
  EXPECT_TRUE(session_.Info().group_ids.empty());
  spec.tensors[0].stage = kMaxStage;
  ASSERT_TRUE(session_.RegisterGroup(spec).ok());
  // A staged step writes progress into step flags, which CPU sessions have
  // not: refused, nothing stepped.
  StepRequestSpec step;
  step.options.staged = true;
  auto s = session_.Step(step);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.status().message().find("12-byte"), absl::string_view::npos);
  EXPECT_EQ(session_.Info().steps, 0u);
}

TEST_F(SessionTest, ShrunkSegmentFailsTheStepNotTheDaemon) {
  auto seg = *SharedMemoryRegion::Create(8192);
  GroupSpec spec;
  spec.id = "g";
  TensorSpec t = Fp32Tensor("a", 1024, 0);
  t.grad = Handle(*seg, 4096, 4096);
  spec.tensors = {t};
  ASSERT_TRUE(session_.RegisterGroup(spec).ok());
  ASSERT_EQ(truncate((std::string("/dev/shm") + seg->name()).c_str(), 100), 0);
  EXPECT_EQ(session_.Step({}).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

// A trainer that shrinks a segment while a step runs (after the step's
// checks) must not crash the daemon. The backend is driven directly here, so
// that the shrink lands between the checks and the accesses.
TEST_F(SessionTest, SegmentShrunkDuringAStepIsAnErrorNotACrash) {
  for (bool shrink_params : {false, true}) {
    SCOPED_TRACE(shrink_params ? "params" : "grads");
    CpuBackend backend(CpuBackend::Options{2, 64});
    StateBudget budget(0);
    std::string done;
    Session s(SessionIdentity{"j", 0, 1, -1}, &backend, &budget,
              *backend.OpenSession(-1, "", &done));
    auto fresh = *SharedMemoryRegion::Create(1 << 20);
    GroupSpec spec;
    spec.id = "g";
    TensorSpec t = Fp32Tensor("w", 1000, 0);
    (shrink_params ? t.param : t.grad) = Handle(*fresh, 512 * 1024, 4000);
    spec.tensors = {t};
    ASSERT_TRUE(s.RegisterGroup(spec).ok());
    ASSERT_EQ(truncate(("/dev/shm" + fresh->name()).c_str(), 4096), 0);
    auto ctx = *backend.OpenSession(-1, "", &done);
    auto r = s.WithGroups([&](const auto& groups) {
      std::vector<Group*> gs;
      for (const auto& g : groups) gs.push_back(g.get());
      return backend.Step(ctx.get(), gs, StepOptions());
    });
    // Gradients are read first, before anything changes; a parameter
    // fault comes during the update, which is then partly applied.
    EXPECT_EQ(r.status().code(), shrink_params
                                     ? absl::StatusCode::kDataLoss
                                     : absl::StatusCode::kFailedPrecondition)
        << r.status();
  }
}

TEST_F(SessionTest, ReadStateLimitsAndFilters) {
  GroupSpec spec;
  spec.id = "g";
  spec.tensors = {Fp32Tensor("a", 100, 0), Fp32Tensor("b", 10, 512)};
  ASSERT_TRUE(session_.RegisterGroup(spec).ok());
  // 100 elements x (4 bytes of master + 8 of moments) exceed 1000 bytes.
  EXPECT_EQ(session_.ReadState({}, true, {}, 1000).status().code(),
            absl::StatusCode::kResourceExhausted);
  auto only_b = session_.ReadState({}, true, {"b"}, 1000);
  ASSERT_TRUE(only_b.ok()) << only_b.status();
  ASSERT_EQ((*only_b)[0].tensors.size(), 3u);  // master, exp_avg, exp_avg_sq
  EXPECT_EQ((*only_b)[0].tensors[0].tensor, "b");
  auto meta = session_.ReadState({}, false);
  ASSERT_TRUE(meta.ok());
  EXPECT_TRUE((*meta)[0].tensors.empty());
  EXPECT_EQ(session_.ReadState({}, true, {"zzz"}).status().code(),
            absl::StatusCode::kNotFound);
}

// Each optimizer keeps its own named state slots: SGD with momentum one
// momentum_buffer, without none, Lion one exp_avg. State reads and writes
// name them; another optimizer's slot names are refused.
TEST_F(SessionTest, OptimizersKeepTheirOwnStateSlots) {
  GroupSpec sgd;
  sgd.id = "sgd";
  sgd.hyper.kind = OptimizerKind::kSgd;
  sgd.hyper.momentum = 0.9;
  sgd.tensors = {Fp32Tensor("a", 10, 0)};
  GroupSpec plain;
  plain.id = "plain";
  plain.hyper.kind = OptimizerKind::kSgd;
  plain.tensors = {Fp32Tensor("b", 10, 64)};
  GroupSpec lion;
  lion.id = "lion";
  lion.hyper.kind = OptimizerKind::kLion;
  lion.tensors = {Fp32Tensor("c", 10, 128)};
  auto rs = session_.RegisterGroup(sgd);
  auto rp = session_.RegisterGroup(plain);
  auto rl = session_.RegisterGroup(lion);
  ASSERT_TRUE(rs.ok() && rp.ok() && rl.ok());
  EXPECT_EQ(rs->state_bytes, 10u * 4);
  EXPECT_EQ(rp->state_bytes, 0u);
  EXPECT_EQ(rl->state_bytes, 10u * 4);
  for (int i = 0; i < 48; ++i) grads_->as<float>()[i] = 1.0f;
  ASSERT_TRUE(session_.Step({}).ok());
  auto state = session_.ReadState({}, true);
  ASSERT_TRUE(state.ok()) << state.status();
  ASSERT_EQ((*state)[0].tensors.size(), 2u);  // master (the param), buffer
  EXPECT_EQ((*state)[0].tensors[1].kind, "momentum_buffer");
  EXPECT_EQ((*state)[0].tensors[1].data.substr(0, 4),
            std::string(reinterpret_cast<const char*>(grads_->data()), 4));
  EXPECT_EQ((*state)[1].tensors.size(), 1u);
  EXPECT_EQ((*state)[2].tensors[1].kind, "exp_avg");
  StateBlob wrong{"a", "exp_avg", DType::kFloat32, 10, std::string(40, '\0')};
  absl::Status s = session_.WriteState("sgd", 1, {wrong}, {});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("sgd keeps momentum_buffer"), std::string::npos)
      << s;
  StateBlob none{"b", "momentum_buffer", DType::kFloat32, 10,
                 std::string(40, '\0')};
  s = session_.WriteState("plain", 1, {none}, {});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("momentum > 0"), std::string::npos) << s;
}

// Momentum may change by override (schedulers cycle it), but not between
// zero and non-zero: that adds or drops the momentum buffer.
TEST_F(SessionTest, MomentumOverrideKeepsTheLayout) {
  GroupSpec sgd;
  sgd.id = "sgd";
  sgd.hyper.kind = OptimizerKind::kSgd;
  sgd.hyper.momentum = 0.9;
  sgd.tensors = {Fp32Tensor("a", 4, 0)};
  ASSERT_TRUE(session_.RegisterGroup(sgd).ok());
  StepRequestSpec step;
  HyperOverride o;
  o.group_id = "sgd";
  o.keep_lr = true;
  o.momentum = 0.8;
  step.overrides = {o};
  ASSERT_TRUE(session_.Step(step).ok());
  step.overrides[0].momentum = 0.0;
  auto refused = session_.Step(step);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("register the group again"),
            std::string::npos)
      << refused.status();
  EXPECT_EQ(session_.Info().steps, 1u);
  step.overrides[0].momentum = -1.0;
  EXPECT_EQ(session_.Step(step).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// Checkpoints hold each optimizer's slots and its hyperparameters; a file
// of one optimizer does not load into a group of another.
TEST_F(SessionTest, CheckpointsKeepTheOptimizer) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  std::string dir = std::string(tmp != nullptr ? tmp : "/tmp") +
                    "/optimd-session-test-XXXXXX";
  ASSERT_NE(mkdtemp(dir.data()), nullptr);
  GroupSpec lion;
  lion.id = "g";
  lion.hyper.kind = OptimizerKind::kLion;
  lion.hyper.beta2 = 0.99;
  lion.tensors = {Fp32Tensor("c", 10, 0)};
  ASSERT_TRUE(session_.RegisterGroup(lion).ok());
  for (int i = 0; i < 10; ++i) grads_->as<float>()[i] = 0.25f * i - 1;
  ASSERT_TRUE(session_.Step({}).ok());
  auto saved = SaveSession(session_, dir, CheckpointOptions());
  ASSERT_TRUE(saved.ok()) << saved.status();
  auto before = session_.ReadState({}, true);
  ASSERT_TRUE(session_.Step({}).ok());
  auto loaded = LoadSession(session_, dir, CheckpointOptions());
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  auto after = session_.ReadState({}, true);
  ASSERT_EQ((*after)[0].tensors.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ((*after)[0].tensors[i].data, (*before)[0].tensors[i].data);
  }
  EXPECT_EQ((*after)[0].hyper.beta2, 0.99);
  // The same names and sizes under SGD with momentum: not this file.
  Session other(SessionIdentity{"job", 0, 1, -1}, &backend_, &budget_,
                Context(&backend_));
  GroupSpec sgd = lion;
  sgd.hyper = OptimizerHyper();
  sgd.hyper.kind = OptimizerKind::kSgd;
  sgd.hyper.momentum = 0.9;
  ASSERT_TRUE(other.RegisterGroup(sgd).ok());
  auto refused = LoadSession(other, dir, CheckpointOptions());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition)
      << refused.status();
}

// A session whose trainer process ends without closing it is orphaned,
// kept for the grace period for a resume, then freed; a resume ends the
// orphanhood; an operator can evict any session.
TEST(SessionRegistryTest, OrphanedSessionsWaitForAResumeThenGo) {
  CpuBackend backend(CpuBackend::Options{1, 64});
  StateBudget budget(0);
  SessionRegistry registry(&backend, &budget);
  auto spawn = [] {
    const pid_t child = fork();
    if (child == 0) {
      pause();
      _exit(0);
    }
    return child;
  };
  auto end = [](pid_t child) {
    kill(child, SIGKILL);
    waitpid(child, nullptr, 0);
  };
  const pid_t first = spawn(), second = spawn();
  ASSERT_GT(first, 0);
  ASSERT_GT(second, 0);
  ASSERT_TRUE(registry.Create({"a", 0, 1, -1}, false, "", first).ok());
  ASSERT_TRUE(registry.Create({"b", 0, 1, -1}, false, "", second).ok());
  ASSERT_TRUE(registry.Create({"unseen", 0, 1, -1}, false, "", 0).ok());
  const absl::Time t0 = absl::Now();
  const absl::Duration grace = absl::Seconds(10);
  EXPECT_TRUE(registry.Reap(t0, grace).orphaned.empty());
  end(first);
  end(second);
  auto reaped = registry.Reap(t0, grace);
  ASSERT_EQ(reaped.orphaned.size(), 2u);
  EXPECT_TRUE(reaped.freed.empty());
  for (const auto& s : registry.List()) {
    EXPECT_EQ(s->Info().orphaned_since > 0, s->identity().job_id != "unseen");
  }
  // "b" is resumed by a new trainer (this process) within the grace.
  std::string b_secret;
  for (const auto& s : registry.List()) {
    if (s->identity().job_id == "b") b_secret = s->resume_secret();
  }
  auto resumed = registry.Create({"b", 0, 1, -1}, true, "", getpid(), b_secret);
  ASSERT_TRUE(resumed.ok());
  EXPECT_EQ(resumed->session->Info().orphaned_since, 0);
  reaped = registry.Reap(t0 + grace, grace);
  ASSERT_EQ(reaped.freed.size(), 1u);
  EXPECT_EQ(reaped.freed[0].job_id, "a");
  EXPECT_EQ(registry.List().size(), 2u);
  EXPECT_TRUE(registry.Evict("unseen", 0).ok());
  EXPECT_EQ(registry.Evict("unseen", 0).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(registry.List().size(), 1u);
}

TEST(SessionRegistryTest, TokensResumeAndClose) {
  CpuBackend backend(CpuBackend::Options{1, 64});
  StateBudget budget(0);
  SessionRegistry registry(&backend, &budget);
  auto a = registry.Create({"job", 1, 2, -1}, false);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->token.size(), 32u);
  EXPECT_EQ(registry.Create({"job", 1, 2, -1}, false).status().code(),
            absl::StatusCode::kAlreadyExists);
  const std::string secret = a->session->resume_secret();
  EXPECT_EQ(secret.size(), 32u);
  EXPECT_EQ(registry.Create({"job", 1, 2, -1}, true).status().code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_TRUE(registry.Find(a->token).ok());  // still a's
  auto b = registry.Create({"job", 1, 2, -1}, true, "", 0, secret);
  ASSERT_TRUE(b.ok());
  EXPECT_TRUE(b->resumed);
  EXPECT_EQ(b->session, a->session);
  EXPECT_EQ(registry.Find(a->token).status().code(),
            absl::StatusCode::kUnauthenticated);
  // What a trainer meets after the daemon restarted: what to do next.
  EXPECT_TRUE(absl::StrContains(registry.Find(a->token).status().message(),
                                "resume=True"));
  EXPECT_TRUE(registry.Find(b->token).ok());
  EXPECT_EQ(registry.Find("").status().code(),
            absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(registry.Create({"job", 2, 2, -1}, false).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(registry.Create({"", 0, 1, -1}, false).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(registry.Create({"job", 0, 2, 0}, false).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(registry.Create({"job", 0, 2, -2}, false).status().code(),
            absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(registry.Close(b->token).ok());
  EXPECT_TRUE(registry.List().empty());
  EXPECT_TRUE(registry.Create({"job", 1, 2, -1}, false).ok());
}

TEST(HostMemoryTest, RefusesMoreThanIsAvailable) {
  const uint64_t available = HostMemoryAvailable();
  ASSERT_GT(available, 0u);  // Linux: /proc/meminfo has MemAvailable
  EXPECT_TRUE(CheckHostMemory(1 << 20, "a little").ok());
  const absl::Status s = CheckHostMemory(2 * available, "a lot");
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(s.message().find("a lot needs"), std::string::npos) << s;
  // Host snapshots (background saves) go through the same check.
  CpuBackend backend(CpuBackend::Options{1, 64});
  EXPECT_EQ(backend.AllocateHostStaging(2 * available).status().code(),
            absl::StatusCode::kResourceExhausted);
}

// Sessions go to the backend of their device: CPU tensors (-1) to the CPU
// backend, whatever else the daemon runs.
TEST(SessionRegistryTest, RoutesDevicesToBackends) {
  CpuBackend cpu(CpuBackend::Options{1, 64});
  StateBudget budget(0);
  SessionRegistry registry(std::vector<Backend*>{&cpu}, &budget);
  EXPECT_EQ(*registry.BackendFor(-1), &cpu);
  auto gpu = registry.BackendFor(0);
  EXPECT_EQ(gpu.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(gpu.status().message().find("--backend=cuda"), std::string::npos);
  EXPECT_EQ(registry.BackendFor(-5).status().code(),
            absl::StatusCode::kInvalidArgument);
  auto created = registry.Create({"job", 0, 1, -1}, false);
  ASSERT_TRUE(created.ok());
  EXPECT_EQ(created->session->backend(), &cpu);
}

// The caps that bound a daemon's memory on client input: the 4,097th
// session and a session's 4,097th group are RESOURCE_EXHAUSTED and change
// nothing; closing one makes room again.
TEST(SessionRegistryTest, SessionAndGroupCapsAreEnforced) {
  CpuBackend backend(CpuBackend::Options{1, 64});
  StateBudget budget(0);
  SessionRegistry registry(&backend, &budget);
  std::string first_token;
  for (size_t i = 0; i < kMaxSessions; ++i) {
    auto c = registry.Create(SessionIdentity{absl::StrCat("job", i), 0, 1, -1},
                             false);
    ASSERT_TRUE(c.ok()) << i << ": " << c.status();
    if (i == 0) first_token = c->token;
  }
  auto over = registry.Create(SessionIdentity{"one-more", 0, 1, -1}, false);
  EXPECT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(registry.List().size(), kMaxSessions);
  ASSERT_TRUE(registry.Close(first_token).ok());
  EXPECT_TRUE(
      registry.Create(SessionIdentity{"one-more", 0, 1, -1}, false).ok());

  Session session(SessionIdentity{"groups", 0, 1, -1}, &backend, &budget,
                  Context(&backend));
  for (size_t g = 0; g < kMaxGroupsPerSession; ++g) {
    GroupSpec spec;
    spec.id = absl::StrCat("g", g);
    ASSERT_TRUE(session.RegisterGroup(spec).ok()) << g;
  }
  GroupSpec extra;
  extra.id = "extra";
  EXPECT_EQ(session.RegisterGroup(extra).status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(session.GroupIds().size(), kMaxGroupsPerSession);
}

}  // namespace
}  // namespace optimd
