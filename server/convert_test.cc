#include "server/convert.h"

#include <utility>

#include "gtest/gtest.h"

namespace optimd {
namespace {

TEST(ConvertTest, StatusCodesSurviveTheBoundary) {
  grpc::Status s = ToGrpcStatus(absl::NotFoundError("group 'x'"));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(s.error_message(), "group 'x'");
  EXPECT_TRUE(ToGrpcStatus(absl::OkStatus()).ok());
  EXPECT_EQ(ToGrpcStatus(absl::UnauthenticatedError("")).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
}

// Messages travel in trailing metadata, which clients refuse past a few
// KiB: one past 4 KiB is cut and says so; one of exactly 4 KiB is kept.
TEST(ConvertTest, LongMessagesAreCut) {
  const std::string name(10000, 'n');
  grpc::Status s = ToGrpcStatus(absl::InvalidArgumentError(name));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(s.error_message(), std::string(4096, 'n') + " [...]");
  s = ToGrpcStatus(absl::InvalidArgumentError(name.substr(0, 4096)));
  EXPECT_EQ(s.error_message(), name.substr(0, 4096));
}

TEST(ConvertTest, GroupSpecDefaultsAndErrors) {
  v1::RegisterGroupRequest r;
  r.set_group_id("g");
  r.mutable_hyperparameters()->set_lr(0.5);
  auto* t = r.add_tensors();
  t->set_name("w");
  t->set_numel(4);
  t->set_param_dtype(v1::DTYPE_BFLOAT16);
  t->mutable_param()->mutable_shared_memory()->set_segment_name("/s");
  t->mutable_param()->mutable_shared_memory()->set_size(8);
  auto spec = GroupSpecFromProto(r);
  ASSERT_TRUE(spec.ok());
  EXPECT_TRUE(spec->hyper.adamw);
  EXPECT_TRUE(spec->hyper.bias_correction);
  EXPECT_EQ(spec->hyper.lr, 0.5);
  EXPECT_EQ(spec->tensors[0].param_dtype, DType::kBFloat16);
  EXPECT_TRUE(spec->tensors[0].param_dtype_set);
  EXPECT_FALSE(spec->tensors[0].grad_dtype_set);
  EXPECT_EQ(spec->tensors[0].param.kind, BufferHandle::Kind::kSharedMemory);
  EXPECT_EQ(spec->tensors[0].grad.kind, BufferHandle::Kind::kNone);
  EXPECT_TRUE(spec->tensors[0].aliases.empty());
  // A tied weight's other names travel in order.
  t->add_aliases("head.weight");
  t->add_aliases("dec.weight");
  EXPECT_EQ(GroupSpecFromProto(r)->tensors[0].aliases,
            (std::vector<std::string>{"head.weight", "dec.weight"}));

  r.mutable_hyperparameters()->set_bias_correction(false);
  EXPECT_FALSE(GroupSpecFromProto(r)->hyper.bias_correction);

  t->set_param_dtype(static_cast<v1::DType>(42));
  auto bad = GroupSpecFromProto(r);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("'w'"), absl::string_view::npos);
}

// The API's optimizer kinds map by number both ways; a number no
// optimizer has is refused, naming the known ones.
// A cuda_vmm handle keeps its device, region and chunks in order.
TEST(ConvertTest, CudaVmmHandlesKeepTheirChunksInOrder) {
  v1::BufferHandle h;
  auto* vmm = h.mutable_cuda_vmm();
  vmm->set_device(1);
  vmm->set_offset(4096);
  vmm->set_size(3 << 20);
  for (int i = 0; i < 2; ++i) {
    auto* c = vmm->add_chunks();
    c->set_fd_id(std::string(16, static_cast<char>('a' + i)));
    c->set_size(2 << 20);
  }
  const BufferHandle out = BufferHandleFromProto(h);
  EXPECT_EQ(out.kind, BufferHandle::Kind::kCudaVmm);
  EXPECT_EQ(out.device, 1);
  EXPECT_EQ(out.offset, 4096u);
  EXPECT_EQ(out.size, 3u << 20);
  ASSERT_EQ(out.vmm_chunks.size(), 2u);
  EXPECT_EQ(out.vmm_chunks[0].fd_id, std::string(16, 'a'));
  EXPECT_EQ(out.vmm_chunks[1].fd_id, std::string(16, 'b'));
  EXPECT_EQ(out.vmm_chunks[1].size, 2u << 20);
}

TEST(ConvertTest, OptimizerKindsByNumber) {
  v1::RegisterGroupRequest r;
  r.set_group_id("g");
  const std::pair<v1::OptimizerKind, OptimizerKind> kinds[] = {
      {v1::OPTIMIZER_KIND_UNSPECIFIED, OptimizerKind::kAdamW},
      {v1::OPTIMIZER_KIND_ADAMW, OptimizerKind::kAdamW},
      {v1::OPTIMIZER_KIND_SGD, OptimizerKind::kSgd},
      {v1::OPTIMIZER_KIND_LION, OptimizerKind::kLion}};
  for (const auto& [proto, kind] : kinds) {
    r.mutable_hyperparameters()->set_optimizer(proto);
    auto spec = GroupSpecFromProto(r);
    ASSERT_TRUE(spec.ok());
    EXPECT_EQ(spec->hyper.kind, kind);
    v1::Hyperparameters back;
    HyperToProto(spec->hyper, &back);
    EXPECT_EQ(back.optimizer(), proto == v1::OPTIMIZER_KIND_UNSPECIFIED
                                    ? v1::OPTIMIZER_KIND_ADAMW
                                    : proto);
  }
  for (int bad : {4, 99, -1}) {
    r.mutable_hyperparameters()->set_optimizer(
        static_cast<v1::OptimizerKind>(bad));
    auto spec = GroupSpecFromProto(r);
    EXPECT_EQ(spec.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(spec.status().message().find("(known: adamw, sgd, lion)"),
              absl::string_view::npos);
  }
}

// float64 travels as DTYPE_FLOAT64; an unspecified moment dtype is the
// per-tensor default (float64 for float64 parameters), a given one is not.
TEST(ConvertTest, Float64AndTheDefaultMomentDtype) {
  v1::RegisterGroupRequest r;
  r.set_group_id("g");
  auto* t = r.add_tensors();
  t->set_name("w");
  t->set_numel(2);
  t->set_param_dtype(v1::DTYPE_FLOAT64);
  t->set_grad_dtype(v1::DTYPE_FLOAT64);
  auto spec = GroupSpecFromProto(r);
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->tensors[0].param_dtype, DType::kFloat64);
  EXPECT_EQ(spec->tensors[0].grad_dtype, DType::kFloat64);
  EXPECT_TRUE(spec->moment_dtype_default);
  r.mutable_layout()->set_moment_dtype(v1::DTYPE_FLOAT64);
  spec = GroupSpecFromProto(r);
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->moment_dtype, DType::kFloat64);
  EXPECT_FALSE(spec->moment_dtype_default);
  EXPECT_EQ(DTypeToProto(DType::kFloat64), v1::DTYPE_FLOAT64);
}

// FP8 parameters: dtype, recipe and scale_inv buffer travel; an unknown
// recipe is refused naming the tensor.
TEST(ConvertTest, Fp8ParametersTravelWithRecipeAndScales) {
  v1::RegisterGroupRequest r;
  r.set_group_id("g");
  auto* t = r.add_tensors();
  t->set_name("w8");
  t->set_numel(256);
  t->set_param_dtype(v1::DTYPE_FLOAT8_E5M2);
  t->set_fp8_recipe(v1::FP8_RECIPE_MXFP8);
  t->mutable_scale_inv()->mutable_shared_memory()->set_segment_name("/s");
  t->mutable_scale_inv()->mutable_shared_memory()->set_size(8);
  auto spec = GroupSpecFromProto(r);
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->tensors[0].param_dtype, DType::kFloat8E5M2);
  EXPECT_EQ(spec->tensors[0].fp8_recipe, Fp8Recipe::kMxfp8);
  EXPECT_EQ(spec->tensors[0].scale_inv.kind, BufferHandle::Kind::kSharedMemory);
  EXPECT_EQ(spec->tensors[0].scale_inv.size, 8u);
  EXPECT_EQ(DTypeToProto(DType::kFloat8E4M3), v1::DTYPE_FLOAT8_E4M3FN);
  t->set_fp8_recipe(static_cast<v1::Fp8Recipe>(9));
  auto bad = GroupSpecFromProto(r);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("'w8'"), absl::string_view::npos);
  EXPECT_NE(bad.status().message().find("fp8_recipe"), absl::string_view::npos);
}

TEST(ConvertTest, StepDefaults) {
  v1::StepRequest r;
  r.add_overrides()->set_group_id("g");
  r.mutable_overrides(0)->set_lr(0.1);
  StepRequestSpec s = *StepSpecFromProto(r);
  EXPECT_EQ(s.options.grad_scale, 1.0);
  EXPECT_EQ(s.options.max_grad_norm, 0.0);
  ASSERT_EQ(s.overrides.size(), 1u);
  EXPECT_EQ(s.overrides[0].lr, 0.1);
  EXPECT_FALSE(s.overrides[0].beta1.has_value());
  EXPECT_FALSE(s.memory_released);
  r.set_memory_released(true);
  EXPECT_TRUE(StepSpecFromProto(r)->memory_released);
  // param_written rides with a step's updates (adopted once the trainer's
  // stream reaches the step).
  auto* t = r.add_buffer_updates()->add_tensors();
  t->set_name("w");
  t->set_param_written(true);
  EXPECT_TRUE(CheckStepOptions(r).ok());
  auto spec = StepSpecFromProto(r);
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_TRUE(spec->buffer_updates[0].second[0].param_written);
}

TEST(ConvertTest, TwoOverridesOfOneGroupAreRefused) {
  v1::StepRequest r;
  r.add_overrides()->set_group_id("g");
  r.add_overrides()->set_group_id("h");
  ASSERT_TRUE(CheckStepOptions(r).ok());
  r.add_overrides()->set_group_id("g");
  // Refused by the check whose outcome Session::Step reports after it
  // released the step's flags (StepRequestSpec::refused).
  ASSERT_TRUE(StepSpecFromProto(r).ok());
  absl::Status s = CheckStepOptions(r);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("'g' twice"), absl::string_view::npos) << s;
}

}  // namespace
}  // namespace optimd
