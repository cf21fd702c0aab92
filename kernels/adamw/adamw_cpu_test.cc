#include "kernels/adamw/adamw_cpu.h"

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "core/step_math.h"
#include "gtest/gtest.h"
#include "kernels/master_cpu.h"

namespace optimd {
namespace {

Layout Fp32Layout(bool amsgrad = false) {
  Layout l;
  l.state_slots = amsgrad ? 3 : 2;
  return l;
}

struct OneTensor {
  std::vector<float> p, g, m, v, vmax, master;
  TensorPointers Ptrs() {
    TensorPointers t;
    t.param = p.data();
    t.grad = g.data();
    t.state[0] = m.data();
    t.state[1] = v.data();
    t.state[2] = vmax.data();
    t.master = master.empty() ? nullptr : master.data();
    return t;
  }
};

// With a constant gradient g, m_t / (1 - b1^t) = g and v_t / (1 - b2^t) = g^2,
// so each AdamW step is p <- p * (1 - lr*wd) - lr * g / (|g| + eps'):
// p1 = 0.999 - 0.1 = 0.899, p2 = 0.899 * 0.999 - 0.1 = 0.798101,
// p3 = 0.798101 * 0.999 - 0.1 = 0.697302899 (eps shifts the 8th digit).
TEST(AdamWCpuTest, HandComputedAdamW) {
  OneTensor t{{1.0f}, {0.5f}, {0}, {0}, {0}, {}};
  OptimizerHyper h;
  h.lr = 0.1;
  h.weight_decay = 0.01;
  const double want[] = {0.899, 0.798101, 0.697302899};
  for (int step = 1; step <= 3; ++step) {
    AdamWStepRange(Fp32Layout(), t.Ptrs(), 0, 1,
                   MakeAdamWScalars(h, step, 1.0, 1.0));
    EXPECT_NEAR(t.p[0], want[step - 1], 1e-6) << "step " << step;
  }
  EXPECT_NEAR(t.m[0], 0.1355, 1e-7);
  EXPECT_NEAR(t.v[0], 0.00074925025, 1e-10);
}

// Adam (L2) mode: g' = g + wd * p = 0.5 + 0.01 = 0.51, and the bias-corrected
// ratio is again 1, so p1 = 1 - 0.1 = 0.9.
TEST(AdamWCpuTest, HandComputedAdamL2) {
  OneTensor t{{1.0f}, {0.5f}, {0}, {0}, {0}, {}};
  OptimizerHyper h;
  h.lr = 0.1;
  h.weight_decay = 0.01;
  h.adamw = false;
  AdamWStepRange(Fp32Layout(), t.Ptrs(), 0, 1, MakeAdamWScalars(h, 1, 1, 1));
  EXPECT_NEAR(t.p[0], 0.9, 1e-6);
  EXPECT_NEAR(t.m[0], 0.051, 1e-7);
}

// Without bias correction step 1 is p - lr * 0.1 g / (sqrt(0.001) |g|).
TEST(AdamWCpuTest, HandComputedNoBiasCorrectionAndMaximize) {
  OneTensor t{{1.0f}, {0.5f}, {0}, {0}, {0}, {}};
  OptimizerHyper h;
  h.lr = 0.1;
  h.weight_decay = 0;
  h.bias_correction = false;
  h.maximize = true;
  AdamWStepRange(Fp32Layout(), t.Ptrs(), 0, 1, MakeAdamWScalars(h, 1, 1, 1));
  // m = -0.05, v = 0.00025, denom = 0.0158113883: p = 1 + 0.1 * 3.16227766.
  EXPECT_NEAR(t.p[0], 1.316227766, 1e-6);
}

TEST(AdamWCpuTest, AmsgradKeepsTheMaximum) {
  OneTensor t{{1.0f}, {1.0f}, {0}, {0}, {0}, {}};
  OptimizerHyper h;
  h.amsgrad = true;
  AdamWStepRange(Fp32Layout(true), t.Ptrs(), 0, 1,
                 MakeAdamWScalars(h, 1, 1, 1));
  const float vmax1 = t.vmax[0];
  EXPECT_FLOAT_EQ(vmax1, 0.001f);
  t.g[0] = 0.0f;  // v decays; the max must not
  AdamWStepRange(Fp32Layout(true), t.Ptrs(), 0, 1,
                 MakeAdamWScalars(h, 2, 1, 1));
  EXPECT_LT(t.v[0], vmax1);
  EXPECT_EQ(t.vmax[0], vmax1);
}

TEST(AdamWCpuTest, GradScaleAndClipFoldIntoTheGradient) {
  // Scaling the gradient by 8 and passing grad_scale 8 is the same step.
  OneTensor a{{1.0f, -2.0f}, {0.25f, -0.75f}, {0, 0}, {0, 0}, {0, 0}, {}};
  OneTensor b{{1.0f, -2.0f}, {2.0f, -6.0f}, {0, 0}, {0, 0}, {0, 0}, {}};
  OptimizerHyper h;
  AdamWStepRange(Fp32Layout(), a.Ptrs(), 0, 2, MakeAdamWScalars(h, 1, 1, 1));
  AdamWStepRange(Fp32Layout(), b.Ptrs(), 0, 2, MakeAdamWScalars(h, 1, 8, 1));
  EXPECT_EQ(a.p, b.p);
  EXPECT_EQ(a.m, b.m);
}

TEST(AdamWCpuTest, RemainderRoundTripIsExact) {
  std::mt19937 rng(7);
  for (int i = 0; i < 1000000; ++i) {
    const uint32_t bits = rng();
    const float f = BitsToFloat(bits);
    if (!std::isfinite(f)) continue;
    uint16_t hi;
    int16_t rem;
    SplitToRemainder(f, &hi, &rem);
    ASSERT_EQ(FloatBits(ReconstructFromRemainder(hi, rem)), bits);
    // The bf16 half is the master rounded to nearest (ties away from zero):
    // never more than half a bf16 ulp away.
    const float as_bf16 = BFloat16ToFloat(hi);
    if (std::isfinite(as_bf16)) {
      ASSERT_LE(std::fabs(double(as_bf16) - f),
                std::fabs(double(BFloat16ToFloat(FloatToBFloat16(f))) - f) +
                    std::ldexp(std::fabs(double(f)), -9));
    }
  }
}

// The remainder layout must follow the fp32-master layout bit for bit: the
// masters agree exactly at every step, and the bf16 parameters agree except
// where the master lies exactly halfway between two bf16 values (the
// remainder layout then rounds away from zero, fp32-master to even).
TEST(AdamWCpuTest, RemainderMatchesFp32MasterBitForBit) {
  constexpr int kN = 4099;
  std::mt19937 rng(11);
  std::normal_distribution<float> normal;
  std::vector<uint16_t> p_master(kN), p_rem(kN), grad(kN);
  std::vector<float> master(kN), m1(kN), v1(kN), m2(kN), v2(kN);
  std::vector<int16_t> rem(kN, 0);
  for (int i = 0; i < kN; ++i) {
    p_master[i] = p_rem[i] = FloatToBFloat16(normal(rng));
    master[i] = BFloat16ToFloat(p_master[i]);
  }
  Layout fp32m{DType::kBFloat16, DType::kBFloat16, DType::kFloat32,
               MasterKind::kFp32};
  Layout remm = fp32m;
  remm.master = MasterKind::kRemainder;
  OptimizerHyper h;
  h.lr = 1e-3;
  int ties = 0;
  for (int step = 1; step <= 300; ++step) {
    for (int i = 0; i < kN; ++i) grad[i] = FloatToBFloat16(normal(rng));
    const AdamWScalars s = MakeAdamWScalars(h, step, 1, 1);
    TensorPointers a{p_master.data(), grad.data(), master.data(),
                     m1.data(),       v1.data(),   nullptr};
    TensorPointers b{p_rem.data(), grad.data(), rem.data(),
                     m2.data(),    v2.data(),   nullptr};
    AdamWStepRange(fp32m, a, 0, kN, s);
    AdamWStepRange(remm, b, 0, kN, s);
    for (int i = 0; i < kN; ++i) {
      ASSERT_EQ(FloatBits(master[i]),
                FloatBits(ReconstructFromRemainder(p_rem[i], rem[i])))
          << "step " << step << " element " << i;
      ASSERT_EQ(FloatBits(m1[i]), FloatBits(m2[i]));
      ASSERT_EQ(p_master[i], FloatToBFloat16(master[i]));
      if (p_master[i] != p_rem[i]) {
        ASSERT_EQ(FloatBits(master[i]) & 0xffffu, 0x8000u);
        ++ties;
      }
    }
  }
  EXPECT_LT(ties, 100);
}

TEST(AdamWCpuTest, LowPrecisionParamIsRoundedMaster) {
  constexpr int kN = 257;
  std::mt19937 rng(3);
  std::normal_distribution<float> normal;
  std::vector<uint16_t> p(kN), g(kN);
  std::vector<float> master(kN), m(kN), v(kN);
  for (int i = 0; i < kN; ++i) {
    p[i] = FloatToHalf(normal(rng));
    g[i] = FloatToHalf(normal(rng));
  }
  Layout l{DType::kFloat16, DType::kFloat16, DType::kFloat32,
           MasterKind::kFp32};
  TensorPointers t{p.data(), g.data(), master.data(),
                   m.data(), v.data(), nullptr};
  InitMasterRange(l, t, 0, kN);
  for (int i = 0; i < kN; ++i) EXPECT_EQ(master[i], HalfToFloat(p[i]));
  OptimizerHyper h;
  AdamWStepRange(l, t, 0, kN, MakeAdamWScalars(h, 1, 1, 1));
  for (int i = 0; i < kN; ++i) EXPECT_EQ(p[i], FloatToHalf(master[i]));
}

TEST(AdamWCpuTest, BFloat16MomentsTrackFp32Moments) {
  constexpr int kN = 1000;
  std::mt19937 rng(5);
  std::normal_distribution<float> normal;
  std::vector<float> p32(kN), g(kN), m32(kN), v32(kN);
  std::vector<float> p16(kN);
  std::vector<uint16_t> m16(kN), v16(kN);
  for (int i = 0; i < kN; ++i) p32[i] = p16[i] = normal(rng);
  Layout l32;
  Layout l16;
  l16.moment_dtype = DType::kBFloat16;
  OptimizerHyper h;
  for (int step = 1; step <= 20; ++step) {
    for (int i = 0; i < kN; ++i) g[i] = normal(rng);
    const AdamWScalars s = MakeAdamWScalars(h, step, 1, 1);
    AdamWStepRange(
        l32, {p32.data(), g.data(), nullptr, m32.data(), v32.data(), nullptr},
        0, kN, s);
    AdamWStepRange(
        l16, {p16.data(), g.data(), nullptr, m16.data(), v16.data(), nullptr},
        0, kN, s);
  }
  // Each bf16 store rounds by at most 2^-9 of the value; over 20 steps the
  // running average carries up to 20 such errors of values up to a few times
  // the moments' RMS, so 20 * 2^-9 * RMS (4%) bounds the difference.
  double rms = 0;
  for (int i = 0; i < kN; ++i) rms += double(m32[i]) * m32[i];
  rms = std::sqrt(rms / kN);
  for (int i = 0; i < kN; ++i) {
    EXPECT_NEAR(p16[i], p32[i], 2e-4) << i;
    EXPECT_NEAR(BFloat16ToFloat(m16[i]), m32[i], 20 * std::ldexp(rms, -9)) << i;
  }
}

// torch.optim.AdamW's (and Adam's) single-tensor step on float64 values,
// written out as torch 1.13 orders it, with its scalars in double (beta^t
// as BetaPower gives it: pow's result but for rare last-bit differences,
// core/step_math_test.cc).
struct TorchFloat64Step {
  double lr = 1e-2, beta1 = 0.9, beta2 = 0.99, eps = 1e-8, wd = 0.05;
  bool adamw = true, amsgrad = false;
  void Run(int step, double g, double& p, double& m, double& v,
           double& vmax) const {
    if (adamw) {
      p = p * (1 - lr * wd);
    } else {
      g = g + wd * p;
    }
    m = m * beta1 + (1 - beta1) * g;
    v = v * beta2 + (1 - beta2) * g * g;
    const double bc1 = 1 - BetaPower(beta1, step);
    const double bc2_sqrt = std::sqrt(1 - BetaPower(beta2, step));
    double vd = v;
    if (amsgrad) vd = vmax = std::max(vmax, v);
    p = p + -(lr / bc1) * (m / (std::sqrt(vd) / bc2_sqrt + eps));
  }
};

// The float64 layout steps in double with unrounded double scalars: bit for
// bit torch's float64 arithmetic (both without FMA contraction), and not
// what fp32 arithmetic would give.
TEST(AdamWCpuTest, Float64LayoutStepsInDouble) {
  constexpr int kN = 513;
  std::mt19937 rng(11);
  std::normal_distribution<double> normal;
  Layout l{DType::kFloat64, DType::kFloat64, DType::kFloat64,
           MasterKind::kNone};
  for (const bool adamw : {true, false}) {
    for (const bool amsgrad : {false, true}) {
      SCOPED_TRACE(testing::Message()
                   << "adamw=" << adamw << " amsgrad=" << amsgrad);
      l.state_slots = amsgrad ? 3 : 2;
      std::vector<double> p(kN), g(kN), m(kN), v(kN), x(kN);
      std::vector<double> rp(kN), rm(kN), rv(kN), rx(kN);
      for (int i = 0; i < kN; ++i) rp[i] = p[i] = normal(rng);
      OptimizerHyper h;
      h.lr = 1e-2;
      h.beta1 = 0.9;
      h.beta2 = 0.99;
      h.weight_decay = 0.05;
      h.adamw = adamw;
      h.amsgrad = amsgrad;
      TorchFloat64Step ref;
      ref.adamw = adamw;
      ref.amsgrad = amsgrad;
      for (int step = 1; step <= 50; ++step) {
        for (int i = 0; i < kN; ++i) g[i] = normal(rng);
        AdamWStepRange(
            l, {p.data(), g.data(), nullptr, m.data(), v.data(), x.data()}, 0,
            kN, MakeAdamWScalars(h, step, 1, 1));
        for (int i = 0; i < kN; ++i) {
          ref.Run(step, g[i], rp[i], rm[i], rv[i], rx[i]);
          ASSERT_EQ(p[i], rp[i]) << "step " << step << " element " << i;
          ASSERT_EQ(m[i], rm[i]);
          ASSERT_EQ(v[i], rv[i]);
          if (amsgrad) {
            ASSERT_EQ(x[i], rx[i]);
          }
        }
      }
      // fp32 arithmetic would have lost the low bits long ago.
      int wide = 0;
      for (int i = 0; i < kN; ++i) {
        wide += p[i] != static_cast<double>(static_cast<float>(p[i]));
      }
      EXPECT_GT(wide, kN / 2);
    }
  }
}

}  // namespace
}  // namespace optimd
