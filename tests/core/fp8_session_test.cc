// FP8 parameters in a real session on the CPU backend: registration
// (scale_inv checks), steps, checkpoints in both formats resuming bit for
// bit, and state writes that requantize.
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <random>

#include "backends/cpu/cpu_backend.h"
#include "checkpoint/session_checkpoint.h"
#include "client/shm_tensor.h"
#include "core/fp8.h"
#include "core/session.h"
#include "gtest/gtest.h"

namespace optimd {
namespace {

// A temporary directory removed with everything in it at the end of a test.
class ScratchDir {
 public:
  ScratchDir() {
    char dir[] = "/tmp/optimd-fp8-test-XXXXXX";
    EXPECT_NE(mkdtemp(dir), nullptr);
    path_ = dir;
  }
  ~ScratchDir() { std::filesystem::remove_all(path_); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

constexpr Fp8Recipe kRecipes[] = {Fp8Recipe::kTensor, Fp8Recipe::kBlock1x128,
                                  Fp8Recipe::kBlock128x128, Fp8Recipe::kMxfp8};
constexpr uint64_t kRows = 130, kCols = 160, kNumel = kRows * kCols;

// One group of four e4m3 tensors [130, 160], one per recipe, with bf16
// gradients, over one shared-memory segment each for codes, scale
// inverses and gradients.
class Fp8Session {
 public:
  Fp8Session() : backend_(CpuBackend::Options{2, 4096}), budget_(0) {
    session_ = std::make_unique<Session>(SessionIdentity{"fp8", 0, 1, -1},
                                         &backend_, &budget_,
                                         *backend_.OpenSession(-1, "", &done_));
    codes_ = *SharedMemoryRegion::Create(4 * kNumel);
    scales_ = *SharedMemoryRegion::Create(4 * kScaleStride);
    grads_ = *SharedMemoryRegion::Create(4 * kNumel * 2);
    std::mt19937 rng(1);
    for (uint64_t i = 0; i < 4 * kNumel; ++i) {
      codes_->as<uint8_t>()[i] = static_cast<uint8_t>(rng() % 0x7e);
    }
    for (uint64_t i = 0; i < kScaleStride; ++i) {
      scales_->as<float>()[i] = 0.01f;  // MXFP8's bytes: 0x0a, 0xd7, ...
    }
    for (uint64_t i = 0; i < 4 * kNumel; ++i) {
      grads_->as<uint16_t>()[i] =
          FloatToBFloat16((rng() % 2001 - 1000) * 1e-3f);
    }
  }
  // The spec of the group; `scale_bytes_delta` changes one scale_inv size.
  GroupSpec Spec(int64_t scale_bytes_delta = 0) const {
    GroupSpec spec;
    spec.id = "g";
    spec.hyper.lr = 1e-2;
    spec.moment_dtype = DType::kBFloat16;
    for (int r = 0; r < 4; ++r) {
      TensorSpec t;
      t.name = std::string("w.") + std::string(Fp8RecipeName(kRecipes[r]));
      t.numel = kNumel;
      t.shape = {kRows, kCols};
      t.param_dtype = DType::kFloat8E4M3;
      t.grad_dtype = DType::kBFloat16;
      t.param_dtype_set = t.grad_dtype_set = true;
      t.fp8_recipe = kRecipes[r];
      t.param = Handle(*codes_, r * kNumel, kNumel);
      t.grad = Handle(*grads_, r * kNumel * 2, kNumel * 2);
      const uint64_t bytes =
          Fp8Geometry::Of(kRecipes[r], kNumel, t.shape).ScaleBytes();
      t.scale_inv = Handle(*scales_, r * kScaleStride,
                           r == 1 ? bytes + scale_bytes_delta : bytes);
      spec.tensors.push_back(t);
    }
    return spec;
  }
  Session& session() { return *session_; }
  // The trainer's codes and scale inverses.
  std::string Trainer() const {
    return std::string(codes_->as<char>(), 4 * kNumel) +
           std::string(scales_->as<char>(), 4 * kScaleStride);
  }
  // The daemon's state (masters and moments) as bytes.
  std::string State() {
    auto st = session_->ReadState({});
    EXPECT_TRUE(st.ok()) << st.status();
    std::string out;
    for (const GroupState& g : *st) {
      out += std::to_string(g.step);
      for (const StateBlob& b : g.tensors) out += b.tensor + b.kind + b.data;
    }
    return out;
  }

 private:
  // Bytes between two tensors' scale inverses: room for the largest.
  static constexpr uint64_t kScaleStride = 4 * 130 * 5;
  static BufferHandle Handle(const SharedMemoryRegion& r, uint64_t offset,
                             uint64_t size) {
    BufferHandle h;
    h.kind = BufferHandle::Kind::kSharedMemory;
    h.segment_name = r.name();
    h.offset = offset;
    h.size = size;
    return h;
  }
  CpuBackend backend_;
  StateBudget budget_;
  std::string done_;
  std::unique_ptr<Session> session_;
  std::unique_ptr<SharedMemoryRegion> codes_, scales_, grads_;
};

TEST(Fp8SessionTest, WrongScaleBufferIsRefusedAndChangesNothing) {
  Fp8Session s;
  const std::string before = s.Trainer();
  const absl::Status bad = s.session().RegisterGroup(s.Spec(-4)).status();
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.message().find("w.block_1x128"), std::string::npos) << bad;
  EXPECT_NE(bad.message().find("scale_inv buffer is"), std::string::npos);
  EXPECT_EQ(s.Trainer(), before);
  GroupSpec no_recipe = s.Spec();
  no_recipe.tensors[2].fp8_recipe = Fp8Recipe::kNone;
  EXPECT_EQ(s.session().RegisterGroup(no_recipe).status().code(),
            absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(s.session().RegisterGroup(s.Spec()).ok());
}

// Save after one step; step; load: the trainer's codes and scales and the
// daemon's state are those of the save, and the next step gives the same
// bits as the run that never loaded. In the per-tensor and packed formats.
TEST(Fp8SessionTest, CheckpointsResumeBitForBit) {
  for (uint64_t packed_above : {uint64_t{1} << 30, uint64_t{0}}) {
    Fp8Session s;
    ASSERT_TRUE(s.session().RegisterGroup(s.Spec()).ok());
    ASSERT_TRUE(s.session().Step({}).ok());
    ScratchDir dir;
    CheckpointOptions options;
    options.packed_above_header_bytes = packed_above;
    ASSERT_TRUE(SaveSession(s.session(), dir.path(), options).ok());
    const std::string trainer = s.Trainer(), state = s.State();
    ASSERT_TRUE(s.session().Step({}).ok());
    const std::string trainer2 = s.Trainer(), state2 = s.State();
    ASSERT_NE(trainer2, trainer);
    ASSERT_TRUE(LoadSession(s.session(), dir.path(), CheckpointOptions()).ok());
    EXPECT_TRUE(s.Trainer() == trainer);
    EXPECT_TRUE(s.State() == state);
    ASSERT_TRUE(s.session().Step({}).ok());
    EXPECT_TRUE(s.Trainer() == trainer2);
    EXPECT_TRUE(s.State() == state2);
  }
}

// A master written by SetState is requantized into the trainer's codes and
// scales at once: writing back the master read out restores them exactly.
TEST(Fp8SessionTest, WritingTheMasterRequantizes) {
  Fp8Session s;
  ASSERT_TRUE(s.session().RegisterGroup(s.Spec()).ok());
  ASSERT_TRUE(s.session().Step({}).ok());
  const std::string trainer = s.Trainer();
  auto st = s.session().ReadState({});
  ASSERT_TRUE(st.ok());
  std::vector<StateBlob> masters;
  for (const StateBlob& b : (*st)[0].tensors) {
    if (b.kind == "master") masters.push_back(b);
  }
  ASSERT_EQ(masters.size(), 4u);
  ASSERT_TRUE(s.session().Step({}).ok());
  ASSERT_NE(s.Trainer(), trainer);
  ASSERT_TRUE(s.session().WriteState("g", 1, masters).ok());
  EXPECT_TRUE(s.Trainer() == trainer);
}

}  // namespace
}  // namespace optimd
