#include "server/convert.h"

#include <cmath>
#include <optional>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace optimd {

grpc::Status ToGrpcStatus(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  // Messages travel in trailing metadata, which clients refuse past a few
  // KiB; one that quotes a long client-supplied value is cut.
  constexpr size_t kMaxMessageBytes = 4096;
  std::string message(s.message().substr(0, kMaxMessageBytes));
  if (s.message().size() > kMaxMessageBytes) message += " [...]";
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), message);
}

absl::StatusOr<DType> DTypeFromProto(v1::DType d, const std::string& what) {
  switch (d) {
    case v1::DTYPE_FLOAT32:
      return DType::kFloat32;
    case v1::DTYPE_BFLOAT16:
      return DType::kBFloat16;
    case v1::DTYPE_FLOAT16:
      return DType::kFloat16;
    case v1::DTYPE_FLOAT64:
      return DType::kFloat64;
    case v1::DTYPE_BLOCK8:
      return absl::InvalidArgumentError(
          absl::StrCat(what,
                       ": DTYPE_BLOCK8 is for optimizer state only "
                       "(LayoutOptions.moment_dtype)"));
    case v1::DTYPE_FLOAT8_E4M3FN:  // parameters only: ResolveFp8Recipe
      return DType::kFloat8E4M3;
    case v1::DTYPE_FLOAT8_E5M2:
      return DType::kFloat8E5M2;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": unsupported dtype ", static_cast<int>(d),
                       " (use DTYPE_FLOAT32, DTYPE_BFLOAT16, DTYPE_FLOAT16, "
                       "DTYPE_FLOAT64 or, for parameters, DTYPE_FLOAT8_E4M3FN "
                       "or DTYPE_FLOAT8_E5M2)"));
  }
}

v1::DType DTypeToProto(DType d) {
  switch (d) {
    case DType::kFloat32:
      return v1::DTYPE_FLOAT32;
    case DType::kBFloat16:
      return v1::DTYPE_BFLOAT16;
    case DType::kFloat16:
      return v1::DTYPE_FLOAT16;
    case DType::kBlock8:
      return v1::DTYPE_BLOCK8;
    case DType::kFloat64:
      return v1::DTYPE_FLOAT64;
    case DType::kFloat8E4M3:
      return v1::DTYPE_FLOAT8_E4M3FN;
    case DType::kFloat8E5M2:
      return v1::DTYPE_FLOAT8_E5M2;
  }
  return v1::DTYPE_UNSPECIFIED;
}

BufferHandle BufferHandleFromProto(const v1::BufferHandle& h) {
  BufferHandle out;
  switch (h.location_case()) {
    case v1::BufferHandle::kSharedMemory:
      out.kind = BufferHandle::Kind::kSharedMemory;
      out.segment_name = h.shared_memory().segment_name();
      out.offset = h.shared_memory().offset();
      out.size = h.shared_memory().size();
      break;
    case v1::BufferHandle::kCudaIpc:
      out.kind = BufferHandle::Kind::kCudaIpc;
      out.ipc_handle = h.cuda_ipc().ipc_handle();
      out.device = h.cuda_ipc().device();
      out.offset = h.cuda_ipc().offset();
      out.size = h.cuda_ipc().size();
      break;
    case v1::BufferHandle::kCudaVmm:
      out.kind = BufferHandle::Kind::kCudaVmm;
      out.device = h.cuda_vmm().device();
      out.offset = h.cuda_vmm().offset();
      out.size = h.cuda_vmm().size();
      // Bounded by the request's size; the backend refuses past 65536.
      out.vmm_chunks.reserve(h.cuda_vmm().chunks_size());
      for (const v1::CudaVmmChunk& c : h.cuda_vmm().chunks()) {
        out.vmm_chunks.push_back(VmmChunk{c.fd_id(), c.size()});
      }
      break;
    default:
      break;
  }
  return out;
}

namespace {

// The API numbers each optimizer as core/optimizer.h does, plus 1; its
// UNSPECIFIED (0) is read as AdamW, the default.
static_assert(v1::OPTIMIZER_KIND_ADAMW ==
                  static_cast<int>(OptimizerKind::kAdamW) + 1,
              "the API's optimizer numbers are the daemon's plus 1");

// The daemon's kind of the API's `proto`, or nullopt for a kind this
// daemon does not know (an open enum carries any number).
std::optional<OptimizerKind> KindFromProto(int proto) {
  if (proto == v1::OPTIMIZER_KIND_UNSPECIFIED) return OptimizerKind::kAdamW;
  if (proto < 0) return std::nullopt;
  return OptimizerFromNumber(proto - 1);
}

// A group's hyperparameters; INVALID_ARGUMENT for an unknown optimizer or
// Adam mode (the values themselves are checked by the session).
absl::StatusOr<OptimizerHyper> HyperFromProto(const v1::Hyperparameters& h,
                                              const std::string& group_id) {
  OptimizerHyper out;
  out.lr = h.lr();
  out.beta1 = h.beta1();
  out.beta2 = h.beta2();
  out.eps = h.eps();
  out.weight_decay = h.weight_decay();
  switch (h.mode()) {
    case v1::ADAM_MODE_UNSPECIFIED:
    case v1::ADAM_MODE_ADAMW:
      out.adamw = true;
      break;
    case v1::ADAM_MODE_ADAM:
      out.adamw = false;
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("group '", group_id, "': unknown adam mode ", h.mode()));
  }
  out.bias_correction = h.has_bias_correction() ? h.bias_correction() : true;
  out.maximize = h.maximize();
  out.amsgrad = h.amsgrad();
  const std::optional<OptimizerKind> kind = KindFromProto(h.optimizer());
  if (!kind.has_value()) {
    return absl::InvalidArgumentError(
        absl::StrCat("group '", group_id, "': unknown optimizer ",
                     h.optimizer(), " (known: ", KnownOptimizerNames(), ")"));
  }
  out.kind = *kind;
  out.momentum = h.momentum();
  out.dampening = h.dampening();
  out.nesterov = h.nesterov();
  return out;
}

}  // namespace

absl::StatusOr<GroupSpec> GroupSpecFromProto(
    const v1::RegisterGroupRequest& request) {
  GroupSpec spec;
  spec.id = request.group_id();
  OPTIMD_ASSIGN_OR_RETURN(spec.hyper,
                          HyperFromProto(request.hyperparameters(), spec.id));
  switch (request.layout().master_weights()) {
    case v1::MASTER_WEIGHTS_UNSPECIFIED:
      spec.master = MasterRequest::kDefault;
      break;
    case v1::MASTER_WEIGHTS_NONE:
      spec.master = MasterRequest::kNone;
      break;
    case v1::MASTER_WEIGHTS_FP32:
      spec.master = MasterRequest::kFp32;
      break;
    case v1::MASTER_WEIGHTS_REMAINDER:
      spec.master = MasterRequest::kRemainder;
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("group '", spec.id, "': unknown master_weights ",
                       request.layout().master_weights()));
  }
  if (request.layout().moment_dtype() == v1::DTYPE_UNSPECIFIED) {
    spec.moment_dtype = DType::kFloat32;
    spec.moment_dtype_default = true;
  } else if (request.layout().moment_dtype() == v1::DTYPE_BLOCK8) {
    spec.moment_dtype = DType::kBlock8;  // checked by ResolveLayout
  } else {
    auto d = DTypeFromProto(request.layout().moment_dtype(),
                            absl::StrCat("group '", spec.id, "' moments"));
    if (!d.ok()) return d.status();
    spec.moment_dtype = *d;
  }
  for (const v1::TensorSpec& t : request.tensors()) {
    TensorSpec ts;
    ts.name = t.name();
    ts.numel = t.numel();
    const std::string what = absl::StrCat("tensor '", t.name(), "'");
    if (t.param_dtype() != v1::DTYPE_UNSPECIFIED) {
      auto d = DTypeFromProto(t.param_dtype(), what + " param");
      if (!d.ok()) return d.status();
      ts.param_dtype = *d;
      ts.param_dtype_set = true;
    }
    if (t.grad_dtype() != v1::DTYPE_UNSPECIFIED) {
      auto d = DTypeFromProto(t.grad_dtype(), what + " grad");
      if (!d.ok()) return d.status();
      ts.grad_dtype = *d;
      ts.grad_dtype_set = true;
    }
    ts.param = BufferHandleFromProto(t.param());
    ts.grad = BufferHandleFromProto(t.grad());
    ts.keep_fp32 = t.keep_fp32();
    ts.frozen = t.frozen();
    ts.grad_absent = t.grad_absent();
    ts.shape.assign(t.shape().begin(), t.shape().end());
    ts.stage = t.stage();
    ts.aliases.assign(t.aliases().begin(), t.aliases().end());
    ts.global_shape.assign(t.global_shape().begin(), t.global_shape().end());
    ts.global_offset.assign(t.global_offset().begin(), t.global_offset().end());
    if (t.fp8_recipe() < v1::FP8_RECIPE_UNSPECIFIED ||
        t.fp8_recipe() > v1::FP8_RECIPE_MXFP8) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": unknown fp8_recipe ", static_cast<int>(t.fp8_recipe())));
    }
    ts.fp8_recipe = static_cast<Fp8Recipe>(t.fp8_recipe());
    ts.scale_inv = BufferHandleFromProto(t.scale_inv());
    spec.tensors.push_back(std::move(ts));
  }
  return spec;
}

absl::StatusOr<std::vector<BufferUpdate>> BufferUpdatesFromProto(
    const v1::UpdateBuffersRequest& request) {
  std::vector<BufferUpdate> out;
  for (const v1::TensorBuffers& t : request.tensors()) {
    BufferUpdate u;
    u.tensor = t.name();
    u.param = BufferHandleFromProto(t.param());
    u.grad = BufferHandleFromProto(t.grad());
    u.grad_absent = t.grad_absent();
    u.param_written = t.param_written();
    out.push_back(std::move(u));
  }
  return out;
}

absl::StatusOr<StepRequestSpec> StepSpecFromProto(
    const v1::StepRequest& request) {
  StepRequestSpec spec;
  for (const v1::UpdateBuffersRequest& u : request.buffer_updates()) {
    auto updates = BufferUpdatesFromProto(u);
    if (!updates.ok()) return updates.status();
    spec.buffer_updates.emplace_back(u.group_id(), *std::move(updates));
  }
  spec.step_flags = BufferHandleFromProto(request.step_flags());
  spec.sequence = request.sequence();
  spec.step = request.step();
  spec.memory_released = request.memory_released();
  for (const auto& o : request.overrides()) {
    HyperOverride h;
    h.group_id = o.group_id();
    h.keep_lr = !o.has_lr();
    h.lr = o.lr();
    if (o.has_beta1()) h.beta1 = o.beta1();
    if (o.has_beta2()) h.beta2 = o.beta2();
    if (o.has_eps()) h.eps = o.eps();
    if (o.has_weight_decay()) h.weight_decay = o.weight_decay();
    if (o.has_momentum()) h.momentum = o.momentum();
    spec.overrides.push_back(std::move(h));
  }
  spec.options.grad_scale =
      request.grad_scale() == 0 ? 1.0 : request.grad_scale();
  spec.options.max_grad_norm = request.max_grad_norm();
  spec.options.wait = request.wait();
  spec.options.assume_finite = request.assume_finite();
  spec.options.staged = request.staged();
  return spec;
}

absl::Status CheckStepOptions(const v1::StepRequest& request) {
  absl::flat_hash_set<absl::string_view> overridden;
  for (const auto& o : request.overrides()) {
    // Two for one group would leave which one applies to their order.
    if (!overridden.insert(o.group_id()).second) {
      return absl::InvalidArgumentError(absl::StrCat(
          "StepRequest.overrides names group '", o.group_id().substr(0, 200),
          "' twice; send one GroupOverride per group"));
    }
  }
  const double scale = request.grad_scale();
  if (scale == 0) return absl::OkStatus();
  if (!std::isnormal(scale) || scale < 0 ||
      !std::isnormal(static_cast<float>(1.0 / scale))) {
    return absl::InvalidArgumentError(absl::StrCat(
        "grad_scale must be 0 (none) or a positive number from about "
        "2.9e-39 to 8.5e37 (its reciprocal scales gradients in fp32), got ",
        scale));
  }
  return absl::OkStatus();
}

void HyperToProto(const OptimizerHyper& h, v1::Hyperparameters* out) {
  out->set_lr(h.lr);
  out->set_beta1(h.beta1);
  out->set_beta2(h.beta2);
  out->set_eps(h.eps);
  out->set_weight_decay(h.weight_decay);
  out->set_mode(h.adamw ? v1::ADAM_MODE_ADAMW : v1::ADAM_MODE_ADAM);
  out->set_bias_correction(h.bias_correction);
  out->set_maximize(h.maximize);
  out->set_amsgrad(h.amsgrad);
  out->set_optimizer(
      static_cast<v1::OptimizerKind>(static_cast<int>(h.kind) + 1));
  out->set_momentum(h.momentum);
  out->set_dampening(h.dampening);
  out->set_nesterov(h.nesterov);
}

void GroupStateToProto(const GroupState& g, v1::GroupState* out) {
  out->set_group_id(g.id);
  out->set_step(g.step);
  HyperToProto(g.hyper, out->mutable_hyperparameters());
  for (const StateBlob& b : g.tensors) {
    auto* t = out->add_tensors();
    t->set_tensor(b.tensor);
    t->set_kind(b.kind);
    t->set_dtype(DTypeToProto(b.dtype));
    t->set_numel(b.numel);
    t->set_data(b.data);
    t->set_step(b.step);
  }
}

absl::StatusOr<std::vector<StateBlob>> StateBlobsFromProto(
    const v1::SetStateRequest& request) {
  std::vector<StateBlob> out;
  for (const v1::StateTensor& t : request.tensors()) {
    StateBlob b;
    b.tensor = t.tensor();
    b.kind = t.kind();
    auto d = DTypeFromProto(
        t.dtype(), absl::StrCat("tensor '", t.tensor(), "' ", t.kind()));
    if (!d.ok()) return d.status();
    b.dtype = *d;
    b.numel = t.numel();
    b.data = t.data();
    out.push_back(std::move(b));
  }
  return out;
}

void SessionInfoToProto(const SessionInfo& info, v1::SessionInfo* out) {
  out->set_job_id(info.identity.job_id);
  out->set_rank(info.identity.rank);
  out->set_world_size(info.identity.world_size);
  out->set_device(info.identity.device);
  for (const auto& id : info.group_ids) out->add_group_ids(id);
  out->set_state_bytes(info.state_bytes);
  out->set_steps(info.steps);
  out->set_skipped_steps(info.skipped_steps);
  out->set_orphaned_since(info.orphaned_since);
}

}  // namespace optimd
