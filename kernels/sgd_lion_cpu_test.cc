// SGD and Lion on the CPU: hand-computed steps, the dispatch through
// step_cpu (first step, nesterov, maximize, missed steps), the layouts
// (a bf16 parameter with remainder equals an fp32 master bit for bit), and
// the float64 layout (torch's float64 arithmetic bit for bit).
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

// The float64 layout: parameter, gradient and state slot float64, no
// master.
Layout Float64Layout(const OptimizerHyper& h) {
  Layout l = LayoutOf(h, DType::kFloat64, MasterKind::kNone, DType::kFloat64);
  l.grad_dtype = DType::kFloat64;
  return l;
}

// A float64 tensor updated in place, with its reference copy.
struct Float64Twin {
  std::vector<double> p, g, buf, ref_p, ref_buf;
  Float64Twin(int n, std::mt19937* rng)
      : p(n), g(n), buf(n), ref_p(n), ref_buf(n) {
    std::normal_distribution<double> normal;
    for (int i = 0; i < n; ++i) ref_p[i] = p[i] = normal(*rng);
  }
  TensorPointers Ptrs() {
    TensorPointers t;
    t.param = p.data();
    t.grad = g.data();
    t.state[0] = buf.data();
    return t;
  }
  // Elements whose low bits fp32 arithmetic would have lost.
  int Wide() const {
    int n = 0;
    for (double x : p) n += x != static_cast<double>(static_cast<float>(x));
    return n;
  }
};

// torch.optim.SGD's single-tensor step on float64 values, written out as
// torch 1.13 orders it (maximize negates the gradient first; alpha=a adds
// a times the operand), with its scalars in double.
void TorchSgdFloat64(const OptimizerHyper& h, bool first, double g, double& p,
                     double& buf) {
  double d = h.maximize ? -g : g;
  if (h.weight_decay != 0) d = d + h.weight_decay * p;
  if (h.momentum != 0) {
    buf = first ? d : buf * h.momentum + (1 - h.dampening) * d;
    d = h.nesterov ? d + h.momentum * buf : buf;
  }
  p = p + -h.lr * d;
}

// The float64 layout steps SGD in double with unrounded double scalars:
// bit for bit torch's float64 arithmetic (both without FMA contraction),
// for every option that changes the arithmetic, and not what fp32 would
// give.
TEST(SgdCpuTest, Float64LayoutStepsInDouble) {
  constexpr int kN = 515;
  std::mt19937 rng(13);
  std::normal_distribution<double> normal;
  for (const double momentum : {0.0, 0.9}) {
    for (const double dampening : {0.0, 0.3}) {
      for (const bool nesterov : {false, true}) {
        if (nesterov && (momentum == 0 || dampening != 0)) continue;
        for (const double wd : {0.0, 0.01}) {
          for (const bool maximize : {false, true}) {
            OptimizerHyper h = Sgd(0.0123, momentum, dampening, wd, nesterov);
            h.maximize = maximize;
            SCOPED_TRACE(testing::Message()
                         << "momentum=" << momentum << " dampening="
                         << dampening << " nesterov=" << nesterov
                         << " wd=" << wd << " maximize=" << maximize);
            const Layout l = Float64Layout(h);
            EXPECT_EQ(l.state_slots, momentum != 0 ? 1 : 0);
            Float64Twin t(kN, &rng);
            TensorPointers ptrs = t.Ptrs();
            if (momentum == 0) ptrs.state[0] = nullptr;
            for (int step = 1; step <= 30; ++step) {
              for (double& g : t.g) g = normal(rng);
              Step(h, l, ptrs, kN, step);
              for (int i = 0; i < kN; ++i) {
                TorchSgdFloat64(h, step == 1, t.g[i], t.ref_p[i], t.ref_buf[i]);
                ASSERT_EQ(t.p[i], t.ref_p[i])
                    << "step " << step << " element " << i;
                if (momentum != 0) {
                  ASSERT_EQ(t.buf[i], t.ref_buf[i]) << "element " << i;
                }
              }
            }
            EXPECT_GT(t.Wide(), kN / 2);
          }
        }
      }
    }
  }
}

// Lion on float64 values as its paper writes it (and the Python tests'
// reference does: decoupled decay, the sign of the interpolated momentum,
// then the momentum update), in double.
void LionFloat64(const OptimizerHyper& h, double g, double& p, double& m) {
  const double d = h.maximize ? -g : g;
  p = p * (1 - h.lr * h.weight_decay);
  const double c = m * h.beta1 + (1 - h.beta1) * d;
  const double sign = c > 0 ? 1.0 : c < 0 ? -1.0 : 0.0;
  p = p + -h.lr * sign;
  m = m * h.beta2 + (1 - h.beta2) * d;
}

TEST(LionCpuTest, Float64LayoutStepsInDouble) {
  constexpr int kN = 515;
  std::mt19937 rng(17);
  std::normal_distribution<double> normal;
  for (const double wd : {0.0, 0.1}) {
    for (const bool maximize : {false, true}) {
      OptimizerHyper h = Lion(0.00314, wd);
      h.maximize = maximize;
      SCOPED_TRACE(testing::Message()
                   << "wd=" << wd << " maximize=" << maximize);
      Float64Twin t(kN, &rng);
      for (int step = 1; step <= 30; ++step) {
        for (double& g : t.g) g = normal(rng);
        Step(h, Float64Layout(h), t.Ptrs(), kN, step);
        for (int i = 0; i < kN; ++i) {
          LionFloat64(h, t.g[i], t.ref_p[i], t.ref_buf[i]);
          ASSERT_EQ(t.p[i], t.ref_p[i]) << "step " << step << " element " << i;
          ASSERT_EQ(t.buf[i], t.ref_buf[i]) << "element " << i;
        }
      }
      EXPECT_GT(t.Wide(), kN / 2);
    }
  }
}

// The loss scale and the clip coefficient fold into the float64 gradient
// as one double multiplier (0.5 / 3, which fp32 scalars would round).
TEST(OptimizerCpuTest, Float64ScaleAndClipStayInDouble) {
  for (const OptimizerHyper& h : {Sgd(0.5, 0.9), Lion(0.5, 0.1)}) {
    std::vector<double> p = {1.0}, g = {3.0 / 7.0}, buf = {0.0};
    TensorPointers ptrs;
    ptrs.param = p.data();
    ptrs.grad = g.data();
    ptrs.state[0] = buf.data();
    Step(h, Float64Layout(h), ptrs, 1, 1, /*scale=*/3, /*clip=*/0.5);
    const double d = (3.0 / 7.0) * (0.5 / 3.0);
    if (h.kind == OptimizerKind::kSgd) {
      EXPECT_EQ(buf[0], d);
      EXPECT_EQ(p[0], 1.0 + -0.5 * d);
    } else {
      EXPECT_EQ(buf[0], (1 - 0.99) * d);
      EXPECT_EQ(p[0], 1.0 * (1 - 0.5 * 0.1) + -0.5);
    }
  }
}

// A float64 parameter whose gradient or state is not float64 has no
// kernel (ResolveLayout refuses it at registration): the dispatch stops
// rather than step it in some other precision.
TEST(OptimizerCpuTest, PartlyFloat64LayoutsAbort) {
  const OptimizerHyper sgd = Sgd(0.1, 0.9);
  std::vector<double> p = {1.0}, g = {0.5}, buf = {0.0};
  TensorPointers ptrs;
  ptrs.param = p.data();
  ptrs.grad = g.data();
  ptrs.state[0] = buf.data();
  Layout grad32 = Float64Layout(sgd);
  grad32.grad_dtype = DType::kFloat32;
  EXPECT_DEATH(Step(sgd, grad32, ptrs, 1, 1), "no CPU kernel for layout");
  const OptimizerHyper lion = Lion(0.1, 0);
  Layout state32 = Float64Layout(lion);
  state32.moment_dtype = DType::kFloat32;
  EXPECT_DEATH(Step(lion, state32, ptrs, 1, 1), "no CPU kernel for layout");
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
