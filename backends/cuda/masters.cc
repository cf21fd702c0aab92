#include "backends/cuda/masters.h"

#include <vector>

#include "common/status_macros.h"
#include "core/fp8_quantize.h"
#include "kernels/step_cuda.h"

namespace optimd {
namespace {

absl::Status Fp8MasterFromParam(Backend& backend, const TensorEntry& t) {
  TensorPointers p = t.Pointers();
  std::vector<uint8_t> codes(t.numel), scales(p.fp8.ScaleBytes());
  std::vector<float> master(t.numel);
  OPTIMD_RETURN_IF_ERROR(
      backend.CopyToHost(t.param.data, codes.data(), codes.size()));
  OPTIMD_RETURN_IF_ERROR(
      backend.CopyToHost(t.scale_inv.data, scales.data(), scales.size()));
  p.param = codes.data();
  p.scale_inv = scales.data();
  p.master = master.data();
  DequantizeFp8Range(t.layout.param_dtype, p, 0, t.numel);
  return backend.CopyFromHost(reinterpret_cast<const uint8_t*>(master.data()),
                              t.master.data(), t.numel * 4);
}

absl::Status Fp8ParamFromMaster(Backend& backend, const TensorEntry& t) {
  TensorPointers p = t.Pointers();
  std::vector<uint8_t> codes(t.numel), scales(p.fp8.ScaleBytes());
  std::vector<float> master(t.numel);
  OPTIMD_RETURN_IF_ERROR(backend.CopyToHost(
      t.master.data(), reinterpret_cast<uint8_t*>(master.data()), t.numel * 4));
  p.param = codes.data();
  p.scale_inv = scales.data();
  p.master = master.data();
  QuantizeFp8Range(t.layout.param_dtype, p, 0, t.numel);
  OPTIMD_RETURN_IF_ERROR(
      backend.CopyFromHost(codes.data(), t.param.data, t.numel));
  return backend.CopyFromHost(scales.data(), t.scale_inv.data, scales.size());
}

}  // namespace

absl::Status MastersFromParams(Backend& backend, const Group& group,
                               cudaStream_t stream) {
  for (const TensorEntry& t : group.tensors) {
    if (t.numel > 0 && t.layout.fp8_recipe != Fp8Recipe::kNone) {
      OPTIMD_RETURN_IF_ERROR(Fp8MasterFromParam(backend, t));
    } else if (t.numel > 0 && t.layout.master == MasterKind::kFp32) {
      OPTIMD_RETURN_IF_ERROR(cuda::LaunchConvert(
          t.layout.param_dtype, t.param.data, DType::kFloat32, t.master.data(),
          t.numel, stream));
    }
  }
  return absl::OkStatus();
}

absl::Status ParamsFromMasters(Backend& backend, const Group& group,
                               cudaStream_t stream) {
  for (const TensorEntry& t : group.tensors) {
    if (t.numel > 0 && t.layout.fp8_recipe != Fp8Recipe::kNone) {
      OPTIMD_RETURN_IF_ERROR(Fp8ParamFromMaster(backend, t));
    } else if (t.numel > 0 && t.layout.master == MasterKind::kFp32) {
      OPTIMD_RETURN_IF_ERROR(cuda::LaunchConvert(
          DType::kFloat32, t.master.data(), t.layout.param_dtype, t.param.data,
          t.numel, stream));
    }
  }
  return absl::OkStatus();
}

}  // namespace optimd
