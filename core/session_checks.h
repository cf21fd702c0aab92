// The checks of a session's requests that registration, buffer updates and
// steps share (core/session.cc, session_registration.cc,
// session_buffers.cc), and the allocation of a new group's state. Pure
// functions of their arguments, but AllocateGroupState, which allocates
// from the backend. Thread-safe.
#ifndef OPTIMD_CORE_SESSION_CHECKS_H_
#define OPTIMD_CORE_SESSION_CHECKS_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "core/backend.h"
#include "core/group.h"
#include "core/session.h"

namespace optimd {

// Largest element count accepted: keeps numel * 4 * 4 far from overflow.
inline constexpr uint64_t kMaxNumel = uint64_t{1} << 48;
inline constexpr size_t kMaxDims = 64;

// A shape, when given, has at most kMaxDims dimensions whose product is
// the tensor's numel.
absl::Status CheckShape(const TensorSpec& t);

// A shard's global_shape and global_offset (TensorSpec), when given, place
// it inside its whole tensor.
absl::Status CheckShardPlace(const TensorSpec& t);

// A staged step's stage numbers are small: a step launches at least one
// kernel per stage.
absl::Status CheckStage(const TensorSpec& t);

// `h` with the values `o` sets.
OptimizerHyper WithOverride(OptimizerHyper h, const HyperOverride& o);

// The group's hyperparameters' own rules (core/optimizer.h), the group
// named in the message.
absl::Status CheckHyper(const GroupSpec& spec);

// Bounds on a group's id and on how many groups and tensors a session
// holds, so that replies listing them stay far below gRPC's limits.
absl::Status CheckCounts(const GroupSpec& spec, size_t groups, size_t tensors);

// RESOURCE_EXHAUSTED: `group` would bring the session past
// kMaxSessionBytes.
absl::Status TooLarge(const std::string& group);

// A tensor's `which` buffer handle, if given, is of a kind `backend`
// maps: shared memory on the CPU, CUDA IPC or VMM on CUDA.
absl::Status CheckHandleKind(BackendKind backend, const std::string& tensor,
                             const char* which, const BufferHandle& h);

// A tensor's `which` buffer ("param", "grad", "scale_inv") is given and
// exactly `want_bytes` long.
absl::Status CheckRegion(const std::string& tensor, const char* which,
                         const BufferHandle& h, uint64_t want_bytes);

// Resolves `t`'s FP8 recipe into `layout` and checks its scale_inv
// buffer: the recipe's exact size for an FP8 parameter with elements,
// none for any other tensor.
absl::Status CheckFp8(const TensorSpec& t, Layout* layout);

// Lays out each kind of state of `group`'s tensors contiguously (64-byte
// aligned slices) and allocates one arena per kind from `backend`: kind 0
// the masters, kind 1 + s the optimizer's state slot s, the last kind the
// block8 moments' scales.
absl::Status AllocateGroupState(Backend* backend, Group* group);

}  // namespace optimd

#endif  // OPTIMD_CORE_SESSION_CHECKS_H_
