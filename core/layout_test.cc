#include "core/layout.h"

#include <utility>

#include "gtest/gtest.h"

namespace optimd {
namespace {

OptimizerHyper Amsgrad() {
  OptimizerHyper h;
  h.amsgrad = true;
  return h;
}

using F = DType;

TEST(LayoutTest, DefaultsFollowParamDtype) {
  auto fp32 = ResolveLayout("w", F::kFloat32, F::kFloat32, F::kFloat32,
                            MasterRequest::kDefault, false, OptimizerHyper());
  ASSERT_TRUE(fp32.ok());
  EXPECT_EQ(fp32->master, MasterKind::kNone);
  EXPECT_EQ(fp32->StateBytesPerElement(), 8u);
  auto bf16 = ResolveLayout("w", F::kBFloat16, F::kBFloat16, F::kFloat32,
                            MasterRequest::kDefault, false, Amsgrad());
  ASSERT_TRUE(bf16.ok());
  EXPECT_EQ(bf16->master, MasterKind::kFp32);
  EXPECT_EQ(bf16->StateBytesPerElement(), 16u);  // master + 3 moments
}

TEST(LayoutTest, RemainderBytes) {
  auto l = ResolveLayout("w", F::kBFloat16, F::kFloat32, F::kFloat32,
                         MasterRequest::kRemainder, false, OptimizerHyper());
  ASSERT_TRUE(l.ok());
  EXPECT_EQ(l->StateBytesPerElement(), 10u);
  auto l16 = ResolveLayout("w", F::kBFloat16, F::kFloat32, F::kBFloat16,
                           MasterRequest::kRemainder, false, OptimizerHyper());
  ASSERT_TRUE(l16.ok());
  EXPECT_EQ(l16->StateBytesPerElement(), 6u);
}

TEST(LayoutTest, RefusesInvalidCombinationsNamingTheTensor) {
  struct Case {
    DType param, moment;
    MasterRequest master;
    bool keep_fp32;
  } cases[] = {
      {F::kFloat32, F::kFloat32, MasterRequest::kRemainder, false},
      {F::kFloat16, F::kFloat32, MasterRequest::kRemainder, false},
      {F::kBFloat16, F::kFloat32, MasterRequest::kNone, false},
      {F::kFloat32, F::kFloat16, MasterRequest::kDefault, false},
      {F::kBFloat16, F::kFloat32, MasterRequest::kDefault, true},
      {F::kFloat32, F::kFloat32, MasterRequest::kRemainder, true},
  };
  for (const Case& c : cases) {
    auto l = ResolveLayout("layer.7.w", c.param, F::kFloat32, c.moment,
                           c.master, c.keep_fp32, OptimizerHyper());
    ASSERT_FALSE(l.ok());
    EXPECT_EQ(l.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(l.status().message().find("layer.7.w"), absl::string_view::npos)
        << l.status();
  }
}

// Block8 moments only where the optimizer's kernels take them (its
// traits): AdamW without amsgrad; each refusal names the tensor and why.
TEST(LayoutTest, Block8MomentsOnlyWhereTheOptimizerTakesThem) {
  auto adamw = ResolveLayout("w", F::kFloat32, F::kFloat32, F::kBlock8,
                             MasterRequest::kDefault, false, OptimizerHyper());
  ASSERT_TRUE(adamw.ok()) << adamw.status();
  EXPECT_TRUE(adamw->block8());
  OptimizerHyper sgd;
  sgd.kind = OptimizerKind::kSgd;
  sgd.momentum = 0.9;
  OptimizerHyper lion;
  lion.kind = OptimizerKind::kLion;
  const struct {
    OptimizerHyper hyper;
    const char* why;
  } refused[] = {{Amsgrad(), "do not support amsgrad"},
                 {sgd, "for AdamW/Adam only"},
                 {lion, "for AdamW/Adam only"}};
  for (const auto& c : refused) {
    auto l = ResolveLayout("layer.3.w", F::kFloat32, F::kFloat32, F::kBlock8,
                           MasterRequest::kDefault, false, c.hyper);
    ASSERT_FALSE(l.ok());
    EXPECT_EQ(l.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(l.status().message().find("layer.3.w"), absl::string_view::npos);
    EXPECT_NE(l.status().message().find(c.why), absl::string_view::npos)
        << l.status();
  }
}

TEST(LayoutTest, KeepFp32StaysInPlaceEvenWhenGroupWantsMaster) {
  auto l = ResolveLayout("norm", F::kFloat32, F::kBFloat16, F::kBFloat16,
                         MasterRequest::kDefault, true, OptimizerHyper());
  ASSERT_TRUE(l.ok());
  EXPECT_EQ(l->master, MasterKind::kNone);
}

TEST(LayoutTest, Float64IsParamGradAndMomentsWithoutMaster) {
  EXPECT_EQ(DefaultMomentDType(F::kFloat64), F::kFloat64);
  EXPECT_EQ(DefaultMomentDType(F::kBFloat16), F::kFloat32);
  for (const MasterRequest master :
       {MasterRequest::kDefault, MasterRequest::kNone}) {
    auto l = ResolveLayout("w", F::kFloat64, F::kFloat64, F::kFloat64, master,
                           false, Amsgrad());
    ASSERT_TRUE(l.ok()) << l.status();
    EXPECT_EQ(l->master, MasterKind::kNone);
    EXPECT_EQ(l->StateBytesPerElement(), 24u);  // 3 float64 moments
  }
}

// SGD (with and without momentum) and Lion take the float64 layout too,
// with their state slots in float64.
TEST(LayoutTest, SgdAndLionTakeFloat64) {
  OptimizerHyper sgd;
  sgd.kind = OptimizerKind::kSgd;
  OptimizerHyper lion;
  lion.kind = OptimizerKind::kLion;
  OptimizerHyper momentum = sgd;
  momentum.momentum = 0.9;
  const std::pair<OptimizerHyper, uint64_t> cases[] = {
      {sgd, 0}, {momentum, 8}, {lion, 8}};
  for (const auto& [hyper, bytes] : cases) {
    EXPECT_TRUE(TakesFloat64(hyper.kind));
    auto l = ResolveLayout("w", F::kFloat64, F::kFloat64,
                           DefaultMomentDType(F::kFloat64),
                           MasterRequest::kDefault, false, hyper);
    ASSERT_TRUE(l.ok()) << l.status();
    EXPECT_EQ(l->optimizer, hyper.kind);
    EXPECT_EQ(l->master, MasterKind::kNone);
    EXPECT_EQ(l->moment_dtype, F::kFloat64);
    EXPECT_EQ(l->StateBytesPerElement(), bytes) << OptimizerName(hyper.kind);
  }
}

// Each refusal names the tensor and what to change.
TEST(LayoutTest, Float64RefusalsSayWhy) {
  OptimizerHyper sgd;
  sgd.kind = OptimizerKind::kSgd;
  sgd.momentum = 0.9;
  struct Case {
    DType param, grad, moment;
    MasterRequest master;
    bool keep_fp32;
    OptimizerHyper hyper;
    const char* why;
  } cases[] = {
      {F::kFloat64, F::kFloat32, F::kFloat64, MasterRequest::kDefault, false,
       OptimizerHyper(), "needs a float64 gradient"},
      {F::kFloat64, F::kFloat64, F::kFloat32, MasterRequest::kDefault, false,
       OptimizerHyper(), "keeps float64 moments"},
      {F::kFloat64, F::kFloat64, F::kBlock8, MasterRequest::kDefault, false,
       OptimizerHyper(), "keeps float64 moments"},
      {F::kFloat64, F::kFloat64, F::kFloat64, MasterRequest::kFp32, false,
       OptimizerHyper(), "no fp32 master"},
      {F::kFloat64, F::kFloat64, F::kFloat64, MasterRequest::kRemainder, false,
       OptimizerHyper(), "bfloat16 parameter"},
      {F::kFloat64, F::kFloat64, F::kFloat64, MasterRequest::kDefault, true,
       OptimizerHyper(), "keep_fp32 is for fp32"},
      {F::kFloat64, F::kFloat64, F::kBFloat16, MasterRequest::kDefault, false,
       sgd, "keeps float64 moments"},
      {F::kFloat64, F::kFloat64, F::kFloat64, MasterRequest::kFp32, false, sgd,
       "no fp32 master"},
      {F::kFloat32, F::kFloat64, F::kFloat32, MasterRequest::kDefault, false,
       OptimizerHyper(), "float64 gradients need a float64 parameter"},
      {F::kBFloat16, F::kBFloat16, F::kFloat64, MasterRequest::kDefault, false,
       OptimizerHyper(), "float64 moments need a float64 parameter"},
  };
  for (const Case& c : cases) {
    auto l = ResolveLayout("layer.7.w", c.param, c.grad, c.moment, c.master,
                           c.keep_fp32, c.hyper);
    ASSERT_FALSE(l.ok()) << c.why;
    EXPECT_EQ(l.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(l.status().message().find("layer.7.w"), absl::string_view::npos)
        << l.status();
    EXPECT_NE(l.status().message().find(c.why), absl::string_view::npos)
        << l.status();
  }
}

// FP8 parameters: AdamW, an fp32 master, fp32 or bf16 moments and a
// recipe; every other combination, float64 with FP8 among them, is refused
// naming the tensor and why.
TEST(LayoutTest, Fp8ParametersNeedARecipeAndAnFp32Master) {
  auto resolve = [](DType param, DType grad, DType moments,
                    MasterRequest master, Fp8Recipe recipe,
                    OptimizerHyper hyper) -> absl::StatusOr<Layout> {
    auto l = ResolveLayout("w8", param, grad, moments, master, false, hyper);
    if (!l.ok()) return l.status();
    absl::Status s = ResolveFp8Recipe("w8", recipe, &*l);
    if (!s.ok()) return s;
    return l;
  };
  auto ok =
      resolve(F::kFloat8E4M3, F::kBFloat16, F::kBFloat16,
              MasterRequest::kDefault, Fp8Recipe::kMxfp8, OptimizerHyper());
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->master, MasterKind::kFp32);
  EXPECT_EQ(ok->fp8_recipe, Fp8Recipe::kMxfp8);
  EXPECT_EQ(ok->StateBytesPerElement(), 8u);
  OptimizerHyper sgd;
  sgd.kind = OptimizerKind::kSgd;
  const struct {
    DType param, grad, moments;
    MasterRequest master;
    Fp8Recipe recipe;
    OptimizerHyper hyper;
    const char* why;
  } refused[] = {
      {F::kFloat8E5M2, F::kFloat32, F::kFloat32, MasterRequest::kDefault,
       Fp8Recipe::kNone, OptimizerHyper(), "needs an fp8_recipe"},
      {F::kBFloat16, F::kFloat32, F::kFloat32, MasterRequest::kDefault,
       Fp8Recipe::kTensor, OptimizerHyper(), "is for float8_e4m3fn"},
      {F::kFloat8E4M3, F::kFloat8E4M3, F::kFloat32, MasterRequest::kDefault,
       Fp8Recipe::kTensor, OptimizerHyper(), "gradient"},
      {F::kFloat8E4M3, F::kFloat32, F::kBlock8, MasterRequest::kDefault,
       Fp8Recipe::kTensor, OptimizerHyper(), "not block8"},
      {F::kFloat8E4M3, F::kFloat32, F::kFloat32, MasterRequest::kRemainder,
       Fp8Recipe::kTensor, OptimizerHyper(), "bfloat16"},
      {F::kFloat8E4M3, F::kFloat32, F::kFloat32, MasterRequest::kNone,
       Fp8Recipe::kTensor, OptimizerHyper(), "needs fp32 master weights;"},
      // Only bfloat16 parameters are offered remainders.
      {F::kBFloat16, F::kFloat32, F::kFloat32, MasterRequest::kNone,
       Fp8Recipe::kNone, OptimizerHyper(),
       "needs master weights (fp32 or remainder);"},
      {F::kFloat16, F::kFloat32, F::kFloat32, MasterRequest::kNone,
       Fp8Recipe::kNone, OptimizerHyper(), "needs fp32 master weights;"},
      {F::kFloat8E4M3, F::kFloat32, F::kFloat32, MasterRequest::kDefault,
       Fp8Recipe::kTensor, sgd, "AdamW only"},
      // float64 and FP8 never meet in one tensor.
      {F::kFloat8E4M3, F::kFloat64, F::kFloat32, MasterRequest::kDefault,
       Fp8Recipe::kTensor, OptimizerHyper(),
       "float64 gradients need a float64 parameter"},
      {F::kFloat8E5M2, F::kFloat32, F::kFloat64, MasterRequest::kDefault,
       Fp8Recipe::kTensor, OptimizerHyper(),
       "float64 moments need a float64 parameter"},
      {F::kFloat64, F::kFloat8E4M3, F::kFloat64, MasterRequest::kDefault,
       Fp8Recipe::kNone, OptimizerHyper(), "needs a float64 gradient"},
      {F::kFloat64, F::kFloat64, F::kFloat64, MasterRequest::kDefault,
       Fp8Recipe::kTensor, OptimizerHyper(),
       "float8_e5m2 parameters, not float64"},
  };
  for (const auto& c : refused) {
    auto l = resolve(c.param, c.grad, c.moments, c.master, c.recipe, c.hyper);
    ASSERT_FALSE(l.ok()) << c.why;
    EXPECT_EQ(l.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(l.status().message().find("w8"), absl::string_view::npos);
    EXPECT_NE(l.status().message().find(c.why), absl::string_view::npos)
        << l.status();
  }
}

}  // namespace
}  // namespace optimd
