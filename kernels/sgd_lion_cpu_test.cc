// SGD and Lion on the CPU: hand-computed steps, the dispatch through
// step_cpu (first step, nesterov, maximize, missed steps), and the layouts
// (a bf16 parameter with remainder equals an fp32 master bit for bit).
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/step_cpu.h"

namespace optimd {
namespace {

OptimizerHyper Sgd(double lr, double momentum, double dampening = 0,
                   double wd = 0, bool nesterov = false) {
  OptimizerHyper h;
  h.kind = OptimizerKind::kSgd;
  h.lr = lr;
  h.momentum = momentum;
  h.dampening = dampening;
  h.weight_decay = wd;
  h.nesterov = nesterov;
  return h;
}

OptimizerHyper Lion(double lr, double wd) {
  OptimizerHyper h;
  h.kind = OptimizerKind::kLion;
  h.lr = lr;
  h.beta1 = 0.9;
  h.beta2 = 0.99;
  h.weight_decay = wd;
  return h;
}

Layout LayoutOf(const OptimizerHyper& h, DType param = DType::kFloat32,
                MasterKind master = MasterKind::kNone,
                DType moment = DType::kFloat32) {
  Layout l;
  l.param_dtype = param;
  l.grad_dtype = DType::kFloat32;
  l.moment_dtype = moment;
  l.master = master;
  l.optimizer = h.kind;
  l.state_slots = static_cast<uint8_t>(StateSlotCount(h));
  return l;
}

// An fp32 tensor updated in place, with one state slot.
struct Fp32Tensor {
  std::vector<float> p, g, buf;
  TensorPointers Ptrs() {
    TensorPointers t;
    t.param = p.data();
    t.grad = g.data();
    t.state[0] = buf.data();
    return t;
  }
};

void Step(const OptimizerHyper& h, const Layout& l, const TensorPointers& t,
          uint64_t n, uint64_t step, double scale = 1, double clip = 1) {
  OptimizerStepRange(l, t, 0, n, MakeOptimizerScalars(h, step, scale, clip));
}

// torch.optim.SGD(lr=0.1, momentum=0.9, weight_decay=0.01) on p=1, g=0.5:
// d = 0.5 + 0.01 = 0.51; step 1: b = 0.51, p = 1 - 0.051 = 0.949;
// step 2: d = 0.5 + 0.00949 = 0.50949, b = 0.459 + 0.50949 = 0.96849,
// p = 0.949 - 0.096849 = 0.852151.
TEST(SgdCpuTest, HandComputedMomentum) {
  const OptimizerHyper h = Sgd(0.1, 0.9, 0, 0.01);
  Fp32Tensor t{{1.0f}, {0.5f}, {123.0f}};  // the first step ignores buf
  Step(h, LayoutOf(h), t.Ptrs(), 1, 1);
  EXPECT_NEAR(t.p[0], 0.949, 1e-6);
  EXPECT_NEAR(t.buf[0], 0.51, 1e-6);
  Step(h, LayoutOf(h), t.Ptrs(), 1, 2);
  EXPECT_NEAR(t.buf[0], 0.96849, 1e-6);
  EXPECT_NEAR(t.p[0], 0.852151, 1e-6);
}

// Dampening 0.5 from the second step: b = 0.9*0.5 + 0.5*0.5 = 0.7.
// Nesterov (dampening 0): d = g + 0.9*b; step 1 b = 0.5, d = 0.95.
TEST(SgdCpuTest, DampeningAndNesterov) {
  const OptimizerHyper damp = Sgd(1.0, 0.9, 0.5);
  Fp32Tensor a{{0.0f}, {0.5f}, {0.0f}};
  Step(damp, LayoutOf(damp), a.Ptrs(), 1, 1);
  EXPECT_FLOAT_EQ(a.buf[0], 0.5f);
  Step(damp, LayoutOf(damp), a.Ptrs(), 1, 2);
  EXPECT_FLOAT_EQ(a.buf[0], 0.7f);
  EXPECT_FLOAT_EQ(a.p[0], -1.2f);
  const OptimizerHyper nest = Sgd(1.0, 0.9, 0, 0, true);
  Fp32Tensor b{{0.0f}, {0.5f}, {0.0f}};
  Step(nest, LayoutOf(nest), b.Ptrs(), 1, 1);
  EXPECT_FLOAT_EQ(b.p[0], -0.95f);
}

// Without momentum there is no state slot and the step is p -= lr*g;
// maximize, loss scale and clip coefficient fold into the gradient.
TEST(SgdCpuTest, PlainMaximizeScaleAndClip) {
  OptimizerHyper h = Sgd(0.5, 0);
  EXPECT_EQ(StateSlotCount(h), 0);
  Fp32Tensor t{{1.0f}, {4.0f}, {}};
  TensorPointers ptrs = t.Ptrs();
  ptrs.state[0] = nullptr;
  Step(h, LayoutOf(h), ptrs, 1, 1, /*scale=*/2, /*clip=*/0.5);
  EXPECT_FLOAT_EQ(t.p[0], 0.5f);  // 1 - 0.5 * (4 / 2 * 0.5)
  h.maximize = true;
  Step(h, LayoutOf(h), ptrs, 1, 2, 2, 0.5);
  EXPECT_FLOAT_EQ(t.p[0], 1.0f);
}

// Lion: c = 0.9*m + 0.1*g, p = p*(1 - lr*wd) - lr*sign(c),
// m = 0.99*m + 0.01*g; sign(0) = 0.
TEST(LionCpuTest, HandComputed) {
  const OptimizerHyper h = Lion(0.1, 0.5);
  Fp32Tensor t{{1.0f, 1.0f, 1.0f}, {0.5f, -2.0f, 0.0f}, {0.0f, 1.0f, 0.0f}};
  Step(h, LayoutOf(h), t.Ptrs(), 3, 1);
  EXPECT_FLOAT_EQ(t.p[0], 0.95f - 0.1f);  // c = 0.05 > 0
  EXPECT_FLOAT_EQ(t.p[1], 0.95f - 0.1f);  // c = 0.9 - 0.2 = 0.7 > 0
  EXPECT_FLOAT_EQ(t.p[2], 0.95f);         // c = 0: no move but the decay
  EXPECT_FLOAT_EQ(t.buf[0], 0.005f);
  EXPECT_FLOAT_EQ(t.buf[1], 0.99f - 0.02f);
  EXPECT_FLOAT_EQ(t.buf[2], 0.0f);
}

// Random data, several steps: the bf16 parameter with remainder follows the
// fp32 master exactly (same master bits, parameter = master rounded), for
// both optimizers and bf16 moments.
TEST(OptimizerCpuTest, RemainderEqualsFp32MasterBitForBit) {
  constexpr int kN = 1031;
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (const OptimizerHyper& h :
       {Sgd(0.01, 0.9, 0.1, 0.01), Sgd(0.01, 0.9, 0, 0.01, true),
        Lion(0.003, 0.1)}) {
    std::vector<uint16_t> pa(kN), pb(kN), ma(kN, 0), mb(kN, 0);
    std::vector<float> master(kN), grad(kN);
    std::vector<int16_t> rem(kN, 0);
    for (int i = 0; i < kN; ++i) {
      pa[i] = pb[i] = FloatToBFloat16(normal(rng));
      master[i] = BFloat16ToFloat(pa[i]);
    }
    const Layout la =
        LayoutOf(h, DType::kBFloat16, MasterKind::kFp32, DType::kBFloat16);
    Layout lb = la;
    lb.master = MasterKind::kRemainder;
    for (int step = 1; step <= 5; ++step) {
      for (float& g : grad) g = normal(rng);
      TensorPointers a{pa.data(), grad.data(), master.data(), {ma.data()}};
      TensorPointers b{pb.data(), grad.data(), rem.data(), {mb.data()}};
      Step(h, la, a, kN, step);
      Step(h, lb, b, kN, step);
    }
    for (int i = 0; i < kN; ++i) {
      uint16_t hi;
      int16_t r;
      SplitToRemainder(master[i], &hi, &r);
      ASSERT_EQ(pb[i], hi) << OptimizerName(h.kind) << " element " << i;
      ASSERT_EQ(rem[i], r) << OptimizerName(h.kind) << " element " << i;
      ASSERT_EQ(pa[i], FloatToBFloat16(master[i]));
      ASSERT_EQ(ma[i], mb[i]);
    }
  }
}

// Scalars made for one optimizer never step another's layout.
TEST(OptimizerCpuTest, MismatchedScalarsAbort) {
  const OptimizerHyper sgd = Sgd(0.1, 0.9);
  Fp32Tensor t{{1.0f}, {0.5f}, {0.0f}};
  EXPECT_DEATH(OptimizerStepRange(LayoutOf(Lion(0.1, 0)), t.Ptrs(), 0, 1,
                                  MakeOptimizerScalars(sgd, 1, 1, 1)),
               "step scalars of sgd");
}

}  // namespace
}  // namespace optimd
