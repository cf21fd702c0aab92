// The daemon's version, and the revision of the v1 API it speaks. The API
// revision grows whenever the daemon adds something a client may depend on
// (a field, an RPC, a meaning); a client refuses a daemon whose revision is
// below the one it needs, naming both versions.
#ifndef OPTIMD_COMMON_VERSION_H_
#define OPTIMD_COMMON_VERSION_H_

#include <cstdint>

namespace optimd {

inline constexpr char kVersion[] = "0.5.0";
// 2: step flags, absent gradients, tensor steps and shapes, EvictSession,
//    saved sessions across restarts.
// 3: staged steps (StepRequest.staged, TensorSpec.stage), resume secrets.
// 4: optimizers (Hyperparameters.optimizer: SGD and Lion beside AdamW),
//    GroupOverride.momentum; CreateSessionRequest.gradient_sharding (ranks
//    agree on the gradient norm and skip, CPU backend).
// 5: gradient_sharding on CUDA through NCCL (nccl_unique_id).
// 6: TensorSpec.aliases (the other names of a tied weight).
// 7: DTYPE_FLOAT64 parameters, gradients and moments (AdamW).
// 8: CreateSessionRequest.shard_state (ZeRO-sharded state for DDP jobs).
// 9: FP8 parameters (DTYPE_FLOAT8_E4M3FN, DTYPE_FLOAT8_E5M2,
//    TensorSpec.fp8_recipe and scale_inv).
// 10: DTYPE_FLOAT64 parameters for SGD and Lion.
// 11: TensorSpec.global_shape and global_offset (shards in checkpoints).
// 12: TensorBuffers.param_written in a step's buffer_updates;
//     GetMetricsResponse.worker_tasks.
inline constexpr uint32_t kApiRevision = 12;

// The initial-metadata keys under which every reply of the daemon carries
// kVersion and kApiRevision (as decimal text): the grpc.health.v1 Check's
// message has no room for them.
inline constexpr char kVersionMetadataKey[] = "optimd-version";
inline constexpr char kApiRevisionMetadataKey[] = "optimd-api-revision";

}  // namespace optimd

#endif  // OPTIMD_COMMON_VERSION_H_
