// GPU tests of the CUDA backend (tag "gpu"): every layout and option against
// the CPU reference backend on random data, through real CUDA IPC buffers
// owned by another process (testing/ipc_trainer.h).
//
// Tolerance: none where clipping is off. The kernels follow the reference
// operation by operation with IEEE fp32 division and square root and no FMA
// contraction, and derive the step scalars with the same double arithmetic,
// so parameters, masters and moments must be bit-identical. With clipping
// the global norm is summed in another order on the GPU (per-block partials)
// than on the CPU (per-task partials): the clip coefficient may differ in
// its last bits, so those results are compared to 1e-6 relative.
#include "backends/cuda/cuda_backend.h"

#include <cuda.h>
#include <cuda_runtime.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <random>
#include <thread>

#include "backends/cpu/cpu_backend.h"
#include "backends/cuda/ipc_mapping.h"
#include "backends/cuda/mapping_reaper.h"
#include "client/shm_tensor.h"
#include "common/fd_store.h"
#include "common/unique_fd.h"
#include "core/fp8.h"
#include "core/session.h"
#include "core/session_registry.h"
#include "gtest/gtest.h"
#include "kernels/adamw/adamw_cpu.h"
#include "testing/fp8_predictions.h"
#include "testing/ipc_trainer.h"

namespace optimd {
namespace {

IpcTrainer* g_trainer = nullptr;
// A trainer process on GPU 1 (its calls fail where there is none).
IpcTrainer* g_trainer1 = nullptr;
uint32_t g_seed = 0;

std::unique_ptr<SessionContext> Context(Backend* b, int device) {
  std::string done;
  auto c = b->OpenSession(device, "", &done);
  EXPECT_TRUE(c.ok()) << c.status();
  return *std::move(c);
}

struct TensorPlan {
  std::string name;
  uint64_t numel;
  DType param, grad;
  uint64_t param_off, grad_off;  // byte offsets in the group's buffers
  bool keep_fp32 = false, frozen = false;
  uint32_t stage = 0;  // of a staged step
  // FP8 parameters: the recipe, the shape, and the byte offset of the
  // scale inverses in the group's parameter buffer.
  Fp8Recipe recipe = Fp8Recipe::kNone;
  std::vector<uint64_t> shape;
  uint64_t scale_off = 0;
  uint64_t ScaleBytes() const {
    return recipe == Fp8Recipe::kNone
               ? 0
               : Fp8Geometry::Of(recipe, numel, shape).ScaleBytes();
  }
};

// One group registered twice: on the CPU backend over shared memory and on
// the CUDA backend over IPC buffers of the trainer process.
class Twin {
 public:
  Twin(Backend* cpu, Backend* gpu, std::vector<TensorPlan> tensors,
       GroupSpec spec, std::mt19937* rng)
      : tensors_(std::move(tensors)), spec_(std::move(spec)), rng_(rng) {
    for (const TensorPlan& t : tensors_) {
      pbytes_ = std::max(pbytes_, t.param_off + t.numel * DTypeSize(t.param));
      pbytes_ = std::max(pbytes_, t.scale_off + t.ScaleBytes());
      gbytes_ = std::max(gbytes_, t.grad_off + t.numel * DTypeSize(t.grad));
    }
    pbytes_ += 64;
    gbytes_ += 64;
    cpu_params_ = *SharedMemoryRegion::Create(pbytes_);
    cpu_grads_ = *SharedMemoryRegion::Create(gbytes_);
    gpu_params_ = *g_trainer->Alloc(pbytes_);
    gpu_grads_ = *g_trainer->Alloc(gbytes_);
    FillParams();
    cpu_session_ = std::make_unique<Session>(SessionIdentity{"cpu", 0, 1, -1},
                                             cpu, &budget_, Context(cpu, -1));
    gpu_session_ = std::make_unique<Session>(SessionIdentity{"gpu", 0, 1, 0},
                                             gpu, &budget_, Context(gpu, 0));
    status_ = Register();
  }

  absl::Status status() const { return status_; }
  // Steps the CPU session skipped (Step checks the GPU's agree).
  int skipped_steps() const { return skipped_steps_; }
  Session& gpu_session() { return *gpu_session_; }
  Session& cpu_session() { return *cpu_session_; }

  // Fresh random gradients (optionally one non-finite element): normal,
  // but one in eight exactly zero and one in sixteen tiny (about 1e-20),
  // so that second moments are zero or subnormal beside normal ones in the
  // same tiles, and the kernels' square roots take their slow path there.
  // `poison`: one element of the first stepped tensor holds `bad`.
  void FillGrads(bool poison, float bad = NAN) {
    uint8_t* g = cpu_grads_->data();
    std::normal_distribution<float> normal(0.f, 1.f);
    std::uniform_int_distribution<int> kind(0, 15);
    for (const TensorPlan& t : tensors_) {
      for (uint64_t i = 0; i < t.numel; ++i) {
        const int k = kind(*rng_);
        float x = normal(*rng_);
        if (k < 2) x = 0.0f;
        if (k == 2) x *= 1e-20f;
        Store(t.grad, g + t.grad_off + grad_shift_, i, x);
      }
    }
    if (poison) {
      for (const TensorPlan& t : tensors_) {
        if (t.numel > 0 && !t.frozen) {
          Store(t.grad, g + t.grad_off + grad_shift_, t.numel / 2, bad);
          break;
        }
      }
    }
    std::memcpy(g_trainer->staging(), g, gbytes_);
    EXPECT_TRUE(g_trainer->Upload(gpu_grads_.id, 0, gbytes_, 0).ok());
  }

  // Points every tensor's gradient at a new buffer of both sessions
  // (UpdateBuffers), `shift` bytes (< 64) further in than at registration:
  // a shift that is not a multiple of 16 bytes takes the tiles from items
  // that had them, and a later shift of 0 gives them back.
  absl::Status MoveGrads(uint64_t shift) {
    cpu_grads_ = *SharedMemoryRegion::Create(gbytes_);
    gpu_grads_ = *g_trainer->Alloc(gbytes_);
    grad_shift_ = shift;
    std::vector<BufferUpdate> cpu_updates, gpu_updates;
    for (const TensorPlan& t : tensors_) {
      if (t.numel == 0 || t.frozen) continue;
      BufferUpdate c, g;
      c.tensor = g.tensor = t.name;
      Handles(*cpu_grads_, gpu_grads_, t.grad_off + shift,
              t.numel * DTypeSize(t.grad), &c.grad, &g.grad);
      cpu_updates.push_back(c);
      gpu_updates.push_back(g);
    }
    absl::Status s = cpu_session_->UpdateBuffers(spec_.id, cpu_updates);
    if (!s.ok()) return s;
    return gpu_session_->UpdateBuffers(spec_.id, gpu_updates);
  }

  // Marks the gradient of tensor `name` absent in both sessions (torch's
  // .grad is None: the tensor is left out of steps), or points it at its
  // gradient buffer again.
  absl::Status SetGradAbsent(const std::string& name, bool absent) {
    for (const TensorPlan& t : tensors_) {
      if (t.name != name) continue;
      BufferUpdate c, g;
      c.tensor = g.tensor = name;
      c.grad_absent = g.grad_absent = absent;
      if (!absent) {
        Handles(*cpu_grads_, gpu_grads_, t.grad_off + grad_shift_,
                t.numel * DTypeSize(t.grad), &c.grad, &g.grad);
      }
      absl::Status s = cpu_session_->UpdateBuffers(spec_.id, {c});
      if (!s.ok()) return s;
      return gpu_session_->UpdateBuffers(spec_.id, {g});
    }
    return absl::NotFoundError(name);
  }

  // `gspec`: the GPU session's request, e.g. with step flags (their ready
  // word already written).
  void Step(const StepRequestSpec& spec, bool exact) {
    Step(spec, spec, exact);
  }
  void Step(const StepRequestSpec& spec, StepRequestSpec gspec, bool exact) {
    gspec.options.wait = true;
    auto c = cpu_session_->Step(spec);
    auto g = gpu_session_->Step(gspec);
    ASSERT_TRUE(c.ok()) << c.status();
    ASSERT_TRUE(g.ok()) << g.status();
    ASSERT_TRUE(g->outcome.current);
    EXPECT_EQ(c->outcome.skipped, g->outcome.skipped);
    if (c->outcome.skipped) ++skipped_steps_;
    if (!std::isfinite(c->outcome.grad_norm)) {
      // Applied non-finite gradients (assume_finite): the same NaN or inf.
      EXPECT_EQ(std::isnan(c->outcome.grad_norm),
                std::isnan(g->outcome.grad_norm));
      EXPECT_EQ(std::isinf(c->outcome.grad_norm),
                std::isinf(g->outcome.grad_norm));
    } else if (!c->outcome.skipped) {
      EXPECT_NEAR(c->outcome.grad_norm, g->outcome.grad_norm,
                  1e-12 * c->outcome.grad_norm);
    }
    for (size_t i = 0; i < c->group_steps.size(); ++i) {
      EXPECT_EQ(c->group_steps[i].second, g->group_steps[i].second);
    }
    Compare(exact);
  }

  void Compare(bool exact) {
    // Parameters in the trainer's buffers.
    ASSERT_TRUE(g_trainer->Download(gpu_params_.id, 0, pbytes_, 0).ok());
    for (const TensorPlan& t : tensors_) {
      const uint8_t* a = cpu_params_->data() + t.param_off;
      const uint8_t* b = g_trainer->staging() + t.param_off;
      CompareBytes(t.name + " param", t.param, a, b, t.numel, exact);
      if (t.ScaleBytes() > 0) {
        EXPECT_EQ(
            std::memcmp(cpu_params_->data() + t.scale_off,
                        g_trainer->staging() + t.scale_off, t.ScaleBytes()),
            0)
            << t.name << " scale_inv (seed " << g_seed << ")";
      }
    }
    // Masters and moments.
    auto cs = cpu_session_->ReadState({});
    auto gs = gpu_session_->ReadState({});
    ASSERT_TRUE(cs.ok() && gs.ok());
    ASSERT_EQ(cs->size(), gs->size());
    for (size_t g = 0; g < cs->size(); ++g) {
      const auto& ct = (*cs)[g].tensors;
      const auto& gt = (*gs)[g].tensors;
      ASSERT_EQ(ct.size(), gt.size());
      EXPECT_EQ((*cs)[g].step, (*gs)[g].step);
      for (size_t i = 0; i < ct.size(); ++i) {
        ASSERT_EQ(ct[i].kind, gt[i].kind);
        CompareBytes(ct[i].tensor + " " + ct[i].kind, ct[i].dtype,
                     reinterpret_cast<const uint8_t*>(ct[i].data.data()),
                     reinterpret_cast<const uint8_t*>(gt[i].data.data()),
                     ct[i].numel, exact);
      }
    }
  }

 private:
  static void Store(DType d, uint8_t* base, uint64_t i, float v) {
    switch (d) {
      case DType::kFloat32:
        reinterpret_cast<float*>(base)[i] = v;
        break;
      case DType::kBFloat16:
        reinterpret_cast<uint16_t*>(base)[i] = FloatToBFloat16(v);
        break;
      case DType::kFloat16:
        reinterpret_cast<uint16_t*>(base)[i] = FloatToHalf(v);
        break;
      case DType::kFloat64:  // v / 3: a full double mantissa
        reinterpret_cast<double*>(base)[i] = static_cast<double>(v) / 3.0;
        break;
      case DType::kFloat8E4M3:
        base[i] = EncodeFp8<kE4M3>(v);
        break;
      case DType::kFloat8E5M2:
        base[i] = EncodeFp8<kE5M2>(v);
        break;
      case DType::kBlock8:  // state only, never a parameter or gradient
        break;
    }
  }
  // Both NaN: the CPU keeps a NaN operand's payload, CUDA writes its own
  // canonical NaN, so NaNs are equal whatever their bits.
  static bool BothNan(DType d, const uint8_t* a, const uint8_t* b, uint64_t i) {
    return std::isnan(Load(d, a, i)) && std::isnan(Load(d, b, i));
  }

  static double Load(DType d, const uint8_t* base, uint64_t i) {
    switch (d) {
      case DType::kFloat64:
        return reinterpret_cast<const double*>(base)[i];
      case DType::kFloat32:
        return reinterpret_cast<const float*>(base)[i];
      case DType::kBFloat16:
        return BFloat16ToFloat(reinterpret_cast<const uint16_t*>(base)[i]);
      case DType::kFloat16:
        return HalfToFloat(reinterpret_cast<const uint16_t*>(base)[i]);
      case DType::kFloat8E4M3:
        return DecodeFp8<kE4M3>(base[i]);
      case DType::kFloat8E5M2:
        return DecodeFp8<kE5M2>(base[i]);
      case DType::kBlock8:  // state only, never a parameter or gradient
        break;
    }
    return 0;
  }

  void CompareBytes(const std::string& what, DType d, const uint8_t* a,
                    const uint8_t* b, uint64_t n, bool exact) {
    if (exact) {
      const uint64_t bytes = n * DTypeSize(d);
      if (std::memcmp(a, b, bytes) == 0) return;
      for (uint64_t i = 0; i < n; ++i) {
        if (std::memcmp(a + i * DTypeSize(d), b + i * DTypeSize(d),
                        DTypeSize(d)) != 0 &&
            !BothNan(d, a, b, i)) {
          ADD_FAILURE() << what << " differs at element " << i << " of " << n
                        << ": cpu " << Load(d, a, i) << " gpu " << Load(d, b, i)
                        << " (seed " << g_seed << ")";
          return;
        }
      }
    }
    if (exact) return;
    double scale = 0, err = 0;
    for (uint64_t i = 0; i < n; ++i) {
      if (std::isnan(Load(d, a, i)) || std::isnan(Load(d, b, i))) {
        EXPECT_TRUE(BothNan(d, a, b, i)) << what << " element " << i;
        continue;
      }
      scale = std::max(scale, std::fabs(double(Load(d, a, i))));
      err = std::max(err, std::fabs(double(Load(d, a, i)) - Load(d, b, i)));
    }
    // One ulp of the low-precision dtypes where the clip coefficient moved
    // a value across a rounding boundary.
    const double tol = d == DType::kFloat64   ? 1e-12
                       : d == DType::kFloat32 ? 1e-6
                                              : 1e-2;
    EXPECT_LE(err, tol * scale) << what << " (seed " << g_seed << ")";
  }

  void FillParams() {
    std::normal_distribution<float> normal(0.f, 1.f);
    for (const TensorPlan& t : tensors_) {
      for (uint64_t i = 0; i < t.numel; ++i) {
        Store(t.param, cpu_params_->data() + t.param_off, i, normal(*rng_));
      }
      // Scale inverses of 1/64 (MXFP8: 2^-6, code 121).
      for (uint64_t u = 0; u < t.ScaleBytes(); u += 4) {
        uint8_t* q = cpu_params_->data() + t.scale_off + u;
        if (t.recipe == Fp8Recipe::kMxfp8) {
          std::memset(q, 121, std::min<uint64_t>(4, t.ScaleBytes() - u));
        } else {
          const float inv = 1.0f / 64;
          std::memcpy(q, &inv, 4);
        }
      }
    }
    std::memcpy(g_trainer->staging(), cpu_params_->data(), pbytes_);
    EXPECT_TRUE(g_trainer->Upload(gpu_params_.id, 0, pbytes_, 0).ok());
  }

  // The same bytes of the two sessions' buffers: `cpu` (shared memory)
  // and `gpu` (the trainer's CUDA allocation on GPU 0).
  static void Handles(const SharedMemoryRegion& cpu,
                      const IpcTrainer::Allocation& gpu, uint64_t offset,
                      uint64_t size, BufferHandle* c, BufferHandle* g) {
    c->kind = BufferHandle::Kind::kSharedMemory;
    c->segment_name = cpu.name();
    c->offset = offset;
    c->size = size;
    g->kind = BufferHandle::Kind::kCudaIpc;
    g->ipc_handle = gpu.ipc_handle;
    g->device = 0;
    g->offset = offset;
    g->size = size;
  }

  absl::Status Register() {
    GroupSpec cpu_spec = spec_, gpu_spec = spec_;
    for (const TensorPlan& t : tensors_) {
      TensorSpec ts;
      ts.name = t.name;
      ts.numel = t.numel;
      ts.param_dtype = t.param;
      ts.grad_dtype = t.grad;
      ts.param_dtype_set = ts.grad_dtype_set = true;
      ts.keep_fp32 = t.keep_fp32;
      ts.frozen = t.frozen;
      ts.stage = t.stage;
      ts.fp8_recipe = t.recipe;
      ts.shape = t.shape;
      TensorSpec c = ts, g = ts;
      if (t.numel > 0) {
        Handles(*cpu_params_, gpu_params_, t.param_off,
                t.numel * DTypeSize(t.param), &c.param, &g.param);
        if (t.recipe != Fp8Recipe::kNone) {
          Handles(*cpu_params_, gpu_params_, t.scale_off, t.ScaleBytes(),
                  &c.scale_inv, &g.scale_inv);
        }
        if (!t.frozen) {
          Handles(*cpu_grads_, gpu_grads_, t.grad_off,
                  t.numel * DTypeSize(t.grad), &c.grad, &g.grad);
        }
      }
      cpu_spec.tensors.push_back(c);
      gpu_spec.tensors.push_back(g);
    }
    auto a = cpu_session_->RegisterGroup(cpu_spec);
    if (!a.ok()) return a.status();
    auto b = gpu_session_->RegisterGroup(gpu_spec);
    if (!b.ok()) return b.status();
    return absl::OkStatus();
  }

  std::vector<TensorPlan> tensors_;
  GroupSpec spec_;
  std::mt19937* rng_;
  uint64_t grad_shift_ = 0;  // MoveGrads
  StateBudget budget_{0};
  uint64_t pbytes_ = 0, gbytes_ = 0;
  std::unique_ptr<SharedMemoryRegion> cpu_params_, cpu_grads_;
  IpcTrainer::Allocation gpu_params_, gpu_grads_;
  std::unique_ptr<Session> cpu_session_, gpu_session_;
  absl::Status status_;
  int skipped_steps_ = 0;
};

class CudaBackendTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto g = CreateCudaBackend(0, CudaBackendOptions{4096, 4});
    ASSERT_TRUE(g.ok()) << g.status();
    gpu_ = *std::move(g);
    cpu_ = std::make_unique<CpuBackend>(CpuBackend::Options{4, 4096});
    rng_.seed(g_seed + ::testing::UnitTest::GetInstance()->random_seed());
  }

  // Tensors of random sizes (0, 1, odd, several items) at aligned and
  // unaligned offsets, all with the given dtypes.
  std::vector<TensorPlan> RandomTensors(DType param, DType grad, int count) {
    static const uint64_t kSizes[] = {0, 1, 3, 7, 33, 1000, 4099, 9000, 70001};
    std::vector<TensorPlan> out;
    uint64_t poff = 0, goff = 0;
    for (int i = 0; i < count; ++i) {
      TensorPlan t;
      t.name = "t" + std::to_string(i);
      t.numel = kSizes[rng_() % 9];
      t.param = param;
      t.grad = grad;
      // Every other tensor starts one element past a 16-byte boundary.
      const uint64_t skew = (i % 2) ? 1 : 0;
      t.param_off = (poff + 15) / 16 * 16 + skew * DTypeSize(param);
      t.grad_off = (goff + 15) / 16 * 16 + skew * DTypeSize(grad);
      poff = t.param_off + t.numel * DTypeSize(param);
      goff = t.grad_off + t.numel * DTypeSize(grad);
      out.push_back(t);
    }
    return out;
  }

  // Every layout the kernels have: parameter dtype and master, gradient
  // dtype, moment dtype.
  struct LayoutCase {
    DType param;
    MasterRequest master;
    DType grad;
    DType moment;
  };
  // `moments` fp32 and bf16, or block8 alone (AdamW without amsgrad).
  static std::vector<LayoutCase> EveryLayout(bool block8 = false) {
    const std::pair<DType, MasterRequest> params[] = {
        {DType::kFloat32, MasterRequest::kNone},
        {DType::kFloat32, MasterRequest::kFp32},
        {DType::kBFloat16, MasterRequest::kFp32},
        {DType::kBFloat16, MasterRequest::kRemainder},
        {DType::kFloat16, MasterRequest::kFp32}};
    std::vector<LayoutCase> out;
    for (const auto& [param, master] : params) {
      for (DType g : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
        if (block8) {
          out.push_back({param, master, g, DType::kBlock8});
          continue;
        }
        for (DType m : {DType::kFloat32, DType::kBFloat16}) {
          out.push_back({param, master, g, m});
        }
      }
    }
    return out;
  }

  std::unique_ptr<Backend> gpu_;
  std::unique_ptr<Backend> cpu_;
  std::mt19937 rng_;
};

TEST_F(CudaBackendTest, EveryLayoutMatchesTheCpuReferenceBitForBit) {
  std::vector<LayoutCase> layouts = EveryLayout();
  // The float64 layout, four times: amsgrad and AdamW/Adam both ways.
  for (int i = 0; i < 4; ++i) {
    layouts.push_back({DType::kFloat64, MasterRequest::kDefault,
                       DType::kFloat64, DType::kFloat64});
  }
  int combo = 0;
  for (const LayoutCase& c : layouts) {
    ++combo;
    GroupSpec spec;
    spec.id = "g";
    spec.master = c.master;
    spec.moment_dtype = c.moment;
    spec.hyper.lr = 1e-2;
    spec.hyper.amsgrad = combo % 2;
    spec.hyper.adamw = (combo / 2) % 2 == 0;
    spec.hyper.maximize = (combo / 3) % 2;
    spec.hyper.bias_correction = combo % 5 != 0;
    spec.hyper.weight_decay = combo % 3 ? 0.01 : 0.0;
    SCOPED_TRACE(::testing::Message()
                 << "param " << DTypeName(c.param) << " master "
                 << int(c.master) << " grad " << DTypeName(c.grad)
                 << " moments " << DTypeName(c.moment) << " amsgrad "
                 << spec.hyper.amsgrad << " adamw " << spec.hyper.adamw);
    Twin twin(cpu_.get(), gpu_.get(), RandomTensors(c.param, c.grad, 6), spec,
              &rng_);
    ASSERT_TRUE(twin.status().ok()) << twin.status();
    for (int step = 1; step <= 4; ++step) {
      twin.FillGrads(/*poison=*/step == 3);
      StepRequestSpec s;
      s.options.grad_scale = step == 2 ? 128.0 : 1.0;
      twin.Step(s, /*exact=*/true);
    }
  }
}

// block8 moments on every parameter and gradient layout: parameters and
// the moments as GetState reads them (codes times scales, fp32) equal the
// CPU reference bit for bit, through a loss scale, a skipped step and
// both AdamW and Adam. Tensors of odd sizes and offsets give whole,
// partial and unaligned (byte by byte) block8 blocks.
TEST_F(CudaBackendTest, Block8MomentsMatchTheCpuReferenceBitForBit) {
  int combo = 0;
  for (const LayoutCase& c : EveryLayout(/*block8=*/true)) {
    ++combo;
    GroupSpec spec;
    spec.id = "g";
    spec.master = c.master;
    spec.moment_dtype = c.moment;
    spec.hyper.lr = 1e-2;
    spec.hyper.adamw = combo % 2 == 0;
    spec.hyper.maximize = (combo / 2) % 2;
    spec.hyper.bias_correction = combo % 5 != 0;
    spec.hyper.weight_decay = combo % 3 ? 0.01 : 0.0;
    SCOPED_TRACE(::testing::Message()
                 << "param " << DTypeName(c.param) << " master "
                 << int(c.master) << " grad " << DTypeName(c.grad) << " adamw "
                 << spec.hyper.adamw);
    Twin twin(cpu_.get(), gpu_.get(), RandomTensors(c.param, c.grad, 6), spec,
              &rng_);
    ASSERT_TRUE(twin.status().ok()) << twin.status();
    for (int step = 1; step <= 5; ++step) {
      twin.FillGrads(/*poison=*/step == 3);
      StepRequestSpec s;
      s.options.grad_scale = step == 2 ? 128.0 : 1.0;
      twin.Step(s, /*exact=*/true);
    }
  }
}

// Where the next FP8 tensor of a test's buffers goes: its codes, its
// gradient (4 bytes an element at most) and, in the parameter buffer after
// every tensor's codes, its scale inverses.
struct Fp8Offsets {
  uint64_t param = 0, grad = 0, scale = 1 << 22;
};

// Appends FP8 tensor `name` of `shape` (recipe r, its gradient `shift`
// bytes past a 256-byte boundary) to ts at `at`, and moves `at` past it.
void AppendFp8Tensor(const std::string& name,
                     const std::vector<uint64_t>& shape, DType d, DType grad,
                     Fp8Recipe r, uint64_t shift, Fp8Offsets* at,
                     std::vector<TensorPlan>* ts) {
  TensorPlan t{name,      shape[0] * (shape.size() > 1 ? shape[1] : 1),
               d,         grad,
               at->param, at->grad + shift};
  t.recipe = r;
  t.shape = shape;
  t.scale_off = at->scale;
  at->param += (t.numel + 255) / 256 * 256;
  at->grad += (t.numel * 4 + shift + 255) / 256 * 256;
  at->scale += (t.ScaleBytes() + 255) / 256 * 256;
  ts->push_back(t);
}

// FP8 parameters of every recipe and both formats, ragged and 1-D shapes,
// bf16 and fp32 gradients and moments: the masters, the moments, the
// codes and the scale inverses equal the CPU reference's bit for bit,
// through a skipped step too.
TEST_F(CudaBackendTest, Fp8ParametersMatchTheCpuReferenceBitForBit) {
  int combo = 0;
  for (DType d : {DType::kFloat8E4M3, DType::kFloat8E5M2}) {
    for (DType grad : {DType::kBFloat16, DType::kFloat32}) {
      ++combo;
      std::vector<TensorPlan> ts;
      Fp8Offsets at;
      int k = 0;
      for (Fp8Recipe r : {Fp8Recipe::kTensor, Fp8Recipe::kBlock1x128,
                          Fp8Recipe::kBlock128x128, Fp8Recipe::kMxfp8}) {
        // Shapes whose units the update's warp blocks hold whole (one
        // pass) and others (amax, then the encode pass): 1x128 and MXFP8
        // blocks of whole rows, 128x128 blocks of one row and of several
        // (walked unit by unit: an odd last row, a block row of 64 rows,
        // 32 units a block row), ragged columns; {12800} and {130, 256}
        // with gradients 4 bytes off alignment (element by element).
        for (std::vector<uint64_t> shape :
             {std::vector<uint64_t>{300, 200}, std::vector<uint64_t>{5000},
              std::vector<uint64_t>{257, 384}, std::vector<uint64_t>{12800},
              std::vector<uint64_t>{64, 4096}, std::vector<uint64_t>{3, 96},
              std::vector<uint64_t>{130, 256}}) {
          const uint64_t shift =
              shape == std::vector<uint64_t>{12800} ||
                      shape == std::vector<uint64_t>{130, 256}
                  ? 4
                  : 0;
          AppendFp8Tensor("w" + std::to_string(k++), shape, d, grad, r, shift,
                          &at, &ts);
        }
      }
      GroupSpec spec;
      spec.id = "fp8";
      spec.hyper.lr = 1e-2;
      spec.hyper.weight_decay = 0.01;
      spec.moment_dtype = combo % 2 ? DType::kBFloat16 : DType::kFloat32;
      SCOPED_TRACE(::testing::Message()
                   << DTypeName(d) << " grad " << DTypeName(grad));
      Twin twin(cpu_.get(), gpu_.get(), ts, spec, &rng_);
      ASSERT_TRUE(twin.status().ok()) << twin.status();
      twin.Compare(/*exact=*/true);  // the masters read at registration
      for (int step = 1; step <= 4; ++step) {
        twin.FillGrads(/*poison=*/step == 3);
        twin.Step(StepRequestSpec(), /*exact=*/true);
      }
      EXPECT_EQ(twin.skipped_steps(), 1);
    }
  }
}

// Per-tensor-scaled FP8 parameters whose update encodes from a predicted
// amax: with a small learning rate the largest weight stays among the
// candidates, so after the first step (no candidates yet) the encode pass
// never reads a master back, through a skipped step and a tensor that
// misses steps without a gradient; with a large one the largest weight
// moves and the encode pass runs again. Bit for bit with the CPU either
// way (codes, scale inverses, masters, moments).
TEST_F(CudaBackendTest, Fp8PerTensorAmaxPredictionKeepsTheBits) {
  for (double lr : {1e-3, 1.0}) {
    for (DType d : {DType::kFloat8E4M3, DType::kFloat8E5M2}) {
      SCOPED_TRACE(::testing::Message() << "lr " << lr << " " << DTypeName(d));
      std::vector<TensorPlan> ts;
      Fp8Offsets at;
      int k = 0;
      for (std::vector<uint64_t> shape :
           {std::vector<uint64_t>{300, 200}, std::vector<uint64_t>{5000},
            std::vector<uint64_t>{12800}, std::vector<uint64_t>{64, 4096},
            std::vector<uint64_t>{3, 96}}) {
        const uint64_t shift = shape == std::vector<uint64_t>{12800} ? 4 : 0;
        AppendFp8Tensor("w" + std::to_string(k++), shape, d, DType::kBFloat16,
                        Fp8Recipe::kTensor, shift, &at, &ts);
      }
      GroupSpec spec;
      spec.id = "fp8_tensor";
      spec.hyper.lr = lr;
      spec.hyper.weight_decay = 0.01;
      Twin twin(cpu_.get(), gpu_.get(), ts, spec, &rng_);
      ASSERT_TRUE(twin.status().ok()) << twin.status();
      constexpr int kSteps = 8;
      for (int step = 1; step <= kSteps; ++step) {
        ASSERT_TRUE(twin.SetGradAbsent("w1", step == 4 || step == 5).ok());
        twin.FillGrads(/*poison=*/step == 3);
        twin.Step(StepRequestSpec(), /*exact=*/true);
      }
      const auto read = ReadFp8Predictions(twin.gpu_session());
      ASSERT_TRUE(read.ok()) << read.status();
      const std::vector<cuda::Fp8Prediction>& p = *read;
      ASSERT_EQ(p.size(), ts.size());
      uint32_t passes = 0;
      for (size_t f = 0; f < p.size(); ++f) {
        passes += p[f].encode_passes;
        if (lr < 0.1) {
          EXPECT_EQ(p[f].encode_passes, 1u) << ts[f].name;
        }
      }
      if (lr > 0.1) {
        EXPECT_GT(passes, p.size());  // the prediction missed at times
      }
    }
  }
}

// A group whose only tensors are 128x128-scaled FP8 weights of several
// rows: their launch has unit tasks and no work block of the update (and
// e5m2 with amsgrad, a gradient that goes and comes): bit for bit.
TEST_F(CudaBackendTest, Fp8UnitWalkedGroupAloneMatchesTheCpuReference) {
  std::vector<TensorPlan> ts;
  Fp8Offsets at;
  for (std::vector<uint64_t> shape :
       {std::vector<uint64_t>{256, 512}, std::vector<uint64_t>{129, 128}}) {
    AppendFp8Tensor("u" + std::to_string(ts.size()), shape, DType::kFloat8E5M2,
                    DType::kBFloat16, Fp8Recipe::kBlock128x128, 0, &at, &ts);
  }
  GroupSpec spec;
  spec.id = "units";
  spec.hyper.lr = 1e-2;
  spec.hyper.weight_decay = 0.01;
  spec.hyper.amsgrad = true;
  Twin twin(cpu_.get(), gpu_.get(), ts, spec, &rng_);
  ASSERT_TRUE(twin.status().ok()) << twin.status();
  for (int step = 1; step <= 5; ++step) {
    // u0 has no gradient in steps 2 and 3 (its unit tasks leave it alone;
    // its own step count then lags the group's).
    const absl::Status absent =
        twin.SetGradAbsent("u0", step == 2 || step == 3);
    ASSERT_TRUE(absent.ok()) << absent;
    twin.FillGrads(/*poison=*/false);
    twin.Step(StepRequestSpec(), /*exact=*/true);
  }
}

TEST_F(CudaBackendTest, MixedGroupWithKeepFp32FrozenAndEmpty) {
  std::vector<TensorPlan> ts =
      RandomTensors(DType::kBFloat16, DType::kBFloat16, 5);
  TensorPlan norm{"norm", 777, DType::kFloat32, DType::kFloat32, 0, 0, true};
  TensorPlan frozen{"frozen", 100, DType::kBFloat16, DType::kBFloat16, 0, 0,
                    false,    true};
  TensorPlan empty{"empty", 0, DType::kFloat32, DType::kFloat32, 0, 0};
  uint64_t poff = 1 << 20, goff = 1 << 20;
  for (TensorPlan* t : {&norm, &frozen, &empty}) {
    t->param_off = poff;
    t->grad_off = goff;
    poff += 8192;
    goff += 8192;
    ts.push_back(*t);
  }
  GroupSpec spec;
  spec.id = "mixed";
  spec.hyper.lr = 3e-3;
  Twin twin(cpu_.get(), gpu_.get(), ts, spec, &rng_);
  ASSERT_TRUE(twin.status().ok()) << twin.status();
  for (int step = 0; step < 5; ++step) {
    twin.FillGrads(false);
    twin.Step(StepRequestSpec(), true);
  }
}

// float64 tensors beside float32 ones in one group (moments by default:
// float64 for float64 parameters), through tensors that miss steps
// (their own bias corrections), gradients moved to buffers of another
// alignment, a loss scale and a skipped step: bit for bit; with clipping
// and learning-rate overrides, to 1e-12 (the norm's summation order).
TEST_F(CudaBackendTest, Float64TensorsMatchTheCpuReference) {
  std::vector<TensorPlan> ts =
      RandomTensors(DType::kFloat64, DType::kFloat64, 6);
  uint64_t end = 0;
  std::vector<std::string> toggled;  // tensors whose gradients go and come
  for (const TensorPlan& t : ts) {
    end = std::max({end, t.param_off + t.numel * 8, t.grad_off + t.numel * 8});
    if (t.numel > 0 && toggled.size() < 2) toggled.push_back(t.name);
  }
  end = (end + 63) / 64 * 64;
  ts.push_back({"f32", 4099, DType::kFloat32, DType::kFloat32, end, end});
  GroupSpec spec;
  spec.id = "g";
  spec.hyper.lr = 1e-2;
  spec.hyper.weight_decay = 0.01;
  spec.hyper.amsgrad = true;
  spec.moment_dtype_default = true;
  Twin twin(cpu_.get(), gpu_.get(), ts, spec, &rng_);
  ASSERT_TRUE(twin.status().ok()) << twin.status();
  for (int step = 1; step <= 8; ++step) {
    SCOPED_TRACE(step);
    if (step == 5) {
      ASSERT_TRUE(twin.MoveGrads(8).ok());
    }
    for (const std::string& name : toggled) {
      ASSERT_TRUE(twin.SetGradAbsent(name, step == 2 || step == 3).ok());
    }
    twin.FillGrads(/*poison=*/step == 4);
    StepRequestSpec s;
    s.options.grad_scale = step == 6 ? 64.0 : 1.0;
    twin.Step(s, /*exact=*/true);
  }
  EXPECT_EQ(twin.skipped_steps(), 1);
  for (int step = 0; step < 4; ++step) {
    twin.FillGrads(false);
    StepRequestSpec s;
    s.options.max_grad_norm = step % 2 ? 1.0 : 1e6;
    HyperOverride o;
    o.group_id = "g";
    o.lr = 1e-2 * (step + 1);
    s.overrides = {o};
    twin.Step(s, /*exact=*/false);
  }
}

// New gradient buffers between steps (the trainer's allocator moved them):
// when their alignment changes which items have tiles, the work blocks
// holding those items are recounted, and every element is still updated
// exactly once.
TEST_F(CudaBackendTest, NewGradientBuffersOfAnotherAlignment) {
  for (DType d : {DType::kFloat32, DType::kBFloat16}) {
    SCOPED_TRACE(DTypeName(d));
    std::vector<TensorPlan> ts;
    uint64_t off = 0;
    for (uint64_t n : {uint64_t{10000}, uint64_t{4096}, uint64_t{70001},
                       uint64_t{256}, uint64_t{33}}) {
      TensorPlan t{"t" + std::to_string(ts.size()), n, d, d, off, off};
      off = (off + n * DTypeSize(d) + 15) / 16 * 16;
      ts.push_back(t);
    }
    GroupSpec spec;
    spec.id = "g";
    spec.hyper.lr = 1e-2;
    if (d == DType::kBFloat16) {
      spec.master = MasterRequest::kRemainder;
      spec.moment_dtype = DType::kBFloat16;
    }
    Twin twin(cpu_.get(), gpu_.get(), ts, spec, &rng_);
    ASSERT_TRUE(twin.status().ok()) << twin.status();
    for (int step = 0; step < 2; ++step) {
      twin.FillGrads(false);
      twin.Step(StepRequestSpec(), /*exact=*/true);
    }
    // One element past 16 bytes (no tiles), 32 bytes (tiles again), and a
    // new buffer at the registered offsets (same tiles, new pointers).
    for (uint64_t shift : {DTypeSize(d), uint64_t{32}, uint64_t{0}}) {
      SCOPED_TRACE(shift);
      ASSERT_TRUE(twin.MoveGrads(shift).ok());
      for (int step = 0; step < 2; ++step) {
        twin.FillGrads(false);
        twin.Step(StepRequestSpec(), /*exact=*/true);
      }
    }
  }
}

// assume_finite (optimd.torch's default): a NaN or inf gradient goes into
// the update on both backends alike, without clipping and with it (a NaN
// norm clips by NaN, an infinite one by 0, as torch's clip_grad_norm_), and
// the step is not skipped. Layouts without remainders: a NaN master's
// remainder holds the backend's own NaN bits.
TEST_F(CudaBackendTest, AppliedNonFiniteGradientsMatchTheCpuReference) {
  // Block8 moments too: an inf or NaN moment makes its block's scale
  // non-finite, and every code of that block then comes from an inf or NaN
  // multiplier (Block8MultiplierOf), which both backends must encode alike.
  std::vector<LayoutCase> layouts = EveryLayout();
  for (const LayoutCase& c : EveryLayout(/*block8=*/true)) {
    layouts.push_back(c);
  }
  for (const LayoutCase& c : layouts) {
    if (c.master == MasterRequest::kRemainder) continue;
    for (double clip : {0.0, 1.0}) {
      for (float bad : {NAN, INFINITY}) {
        GroupSpec spec;
        spec.id = "g";
        spec.master = c.master;
        spec.moment_dtype = c.moment;
        spec.hyper.lr = 1e-2;
        spec.hyper.weight_decay = 0.01;
        SCOPED_TRACE(::testing::Message()
                     << "param " << DTypeName(c.param) << " grad "
                     << DTypeName(c.grad) << " moment " << DTypeName(c.moment)
                     << " clip " << clip << " bad " << bad);
        Twin twin(cpu_.get(), gpu_.get(), RandomTensors(c.param, c.grad, 6),
                  spec, &rng_);
        ASSERT_TRUE(twin.status().ok()) << twin.status();
        for (int step = 1; step <= 3; ++step) {
          twin.FillGrads(/*poison=*/step == 2, bad);
          StepRequestSpec s;
          s.options.assume_finite = true;
          s.options.max_grad_norm = clip;
          twin.Step(s, /*exact=*/clip == 0);
        }
        EXPECT_EQ(twin.skipped_steps(), 0);
      }
    }
  }
}

TEST_F(CudaBackendTest, ClippingAndLrOverrides) {
  GroupSpec spec;
  spec.id = "g";
  spec.hyper.lr = 1e-2;
  Twin twin(cpu_.get(), gpu_.get(),
            RandomTensors(DType::kFloat32, DType::kFloat32, 8), spec, &rng_);
  ASSERT_TRUE(twin.status().ok()) << twin.status();
  for (int step = 0; step < 10; ++step) {
    twin.FillGrads(false);
    StepRequestSpec s;
    s.options.max_grad_norm = step % 2 ? 1.0 : 1e6;
    HyperOverride o;
    o.group_id = "g";
    o.lr = 1e-2 * (step + 1);
    o.beta1 = 0.85 + 0.01 * step;
    s.overrides = {o};
    twin.Step(s, /*exact=*/false);
  }
}

TEST_F(CudaBackendTest, BadHandlesAreInvalidArgumentAndHarmless) {
  auto alloc = *g_trainer->Alloc(4096);
  BufferHandle h;
  h.kind = BufferHandle::Kind::kCudaIpc;
  h.ipc_handle = alloc.ipc_handle;
  h.device = 0;
  h.size = 1024;
  EXPECT_TRUE(gpu_->ResolveBuffer(h, 4, "ok").ok());
  BufferHandle garbage = h;
  garbage.ipc_handle = std::string(64, '\x5a');
  EXPECT_EQ(gpu_->ResolveBuffer(garbage, 4, "w").status().code(),
            absl::StatusCode::kInvalidArgument);
  BufferHandle other_gpu = h;
  other_gpu.device = 1;
  EXPECT_EQ(gpu_->ResolveBuffer(other_gpu, 4, "w").status().code(),
            absl::StatusCode::kInvalidArgument);
  BufferHandle short_handle = h;
  short_handle.ipc_handle = "abc";
  EXPECT_EQ(gpu_->ResolveBuffer(short_handle, 4, "w").status().code(),
            absl::StatusCode::kInvalidArgument);
  BufferHandle past = h;
  past.offset = 1 << 20;
  EXPECT_EQ(gpu_->ResolveBuffer(past, 4, "w").status().code(),
            absl::StatusCode::kInvalidArgument);
  BufferHandle shm = h;
  shm.kind = BufferHandle::Kind::kSharedMemory;
  EXPECT_EQ(gpu_->ResolveBuffer(shm, 4, "w").status().code(),
            absl::StatusCode::kInvalidArgument);
  std::string done;
  EXPECT_EQ(
      gpu_->OpenSession(0, std::string(64, '\x11'), &done).status().code(),
      absl::StatusCode::kInvalidArgument);
  // Still healthy: a valid handle resolves, from the cache.
  EXPECT_TRUE(gpu_->ResolveBuffer(h, 4, "ok").ok());
}

// A chunk of cuMemCreate's memory on GPU 0, exportable as a POSIX
// descriptor (as torch's expandable segments are), through the driver's
// entry points (the test links the runtime only).
class VmmChunk0 {
 public:
  explicit VmmChunk0(uint64_t size) : size_(size) {
    Find("cuMemCreate", &create_);
    Find("cuMemRelease", &release_);
    Find("cuMemExportToShareableHandle", &export_);
    CUmemAllocationProp prop = {};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = 0;
    ok_ = create_ != nullptr && create_(&handle_, size, &prop, 0) == 0;
  }
  ~VmmChunk0() {
    if (ok_) release_(handle_);
  }
  bool ok() const { return ok_; }
  // A new descriptor of the chunk, the caller's.
  UniqueFd Export() const {
    int fd = -1;
    if (export_(&fd, handle_, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0) !=
        0) {
      return UniqueFd();
    }
    return UniqueFd(fd);
  }

 private:
  template <class Fn>
  static void Find(const char* name, Fn* fn) {
    cudaDriverEntryPointQueryResult found;
    if (cudaGetDriverEntryPointByVersion(name, reinterpret_cast<void**>(fn),
                                         12000, cudaEnableDefault,
                                         &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      *fn = nullptr;
    }
  }
  const uint64_t size_;
  CUresult (*create_)(CUmemGenericAllocationHandle*, size_t,
                      const CUmemAllocationProp*,
                      unsigned long long) =  // NOLINT
      nullptr;
  CUresult (*release_)(CUmemGenericAllocationHandle) = nullptr;
  CUresult (*export_)(void*, CUmemGenericAllocationHandle,
                      CUmemAllocationHandleType,
                      unsigned long long) =  // NOLINT
      nullptr;
  CUmemGenericAllocationHandle handle_ = 0;
  bool ok_ = false;
};

// cuda_vmm buffers: a chunk passed as a descriptor maps, twice over one
// region, and the memory is the device's; every bad handle gets a specific
// status and leaves the backend healthy.
TEST_F(CudaBackendTest, VmmBuffersMapTheirChunksAndRefuseBadOnes) {
  FdStore store(16, 16);
  CudaBackendOptions options{4096, 4};
  options.fd_store = &store;
  auto made = CreateCudaBackend(0, options);
  ASSERT_TRUE(made.ok()) << made.status();
  Backend& gpu = **made;
  const uint64_t kChunk = 2 << 20;
  VmmChunk0 a(kChunk), b(kChunk);
  ASSERT_TRUE(a.ok() && b.ok());
  std::vector<UniqueFd> fds;
  fds.push_back(a.Export());
  fds.push_back(b.Export());
  fds.push_back(UniqueFd(memfd_create("not-cuda", 0)));
  for (const UniqueFd& fd : fds) ASSERT_TRUE(fd.valid());
  const std::string ida(16, 'a'), idb(16, 'b'), idm(16, 'm');
  ASSERT_TRUE(store.Put(1, {ida, idb, idm}, std::move(fds)).ok());
  BufferHandle h;
  h.kind = BufferHandle::Kind::kCudaVmm;
  h.device = 0;
  h.vmm_chunks = {{ida, kChunk}, {idb, kChunk}};
  h.offset = kChunk - 4096;  // across the two chunks
  h.size = 8192;
  auto ref = gpu.ResolveBuffer(h, 4, "t");
  ASSERT_TRUE(ref.ok()) << ref.status();
  ASSERT_EQ(cudaMemset(ref->data, 0x5a, h.size), cudaSuccess);
  std::vector<uint8_t> back(h.size);
  ASSERT_EQ(cudaMemcpy(back.data(), ref->data, h.size, cudaMemcpyDeviceToHost),
            cudaSuccess);
  EXPECT_EQ(std::count(back.begin(), back.end(), 0x5a),
            static_cast<long>(h.size));
  const auto refused = [&](BufferHandle bad, absl::StatusCode code,
                           const char* says) {
    auto r = gpu.ResolveBuffer(bad, 4, "w");
    EXPECT_EQ(r.status().code(), code) << says << ": " << r.status();
    EXPECT_NE(r.status().message().find(says), std::string::npos) << r.status();
  };
  BufferHandle bad = h;
  bad.vmm_chunks = {{std::string(16, 'z'), kChunk}};
  bad.offset = 0;
  refused(bad, absl::StatusCode::kNotFound, "no descriptor");
  bad.vmm_chunks = {{idm, kChunk}};
  refused(bad, absl::StatusCode::kInvalidArgument, "not CUDA memory");
  bad.vmm_chunks = {{ida, kChunk * 2}};
  refused(bad, absl::StatusCode::kInvalidArgument, "cuMemMap");
  bad.vmm_chunks = {};
  refused(bad, absl::StatusCode::kInvalidArgument, "chunks");
  bad.vmm_chunks = {{"short", kChunk}};
  refused(bad, absl::StatusCode::kInvalidArgument, "fd_id");
  bad.vmm_chunks = {{ida, kChunk - 4096}};
  refused(bad, absl::StatusCode::kInvalidArgument, "multiple of 2 MiB");
  bad.vmm_chunks = {{ida, kChunk}, {ida, kChunk}};
  refused(bad, absl::StatusCode::kInvalidArgument, "twice");
  bad = h;
  bad.offset = 2 * kChunk;
  refused(bad, absl::StatusCode::kInvalidArgument, "past the end");
  bad = h;
  bad.device = 1;
  refused(bad, absl::StatusCode::kInvalidArgument, "GPU 1");
  // A daemon without descriptors (on TCP) refuses every cuda_vmm buffer.
  auto plain = CreateCudaBackend(0, CudaBackendOptions{4096, 4});
  ASSERT_TRUE(plain.ok());
  auto none = (*plain)->ResolveBuffer(h, 4, "w");
  EXPECT_EQ(none.status().code(), absl::StatusCode::kFailedPrecondition);
  // Still healthy: the region resolves again, from the cache.
  EXPECT_TRUE(gpu.ResolveBuffer(h, 4, "ok").ok());
  // Once the connection that brought the descriptors is gone, their ids
  // are refused, though the region mapped before lives on in `ref`.
  store.DropOwner(1);
  refused(h, absl::StatusCode::kNotFound, "no descriptor");
}

// A buffer of another GPU's memory, with the request naming that GPU, is
// refused without being opened; the backend stays healthy. (Named as this
// GPU's, it cannot be told apart: the CUDA runtime and driver report the
// importing GPU for an IPC mapping, so it would be used through peer
// access, correctly but over the interconnect.) Needs two GPUs.
TEST_F(CudaBackendTest, BufferOfAnotherGpuIsInvalidArgument) {
  int gpus = 0;
  ASSERT_EQ(cudaGetDeviceCount(&gpus), cudaSuccess);
  if (gpus < 2) GTEST_SKIP() << "needs two GPUs, this machine has " << gpus;
  auto alloc = g_trainer1->Alloc(4096);
  ASSERT_TRUE(alloc.ok()) << alloc.status();
  BufferHandle h;
  h.kind = BufferHandle::Kind::kCudaIpc;
  h.ipc_handle = alloc->ipc_handle;
  h.device = 1;
  h.size = 1024;
  auto r = gpu_->ResolveBuffer(h, 4, "w");
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument)
      << r.status();
  EXPECT_NE(r.status().message().find("on GPU 1"), std::string::npos)
      << r.status();
  // This GPU's buffers still resolve.
  auto mine = *g_trainer->Alloc(4096);
  h.ipc_handle = mine.ipc_handle;
  h.device = 0;
  EXPECT_TRUE(gpu_->ResolveBuffer(h, 4, "ok").ok());
}

// Asynchronous replies report the last completed step, with that step's
// own norm: the gradients stay the same while grad_scale alternates, so the
// reported norm must be the true norm over the reported step's scale.
// Staged steps (the updates stage by stage, progress in the third step-flag
// word) give the plain step's bits, whatever the stages of the tensors of
// two groups' layouts, and leave the progress word past every stage; a
// staged step without a progress word is refused and still released.
TEST_F(CudaBackendTest, StagedStepsMatchTheCpuReferenceAndWriteProgress) {
  std::vector<TensorPlan> ts =
      RandomTensors(DType::kBFloat16, DType::kBFloat16, 9);
  TensorPlan norm{"norm",  5000, DType::kFloat32, DType::kFloat32, 1 << 20,
                  1 << 20, true};
  ts.push_back(norm);
  for (size_t i = 0; i < ts.size(); ++i) {
    ts[i].stage = static_cast<uint32_t>((7 * i) % 5);  // interleaved
  }
  ts.back().stage = kMaxStage;
  GroupSpec spec;
  spec.id = "g";
  spec.hyper.lr = 1e-2;
  spec.master = MasterRequest::kFp32;
  Twin twin(cpu_.get(), gpu_.get(), ts, spec, &rng_);
  ASSERT_TRUE(twin.status().ok()) << twin.status();
  auto flags = g_trainer->Alloc(64);
  ASSERT_TRUE(flags.ok());
  auto handle = [&](uint64_t size) {
    BufferHandle h;
    h.kind = BufferHandle::Kind::kCudaIpc;
    h.ipc_handle = flags->ipc_handle;
    h.device = 0;
    h.size = size;
    return h;
  };
  auto* words = reinterpret_cast<uint32_t*>(g_trainer->staging());
  for (uint32_t seq = 1; seq <= 4; ++seq) {
    twin.FillGrads(/*poison=*/seq == 3);
    words[0] = seq;  // ready, as the trainer's stream writes it
    words[2] = 0;    // progress reset
    ASSERT_TRUE(g_trainer->Upload(flags->id, 0, 4, 0).ok());
    ASSERT_TRUE(g_trainer->Upload(flags->id, 8, 4, 8).ok());
    StepRequestSpec plain, staged;
    plain.options.max_grad_norm = seq == 2 ? 1e6 : 0;
    staged.options = plain.options;
    staged.options.staged = true;
    if (seq == 1) staged.step_flags = handle(12);
    staged.sequence = seq;
    twin.Step(plain, staged, /*exact=*/true);
    ASSERT_TRUE(g_trainer->Download(flags->id, 0, 12, 0).ok());
    EXPECT_EQ(words[1], seq);
    EXPECT_EQ(words[2], 0x7FFFFFFFu) << "progress of step " << seq;
  }
  // Two-word flags cannot carry progress: refused, and released.
  words[0] = 1;
  ASSERT_TRUE(g_trainer->Upload(flags->id, 0, 4, 0).ok());
  StepRequestSpec bad;
  bad.options.staged = true;
  bad.step_flags = handle(8);
  bad.sequence = 1;
  auto refused = twin.gpu_session().Step(bad);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("12-byte"), std::string::npos);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // the daemon's stream
  ASSERT_TRUE(g_trainer->Download(flags->id, 0, 8, 0).ok());
  EXPECT_EQ(words[1], 1u);
}

// 32-byte step flags carry the step's start and end on the global timer,
// in order and step after step; flags of another size are refused, and
// the step stays untaken.
TEST_F(CudaBackendTest, StepFlagsOf32BytesCarryTheStepsTimerStamps) {
  GroupSpec spec;
  spec.id = "g";
  Twin twin(cpu_.get(), gpu_.get(),
            RandomTensors(DType::kFloat32, DType::kFloat32, 4), spec, &rng_);
  ASSERT_TRUE(twin.status().ok());
  auto flags = g_trainer->Alloc(64);
  ASSERT_TRUE(flags.ok());
  BufferHandle handle;
  handle.kind = BufferHandle::Kind::kCudaIpc;
  handle.ipc_handle = flags->ipc_handle;
  handle.device = 0;
  handle.size = 16;
  StepRequestSpec odd;
  odd.step_flags = handle;
  odd.sequence = 1;
  auto refused = twin.gpu_session().Step(odd);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("32"), std::string::npos);
  EXPECT_EQ(twin.gpu_session().Info().steps, 0u);
  handle.size = 32;
  auto* words = reinterpret_cast<uint32_t*>(g_trainer->staging());
  uint64_t last_end = 0;
  for (uint32_t seq = 1; seq <= 3; ++seq) {
    twin.FillGrads(false);
    words[0] = seq;  // ready, as the trainer's stream writes it
    ASSERT_TRUE(g_trainer->Upload(flags->id, 0, 4, 0).ok());
    StepRequestSpec step;
    if (seq == 1) step.step_flags = handle;
    step.sequence = seq;
    step.options.wait = true;
    ASSERT_TRUE(twin.gpu_session().Step(step).ok());
    ASSERT_TRUE(g_trainer->Download(flags->id, 0, 32, 0).ok());
    uint64_t stamps[2];
    std::memcpy(stamps, words + 4, sizeof(stamps));
    EXPECT_EQ(words[1], seq);
    EXPECT_GT(stamps[0], last_end) << "step " << seq;
    EXPECT_GE(stamps[1], stamps[0]) << "step " << seq;
    last_end = stamps[1];
  }
}

TEST_F(CudaBackendTest, AsynchronousStepsReportTheLastCompletedStep) {
  GroupSpec spec;
  spec.id = "g";
  Twin twin(cpu_.get(), gpu_.get(),
            RandomTensors(DType::kFloat32, DType::kFloat32, 4), spec, &rng_);
  ASSERT_TRUE(twin.status().ok());
  twin.FillGrads(false);
  twin.Step(StepRequestSpec(), true);
  auto first = twin.cpu_session().Step(StepRequestSpec());
  ASSERT_TRUE(first.ok());
  const double norm = first->outcome.grad_norm;  // the same gradients
  ASSERT_GT(norm, 0);
  // scale_of[k]: the grad_scale of the GPU session's k-th applied step.
  std::vector<double> scale_of = {0, 1};
  int earlier = 0;
  for (int i = 0; i < 200; ++i) {
    StepRequestSpec r;
    r.options.grad_scale = i % 2 ? 8.0 : 2.0;
    r.options.wait = i % 50 == 49;
    scale_of.push_back(r.options.grad_scale);
    auto g = twin.gpu_session().Step(r);
    ASSERT_TRUE(g.ok()) << g.status();
    if (!g->outcome.known) continue;
    const uint64_t k = g->outcome.steps_applied;
    ASSERT_LT(k, scale_of.size());
    if (r.options.wait) {
      ASSERT_EQ(k, scale_of.size() - 1);
    }
    if (k < scale_of.size() - 1) ++earlier;
    EXPECT_NEAR(g->outcome.grad_norm, norm / scale_of[k], 1e-12 * norm)
        << "reply to step " << scale_of.size() - 1 << " reports step " << k;
  }
  std::printf("%d of 200 replies reported an earlier step\n", earlier);
}

// SGD (with and without momentum, dampening, Nesterov, weight decay,
// maximize) and Lion on every layout, the float64 one included (four times,
// so that SGD's four momentum variants meet it), equal the CPU reference
// bit for bit, through a loss scale, a skipped step, and a tensor whose
// gradient is absent for two steps and then back (it keeps its own step
// count: SGD's momentum buffer starts at that tensor's first step).
TEST_F(CudaBackendTest, SgdAndLionMatchTheCpuReferenceBitForBit) {
  std::vector<LayoutCase> layouts = EveryLayout();
  for (int i = 0; i < 4; ++i) {
    layouts.push_back({DType::kFloat64, MasterRequest::kDefault,
                       DType::kFloat64, DType::kFloat64});
  }
  int combo = 0;
  for (OptimizerKind kind : {OptimizerKind::kSgd, OptimizerKind::kLion}) {
    for (const LayoutCase& c : layouts) {
      ++combo;
      GroupSpec spec;
      spec.id = "g";
      spec.master = c.master;
      spec.moment_dtype = c.moment;
      spec.hyper.kind = kind;
      spec.hyper.lr = kind == OptimizerKind::kSgd ? 1e-2 : 1e-3;
      spec.hyper.maximize = combo % 3 == 0;
      spec.hyper.weight_decay = combo % 2 ? 0.01 : 0.0;
      spec.hyper.beta2 = 0.99;
      if (kind == OptimizerKind::kSgd && combo % 4 != 0) {
        spec.hyper.momentum = 0.9;
        spec.hyper.dampening = combo % 4 == 2 ? 0.1 : 0.0;
        spec.hyper.nesterov = combo % 4 == 3;
      }
      SCOPED_TRACE(::testing::Message()
                   << OptimizerName(kind) << " param " << DTypeName(c.param)
                   << " master " << int(c.master) << " grad "
                   << DTypeName(c.grad) << " moments " << DTypeName(c.moment)
                   << " momentum " << spec.hyper.momentum << " nesterov "
                   << spec.hyper.nesterov);
      std::vector<TensorPlan> ts = RandomTensors(c.param, c.grad, 6);
      std::string toggled;  // the tensor whose gradient goes and comes
      for (const TensorPlan& t : ts) {
        if (t.numel > 0 && toggled.empty()) toggled = t.name;
      }
      Twin twin(cpu_.get(), gpu_.get(), ts, spec, &rng_);
      ASSERT_TRUE(twin.status().ok()) << twin.status();
      for (int step = 1; step <= 6; ++step) {
        if (!toggled.empty() && (step == 2 || step == 4)) {
          const absl::Status s = twin.SetGradAbsent(toggled, step == 2);
          ASSERT_TRUE(s.ok()) << s;
        }
        twin.FillGrads(/*poison=*/step == 5);
        StepRequestSpec s;
        s.options.grad_scale = step == 3 ? 128.0 : 1.0;
        twin.Step(s, /*exact=*/true);
      }
    }
  }
}

// SGD (momentum, Nesterov) and Lion over float64 tensors beside a float32
// one in one group (state slots by default: float64 for float64
// parameters), through gradients moved to buffers of another alignment, a
// loss scale and a skipped step: bit for bit; with clipping and overrides
// of the learning rate, momentum and betas, to 1e-12 (the norm's
// summation order).
TEST_F(CudaBackendTest, SgdAndLionFloat64TensorsMatchTheCpuReference) {
  for (OptimizerKind kind : {OptimizerKind::kSgd, OptimizerKind::kLion}) {
    SCOPED_TRACE(OptimizerName(kind));
    std::vector<TensorPlan> ts =
        RandomTensors(DType::kFloat64, DType::kFloat64, 6);
    uint64_t end = 0;
    for (const TensorPlan& t : ts) {
      end =
          std::max({end, t.param_off + t.numel * 8, t.grad_off + t.numel * 8});
    }
    end = (end + 63) / 64 * 64;
    ts.push_back({"f32", 4099, DType::kFloat32, DType::kFloat32, end, end});
    GroupSpec spec;
    spec.id = "g";
    spec.hyper.kind = kind;
    spec.hyper.lr = kind == OptimizerKind::kSgd ? 1e-2 : 1e-3;
    spec.hyper.weight_decay = 0.01;
    spec.hyper.beta2 = 0.99;
    if (kind == OptimizerKind::kSgd) {
      spec.hyper.momentum = 0.9;
      spec.hyper.nesterov = true;
    }
    spec.moment_dtype_default = true;
    Twin twin(cpu_.get(), gpu_.get(), ts, spec, &rng_);
    ASSERT_TRUE(twin.status().ok()) << twin.status();
    for (int step = 1; step <= 6; ++step) {
      SCOPED_TRACE(step);
      if (step == 4) {
        ASSERT_TRUE(twin.MoveGrads(8).ok());
      }
      twin.FillGrads(/*poison=*/step == 3);
      StepRequestSpec s;
      s.options.grad_scale = step == 5 ? 64.0 : 1.0;
      twin.Step(s, /*exact=*/true);
    }
    EXPECT_EQ(twin.skipped_steps(), 1);
    for (int step = 0; step < 4; ++step) {
      twin.FillGrads(false);
      StepRequestSpec s;
      s.options.max_grad_norm = step % 2 ? 1.0 : 1e6;
      HyperOverride o;
      o.group_id = "g";
      o.lr = spec.hyper.lr * (step + 1);
      if (kind == OptimizerKind::kSgd) {
        o.momentum = 0.8 + 0.05 * step;
      } else {
        o.beta1 = 0.85 + 0.02 * step;
      }
      s.overrides = {o};
      twin.Step(s, /*exact=*/false);
    }
  }
}

// The sessions of a CUDA job join one NCCL communicator: rank 0's daemon
// makes its unique id; other ranks must bring it (128 bytes); only such
// sessions take one. (Steps across ranks: tests/python/test_cuda_ranks.py,
// on two GPUs.)
TEST_F(CudaBackendTest, JobSessionsTakeTheJobsNcclUniqueId) {
  StateBudget budget(0);
  SessionRegistry registry({gpu_.get()}, &budget);
  SessionIdentity rank0{"job", 0, 2, 0};
  rank0.sharding = GradientSharding::kSharded;
  auto first = registry.Create(rank0, false);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->session->nccl_unique_id().size(), 128u);
  SessionIdentity rank1 = rank0;
  rank1.rank = 1;
  EXPECT_EQ(registry.Create(rank1, false).status().code(),
            absl::StatusCode::kInvalidArgument);  // no id
  EXPECT_EQ(registry.Create(rank1, false, "", 0, "", std::string(12, 'x'))
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);  // not an id
  SessionIdentity alone{"alone", 0, 1, 0};
  EXPECT_EQ(registry.Create(alone, false, "", 0, "", std::string(128, 'x'))
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);  // no job to join
  auto plain = registry.Create(alone, false);
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_TRUE(plain->session->nccl_unique_id().empty());
}

// A tensor of more than 2^31 elements: 64-bit indexing end to end. The
// inputs are zero except for windows around 2^31 and at the end, which are
// random; those windows are checked against the reference computed on the
// host for the same elements.
TEST_F(CudaBackendTest, TensorOver2To31Elements) {
  const uint64_t n = (uint64_t{1} << 31) + 300;
  auto params = g_trainer->Alloc(n * 2);
  ASSERT_TRUE(params.ok()) << params.status();
  auto grads = g_trainer->Alloc(n * 2);
  ASSERT_TRUE(grads.ok()) << grads.status();
  const uint64_t windows[] = {0, (uint64_t{1} << 31) - 64, n - 128};
  const uint64_t w = 128;
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<uint16_t> p0(3 * w), g0(3 * w);
  for (int k = 0; k < 3; ++k) {
    for (uint64_t i = 0; i < w; ++i) {
      p0[k * w + i] = FloatToBFloat16(normal(rng_));
      g0[k * w + i] = FloatToBFloat16(normal(rng_));
    }
    std::memcpy(g_trainer->staging(), &p0[k * w], w * 2);
    absl::Status up = g_trainer->Upload(params->id, windows[k] * 2, w * 2, 0);
    ASSERT_TRUE(up.ok()) << up;
    std::memcpy(g_trainer->staging(), &g0[k * w], w * 2);
    up = g_trainer->Upload(grads->id, windows[k] * 2, w * 2, 0);
    ASSERT_TRUE(up.ok()) << up;
  }
  StateBudget budget(0);
  Session s(SessionIdentity{"big", 0, 1, 0}, gpu_.get(), &budget,
            Context(gpu_.get(), 0));
  GroupSpec spec;
  spec.id = "big";
  spec.master = MasterRequest::kRemainder;
  spec.moment_dtype = DType::kBFloat16;
  TensorSpec t;
  t.name = "huge";
  t.numel = n;
  t.param_dtype = t.grad_dtype = DType::kBFloat16;
  t.param_dtype_set = t.grad_dtype_set = true;
  t.param.kind = t.grad.kind = BufferHandle::Kind::kCudaIpc;
  t.param.device = t.grad.device = 0;
  t.param.ipc_handle = params->ipc_handle;
  t.grad.ipc_handle = grads->ipc_handle;
  t.param.size = t.grad.size = n * 2;
  spec.tensors = {t};
  auto reg = s.RegisterGroup(spec);
  ASSERT_TRUE(reg.ok()) << reg.status();
  StepRequestSpec step;
  step.options.wait = true;
  for (int i = 0; i < 2; ++i) ASSERT_TRUE(s.Step(step).ok());
  // Reference for the windows.
  Layout l{DType::kBFloat16, DType::kBFloat16, DType::kBFloat16,
           MasterKind::kRemainder};
  std::vector<int16_t> rem(3 * w, 0);
  std::vector<uint16_t> m(3 * w, 0), v(3 * w, 0);
  for (int i = 1; i <= 2; ++i) {
    TensorPointers tp{p0.data(), g0.data(), rem.data(),
                      m.data(),  v.data(),  nullptr};
    AdamWStepRange(l, tp, 0, 3 * w, MakeAdamWScalars(spec.hyper, i, 1, 1));
  }
  for (int k = 0; k < 3; ++k) {
    ASSERT_TRUE(g_trainer->Download(params->id, windows[k] * 2, w * 2, 0).ok());
    EXPECT_EQ(std::memcmp(g_trainer->staging(), &p0[k * w], w * 2), 0)
        << "window at element " << windows[k];
  }
}

// Holds a stream until released: a host function queued on it waits for
// the gate, as a step waits for its trainer's ready flag.
struct StreamGate {
  std::atomic<bool> open{false};
  static void CUDART_CB Wait(void* arg) {
    auto* gate = static_cast<StreamGate*>(arg);
    while (!gate->open.load()) std::this_thread::sleep_for(kPoll);
  }
  static constexpr std::chrono::milliseconds kPoll{1};
};

// A mapping let go of while the device's stream is busy (another
// session's step waiting for its trainer) costs the thread that lets go
// nothing: it is closed once the stream has passed the work queued before.
// The allocation opened again meanwhile maps anew and stays usable after.
TEST(MappingReaperTest, LettingGoOfAMappingWaitsForNothing) {
  MemGetAddressRangeFn range = nullptr;
  cudaDriverEntryPointQueryResult found;
  ASSERT_EQ(cudaGetDriverEntryPointByVersion("cuMemGetAddressRange",
                                             reinterpret_cast<void**>(&range),
                                             12000, cudaEnableDefault, &found),
            cudaSuccess);
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking),
            cudaSuccess);
  auto reaper = std::make_shared<MappingReaper>(0, stream);
  IpcMappingCache cache(0, reaper, range);
  auto alloc = *g_trainer->Alloc(1 << 20);
  BufferHandle h;
  h.kind = BufferHandle::Kind::kCudaIpc;
  h.ipc_handle = alloc.ipc_handle;
  h.device = 0;
  h.size = 1 << 20;
  auto first = cache.Resolve(h, 4, "t");
  ASSERT_TRUE(first.ok()) << first.status();
  // An idle stream: the mapping is closed at once, by the caller.
  first->mapping.reset();
  EXPECT_EQ(reaper->ended(), 1u);

  auto held = cache.Resolve(h, 4, "t");
  ASSERT_TRUE(held.ok()) << held.status();
  StreamGate gate;
  ASSERT_EQ(cudaLaunchHostFunc(stream, StreamGate::Wait, &gate), cudaSuccess);
  // Opens the gate after 3 s, should letting go wait for the stream.
  std::thread opener([&gate] {
    std::this_thread::sleep_for(std::chrono::seconds(3));
    gate.open = true;
  });
  const auto start = std::chrono::steady_clock::now();
  held->mapping.reset();
  const double waited =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
          .count();
  EXPECT_LT(waited, 1.0) << "letting go of a mapping waited for the stream";
  EXPECT_EQ(reaper->ended(), 1u) << "closed under the stream's work";
  EXPECT_EQ(reaper->pending(), 1);
  // Opened again before the old mapping is closed: the driver counts the
  // opens, and the new mapping outlives the old one's close.
  auto again = cache.Resolve(h, 4, "t");
  ASSERT_TRUE(again.ok()) << again.status();
  opener.join();
  for (int i = 0; i < 5000 && reaper->ended() < 2; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  EXPECT_EQ(reaper->ended(), 2u) << "never closed after the stream passed";
  EXPECT_EQ(reaper->pending(), 0);
  ASSERT_EQ(cudaMemsetAsync(again->data, 0x3c, 1 << 20, stream), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  uint8_t byte = 0;
  ASSERT_EQ(cudaMemcpy(&byte, again->data + 12345, 1, cudaMemcpyDeviceToHost),
            cudaSuccess);
  EXPECT_EQ(byte, 0x3c);
  again->mapping.reset();
  reaper.reset();
  ASSERT_EQ(cudaStreamDestroy(stream), cudaSuccess);
}

}  // namespace
}  // namespace optimd

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  optimd::g_seed = std::random_device{}();
  std::printf("seed %u\n", optimd::g_seed);
  // Fork the trainers before this process touches CUDA (a process forked
  // after that cannot use CUDA).
  auto trainer = optimd::IpcTrainer::Start(0, 64 << 20);
  auto trainer1 = optimd::IpcTrainer::Start(1, 1 << 20);
  for (const auto* t : {&trainer, &trainer1}) {
    if (!t->ok()) {
      std::fprintf(stderr, "%s\n", t->status().ToString().c_str());
      return 1;
    }
  }
  optimd::g_trainer = trainer->get();
  optimd::g_trainer1 = trainer1->get();
  const int rc = RUN_ALL_TESTS();
  trainer->reset();
  trainer1->reset();
  return rc;
}
