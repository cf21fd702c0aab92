// ZeRO-sharded optimizer state (CreateSessionRequest.shard_state): which
// elements of a group's tensors one rank of a job keeps state for.
//
// The partition: a group's tensors, in registration order, are laid end to
// end into one flat element space of T elements (every tensor, frozen and
// empty ones included). Rank r of N owns the contiguous range
// [floor(T * r / N), floor(T * (r + 1) / N)): ranges differ in size by at
// most one element, and a tensor that crosses a boundary is split between
// ranks. Every rank computes the same partition from the same
// registration, so the ranks of a job must register the same tensors
// (names, element counts, order) in the same groups.
//
// Pure functions; thread-safe.
#ifndef OPTIMD_CORE_STATE_SHARD_H_
#define OPTIMD_CORE_STATE_SHARD_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "core/buffer.h"
#include "core/group.h"
#include "core/rank_exchange.h"

namespace optimd {

// One tensor's part of a rank's range: elements [begin, begin + count).
struct ShardRange {
  uint64_t begin = 0;
  uint64_t count = 0;
};

// Per tensor of `numels` (a group's tensors in order), the part rank
// `rank` of `world_size` (> rank) owns; count 0 where it owns none.
std::vector<ShardRange> PartitionGroup(const std::vector<uint64_t>& numels,
                                       uint32_t rank, uint32_t world_size);

// Every rank's parts at once, in the order of (rank, tensor): the same
// parts as PartitionGroup gives each rank, with their rank and tensor
// index, in time linear in tensors + world_size.
struct OwnedPart {
  uint32_t rank = 0;
  uint32_t tensor = 0;
  ShardRange range;
};
std::vector<OwnedPart> PartitionAll(const std::vector<uint64_t>& numels,
                                    uint32_t world_size);

// `full` narrowed to elements [range.begin, range.begin + range.count) of
// `element_bytes` each; a handle of kind kNone stays as it is.
BufferHandle SliceHandle(const BufferHandle& full, ShardRange range,
                         uint64_t element_bytes);

// A group as rank `rank` of `world_size` keeps it: each tensor narrowed to
// its part (numel, param and grad regions; the shape dropped, so that
// checkpoints hold 1-D slices). First checks that every region is the
// whole tensor's and that no tensor is an FP8 parameter, whose scaling
// units a part would cut (INVALID_ARGUMENT naming it otherwise). *ranges
// receives each tensor's part.
absl::StatusOr<GroupSpec> ShardGroupSpec(const GroupSpec& spec, uint32_t rank,
                                         uint32_t world_size,
                                         std::vector<ShardRange>* ranges);

// The parts of `groups` (a session's, in registration order) that a step
// of this rank updated: every stepped plan entry of a sharded tensor, as
// byte ranges of the whole tensor.
ParamPieces UpdatedParamPieces(const std::vector<Group*>& groups);

// Where `piece` of another rank lands in this rank's `groups`: the byte
// range of the tensor's whole parameter; FAILED_PRECONDITION when the
// ranks' registrations differ (no such group or tensor, or the range
// falls outside it).
absl::StatusOr<uint8_t*> PieceTarget(const std::vector<Group*>& groups,
                                     const ParamPiece& piece);

}  // namespace optimd

#endif  // OPTIMD_CORE_STATE_SHARD_H_
