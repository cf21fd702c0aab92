// Conversions between the v1 API messages and core's plain structs, and from
// absl::Status to grpc::Status at the service boundary.
#ifndef OPTIMD_SERVER_CONVERT_H_
#define OPTIMD_SERVER_CONVERT_H_

#include <grpcpp/grpcpp.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/session.h"
#include "optimd/v1/optimd.pb.h"

namespace optimd {

grpc::Status ToGrpcStatus(const absl::Status& s);

// INVALID_ARGUMENT for unknown enum values; `what` names the field.
absl::StatusOr<DType> DTypeFromProto(v1::DType d, const std::string& what);
v1::DType DTypeToProto(DType d);

BufferHandle BufferHandleFromProto(const v1::BufferHandle& h);

absl::StatusOr<GroupSpec> GroupSpecFromProto(
    const v1::RegisterGroupRequest& request);

absl::StatusOr<std::vector<BufferUpdate>> BufferUpdatesFromProto(
    const v1::UpdateBuffersRequest& request);

// An override without `lr` gets keep_lr set (the step keeps the group's
// learning rate).
absl::StatusOr<StepRequestSpec> StepSpecFromProto(
    const v1::StepRequest& request);

// Checks the step-wide options of a request: grad_scale is 0 (none) or a
// normal positive number whose reciprocal, by which the kernels multiply
// gradients in fp32, is a normal fp32 number (about 2.9e-39 to 8.5e37).
absl::Status CheckStepOptions(const v1::StepRequest& request);

void HyperToProto(const OptimizerHyper& h, v1::Hyperparameters* out);
void GroupStateToProto(const GroupState& g, v1::GroupState* out);
absl::StatusOr<std::vector<StateBlob>> StateBlobsFromProto(
    const v1::SetStateRequest& request);

void SessionInfoToProto(const SessionInfo& info, v1::SessionInfo* out);

}  // namespace optimd

#endif  // OPTIMD_SERVER_CONVERT_H_
