// The CPU reference AdamW over FP8 parameters (core/fp8.h): every recipe
// and format against the fp32 step plus a quantization written out in the
// test (testing/fp8_reference.h).
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "core/fp8_quantize.h"
#include "gtest/gtest.h"
#include "kernels/adamw/adamw_cpu.h"
#include "testing/fp8_reference.h"

namespace optimd {
namespace {

namespace ref = fp8_reference;

// One FP8 tensor: its trainer buffers (codes, scale inverses, gradient)
// and its daemon state (fp32 master, fp32 moments).
struct Fp8Tensor {
  Fp8Tensor(Fp8Recipe recipe, uint64_t n, std::vector<uint64_t> shape)
      : geometry(Fp8Geometry::Of(recipe, n, shape)),
        codes(n),
        scale_inv(geometry.ScaleBytes()),
        grad(n),
        master(n),
        m(n),
        v(n) {}
  Fp8Geometry geometry;
  std::vector<uint8_t> codes, scale_inv;
  std::vector<float> grad, master, m, v;
  TensorPointers Ptrs() {
    TensorPointers t;
    t.param = codes.data();
    t.grad = grad.data();
    t.master = master.data();
    t.state[0] = m.data();
    t.state[1] = v.data();
    t.scale_inv = scale_inv.data();
    t.fp8 = geometry;
    return t;
  }
};

Layout Fp8Layout(DType dtype, Fp8Recipe recipe) {
  Layout l;
  l.param_dtype = dtype;
  l.master = MasterKind::kFp32;
  l.fp8_recipe = recipe;
  return l;
}

// The codes and scale inverses of `master` under the recipe, unit by unit
// with a straightforward scan of each unit's elements.
void ReferenceQuantize(const ref::Format& f, const Fp8Geometry& g,
                       const std::vector<float>& master,
                       std::vector<uint8_t>* codes,
                       std::vector<uint8_t>* scale_inv) {
  const uint64_t unit_cols = (g.cols + g.block_cols - 1) / g.block_cols;
  const uint64_t unit_rows = (g.rows + g.block_rows - 1) / g.block_rows;
  codes->assign(master.size(), 0);
  scale_inv->assign(g.ScaleBytes(), 0);
  for (uint64_t ur = 0; ur < unit_rows; ++ur) {
    for (uint64_t uc = 0; uc < unit_cols; ++uc) {
      std::vector<uint64_t> elems;
      for (uint64_t r = ur * g.block_rows;
           r < std::min(g.rows, (ur + 1) * g.block_rows); ++r) {
        for (uint64_t c = uc * g.block_cols;
             c < std::min(g.cols, (uc + 1) * g.block_cols); ++c) {
          elems.push_back(r * g.cols + c);
        }
      }
      float amax = 0;
      for (uint64_t i : elems) {
        const float a = std::fabs(master[i]);
        if (std::isnan(a) || a > amax) amax = a;
        if (std::isnan(amax)) break;
      }
      const uint64_t u = ur * unit_cols + uc;
      float mul;
      if (g.recipe == Fp8Recipe::kMxfp8) {
        const int e = ref::E8M0(amax, f.max_value);
        (*scale_inv)[u] = static_cast<uint8_t>(e);
        mul = e == 0xff ? 1.0f : static_cast<float>(std::ldexp(1.0, 127 - e));
      } else {
        mul = ref::Scale(amax, f.max_value, g.recipe != Fp8Recipe::kTensor);
        const float inv = 1.0f / mul;
        std::memcpy(&(*scale_inv)[4 * u], &inv, 4);
      }
      for (uint64_t i : elems) {
        (*codes)[i] = static_cast<uint8_t>(ref::Encode(f, master[i] * mul));
      }
    }
  }
}

struct Case {
  DType dtype;
  Fp8Recipe recipe;
  uint64_t rows, cols;
};

// Steps an FP8 tensor in plan-like items (twice its item alignment), and
// an fp32 parameter with the same state beside it: the master equals the
// fp32 parameter bit for bit, and the codes and scale inverses equal the
// reference quantization of the master after every step.
void CheckSteps(const Case& c) {
  const uint64_t n = c.rows * c.cols;
  const std::vector<uint64_t> shape = {c.rows, c.cols};
  const ref::Format& f =
      c.dtype == DType::kFloat8E4M3 ? ref::kE4M3 : ref::kE5M2;
  Fp8Tensor t(c.recipe, n, shape);
  std::mt19937 rng(static_cast<uint32_t>(n) + static_cast<int>(c.recipe));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (float& x : t.master) x = normal(rng) * 0.05f;
  // Whole units of tiny values (subnormal codes) and one of zeros.
  for (uint64_t i = 0; i < std::min<uint64_t>(n, 300); ++i)
    t.master[i] *= 1e-6f;
  std::vector<float> p = t.master, m(n), v(n);
  OptimizerHyper h;
  h.lr = 1e-2;
  h.weight_decay = 0.1;
  const Layout layout = Fp8Layout(c.dtype, c.recipe);
  const uint64_t item = 2 * t.geometry.ItemAlignment();
  for (int step = 1; step <= 3; ++step) {
    for (float& g : t.grad) g = normal(rng) * static_cast<float>(step);
    const AdamWScalars s = MakeAdamWScalars(h, step, 1.0, 1.0);
    AdamWStepRange(Layout(),
                   {p.data(), t.grad.data(), nullptr, m.data(), v.data()}, 0, n,
                   s);
    for (uint64_t b = 0; b < n; b += item) {
      AdamWStepRange(layout, t.Ptrs(), b, std::min(n, b + item), s);
    }
    std::vector<uint8_t> codes, scale_inv;
    ReferenceQuantize(f, t.geometry, p, &codes, &scale_inv);
    for (uint64_t i = 0; i < n; ++i) {
      ASSERT_EQ(FloatBits(t.master[i]), FloatBits(p[i])) << step << " " << i;
      ASSERT_EQ(t.codes[i], codes[i]) << step << " " << i << " " << p[i];
    }
    ASSERT_EQ(t.scale_inv, scale_inv) << step;
  }
}

TEST(AdamWFp8CpuTest, EveryRecipeAndFormatMatchesTheReference) {
  for (DType d : {DType::kFloat8E4M3, DType::kFloat8E5M2}) {
    for (Fp8Recipe r : {Fp8Recipe::kTensor, Fp8Recipe::kBlock1x128,
                        Fp8Recipe::kBlock128x128, Fp8Recipe::kMxfp8}) {
      // Whole blocks; ragged blocks at the row ends and the last block
      // row; one row (1-D).
      for (auto [rows, cols] : {std::pair<uint64_t, uint64_t>{256, 384},
                                {300, 200},
                                {1, 1000},
                                {130, 31}}) {
        SCOPED_TRACE(::testing::Message()
                     << DTypeName(d) << " " << Fp8RecipeName(r) << " " << rows
                     << "x" << cols);
        CheckSteps({d, r, rows, cols});
      }
    }
  }
}

// Registration reads the master back from the codes and scale inverses:
// each code's value times its unit's scale inverse.
TEST(AdamWFp8CpuTest, RegistrationDequantizesWithEachUnitsScale) {
  for (Fp8Recipe r : {Fp8Recipe::kTensor, Fp8Recipe::kBlock1x128,
                      Fp8Recipe::kBlock128x128, Fp8Recipe::kMxfp8}) {
    Fp8Tensor t(r, 300 * 200, {300, 200});
    std::mt19937 rng(3);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (float& x : t.master) x = normal(rng);
    QuantizeFp8Range(DType::kFloat8E4M3, t.Ptrs(), 0, t.master.size());
    const std::vector<uint8_t> codes = t.codes, scales = t.scale_inv;
    std::vector<float> expect(t.master.size());
    for (uint64_t i = 0; i < expect.size(); ++i) {
      const uint64_t u = t.geometry.UnitOf(i);
      float inv;
      if (r == Fp8Recipe::kMxfp8) {
        inv = static_cast<float>(std::ldexp(1.0, scales[u] - 127));
      } else {
        std::memcpy(&inv, &scales[4 * u], 4);
      }
      expect[i] = static_cast<float>(ref::Decode(ref::kE4M3, codes[i])) * inv;
    }
    DequantizeFp8Range(DType::kFloat8E4M3, t.Ptrs(), 0, t.master.size());
    for (uint64_t i = 0; i < expect.size(); ++i) {
      ASSERT_EQ(FloatBits(t.master[i]), FloatBits(expect[i])) << i;
    }
  }
}

// Non-finite masters (a step applied with assume_finite): a unit holding
// infinity gets scale 1 and saturated codes, one holding NaN scale 1 (MXFP8:
// the e8m0 NaN) and a NaN code; other units are untouched by them.
TEST(AdamWFp8CpuTest, NonFiniteUnitsFollowTheDocumentedRule) {
  Fp8Tensor t(Fp8Recipe::kBlock1x128, 3 * 128, {3, 128});
  for (uint64_t i = 0; i < t.master.size(); ++i) t.master[i] = 1.0f;
  t.master[5] = INFINITY;
  t.master[128 + 7] = NAN;
  QuantizeFp8Range(DType::kFloat8E4M3, t.Ptrs(), 0, t.master.size());
  float inv[3];
  std::memcpy(inv, t.scale_inv.data(), 12);
  EXPECT_EQ(inv[0], 1.0f);
  EXPECT_EQ(inv[1], 1.0f);
  EXPECT_EQ(inv[2], 1.0f / 256);      // 448 / 1 rounded down to 256
  EXPECT_EQ(t.codes[5], 0x7e);        // 448: saturated
  EXPECT_EQ(t.codes[0], 0x38);        // 1.0 at scale 1
  EXPECT_EQ(t.codes[256], 0x78);      // 1.0 at scale 256
  EXPECT_EQ(t.codes[128 + 7], 0x7f);  // NaN
  Fp8Tensor mx(Fp8Recipe::kMxfp8, 64, {64});
  for (float& x : mx.master) x = 1.0f;
  mx.master[40] = NAN;
  QuantizeFp8Range(DType::kFloat8E5M2, mx.Ptrs(), 0, 64);
  EXPECT_EQ(mx.scale_inv[0], 127 - 15);  // 1 / 57344 rounds up to 2^-15
  EXPECT_EQ(mx.scale_inv[1], 0xff);
}

}  // namespace
}  // namespace optimd
