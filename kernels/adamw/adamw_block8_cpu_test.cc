// The CPU reference AdamW over block8 moments (core/block8.h).
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "core/block8.h"
#include "gtest/gtest.h"
#include "kernels/adamw/adamw_cpu.h"

namespace optimd {
namespace {

Layout Block8Layout(MasterKind master = MasterKind::kNone,
                    DType param = DType::kFloat32) {
  Layout l;
  l.moment_dtype = DType::kBlock8;
  l.master = master;
  l.param_dtype = param;
  return l;
}

// One fp32 tensor with block8 moments.
struct Block8Tensor {
  explicit Block8Tensor(uint64_t n)
      : p(n), g(n), mq(n), vq(n), scales(Block8Blocks(n) * 2) {}
  std::vector<float> p, g;
  std::vector<uint8_t> mq, vq;
  std::vector<float> scales;
  TensorPointers Ptrs() {
    TensorPointers t;
    t.param = p.data();
    t.grad = g.data();
    t.state[0] = mq.data();
    t.state[1] = vq.data();
    t.scales = scales.data();
    return t;
  }
  // The moments as the step reads them.
  void Dequantize(std::vector<float>* m, std::vector<float>* v) const {
    const uint64_t n = p.size();
    m->resize(n);
    v->resize(n);
    for (uint64_t i = 0; i < n; i += kBlock8Elements) {
      const uint64_t len = std::min(kBlock8Elements, n - i);
      const uint64_t b = i / kBlock8Elements;
      DequantizeBlock8(true, &mq[i], len, scales[2 * b], &(*m)[i]);
      DequantizeBlock8(false, &vq[i], len, scales[2 * b + 1], &(*v)[i]);
    }
  }
};

void Fill(std::mt19937* rng, float sigma, std::vector<float>* x) {
  std::normal_distribution<float> normal(0.0f, sigma);
  for (float& e : *x) e = normal(*rng);
}

// A block8 step is, bit for bit, the fp32 step on the dequantized moments
// followed by QuantizeBlock8 of each block of the new moments; splitting
// the range at a block boundary changes nothing.
TEST(AdamWBlock8CpuTest, EqualsFp32StepOnDequantizedMoments) {
  constexpr uint64_t kN = 1000;  // a partial last block
  std::mt19937 rng(11);
  Block8Tensor t(kN);
  Fill(&rng, 1.0f, &t.p);
  OptimizerHyper h;
  h.lr = 1e-2;
  h.weight_decay = 0.1;
  for (int step = 1; step <= 5; ++step) {
    Fill(&rng, 1.0f + step, &t.g);
    std::vector<float> p = t.p, m, v;
    t.Dequantize(&m, &v);
    const AdamWScalars s = MakeAdamWScalars(h, step, 1.0, 1.0);
    Layout fp32;
    AdamWStepRange(fp32, {p.data(), t.g.data(), nullptr, m.data(), v.data()}, 0,
                   kN, s);
    AdamWStepRange(Block8Layout(), t.Ptrs(), 0, 512, s);
    AdamWStepRange(Block8Layout(), t.Ptrs(), 512, kN, s);
    for (uint64_t i = 0; i < kN; ++i) {
      ASSERT_EQ(FloatBits(t.p[i]), FloatBits(p[i])) << step << " " << i;
    }
    for (uint64_t i = 0; i < kN; i += kBlock8Elements) {
      const uint64_t len = std::min(kBlock8Elements, kN - i);
      const uint64_t b = i / kBlock8Elements;
      std::vector<uint8_t> mq(len), vq(len);
      EXPECT_EQ(FloatBits(t.scales[2 * b]),
                FloatBits(QuantizeBlock8(true, &m[i], len, mq.data())));
      EXPECT_EQ(FloatBits(t.scales[2 * b + 1]),
                FloatBits(QuantizeBlock8(false, &v[i], len, vq.data())));
      for (uint64_t j = 0; j < len; ++j) {
        ASSERT_EQ(t.mq[i + j], mq[j]) << step << " " << i + j;
        ASSERT_EQ(t.vq[i + j], vq[j]) << step << " " << i + j;
      }
    }
  }
}

// 200 steps of noisy gradients: the weights stay close to the fp32-moment
// run's (each moment carries 3 mantissa bits, relative error <= 1/16).
TEST(AdamWBlock8CpuTest, TracksFp32Moments) {
  constexpr uint64_t kN = 4096;
  std::mt19937 rng(3);
  Block8Tensor t(kN);
  Fill(&rng, 1.0f, &t.p);
  std::vector<float> p = t.p, m(kN), v(kN), g(kN);
  OptimizerHyper h;
  h.lr = 1e-3;
  for (int step = 1; step <= 200; ++step) {
    Fill(&rng, 1.0f, &g);
    // Gradient of 0.5 * |p|^2 plus noise, per element scale varying over
    // three orders of magnitude.
    for (uint64_t i = 0; i < kN; ++i) {
      const float w = std::ldexp(1.0f, -static_cast<int>(i % 10));
      t.g[i] = w * (t.p[i] + g[i]);
      g[i] = w * (p[i] + g[i]);
    }
    const AdamWScalars s = MakeAdamWScalars(h, step, 1.0, 1.0);
    AdamWStepRange(Layout(), {p.data(), g.data(), nullptr, m.data(), v.data()},
                   0, kN, s);
    AdamWStepRange(Block8Layout(), t.Ptrs(), 0, kN, s);
  }
  double moved = 0, diff = 0;
  for (uint64_t i = 0; i < kN; ++i) {
    diff = std::max(diff, std::fabs(double(t.p[i]) - p[i]));
    moved += std::fabs(double(p[i]));
  }
  // 200 steps of lr 1e-3 move a weight by up to 0.2; block8 moments change
  // step sizes most for elements whose gradients are 2^-9 of their block's
  // largest (the minifloat's coarse low end): a quarter of the travel at
  // most.
  EXPECT_LT(diff, 0.05);
  EXPECT_GT(moved, 0);
}

// bf16 parameters with remainders and with an fp32 master: the same
// master bits and moments.
TEST(AdamWBlock8CpuTest, RemainderEqualsFp32Master) {
  constexpr uint64_t kN = 700;
  std::mt19937 rng(8);
  std::vector<float> p(kN), g(kN), master(kN);
  Fill(&rng, 1.0f, &p);
  std::vector<uint16_t> p16(kN), r16(kN);
  std::vector<int16_t> rem(kN, 0);
  for (uint64_t i = 0; i < kN; ++i) {
    p16[i] = r16[i] = FloatToBFloat16(p[i]);
    master[i] = BFloat16ToFloat(p16[i]);
  }
  Block8Tensor a(kN), b(kN);
  OptimizerHyper h;
  h.lr = 1e-2;
  for (int step = 1; step <= 4; ++step) {
    Fill(&rng, 1.0f, &g);
    const AdamWScalars s = MakeAdamWScalars(h, step, 1.0, 1.0);
    TensorPointers pa = a.Ptrs(), pb = b.Ptrs();
    pa.param = p16.data();
    pa.grad = g.data();
    pa.master = master.data();
    pb.param = r16.data();
    pb.grad = g.data();
    pb.master = rem.data();
    AdamWStepRange(Block8Layout(MasterKind::kFp32, DType::kBFloat16), pa, 0, kN,
                   s);
    AdamWStepRange(Block8Layout(MasterKind::kRemainder, DType::kBFloat16), pb,
                   0, kN, s);
  }
  for (uint64_t i = 0; i < kN; ++i) {
    ASSERT_EQ(FloatBits(master[i]),
              FloatBits(ReconstructFromRemainder(r16[i], rem[i])))
        << i;
    ASSERT_EQ(a.mq[i], b.mq[i]);
    ASSERT_EQ(a.vq[i], b.vq[i]);
  }
}

}  // namespace
}  // namespace optimd
