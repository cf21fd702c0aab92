#include "core/state_shard.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "core/dtype.h"

namespace optimd {
namespace {

// Session::CheckTensor's limit on a tensor's element count.
constexpr uint64_t kMaxWholeNumel = uint64_t{1} << 48;

// floor(total * part / parts) without overflow.
uint64_t Boundary(uint64_t total, uint32_t part, uint32_t parts) {
  return static_cast<uint64_t>(static_cast<unsigned __int128>(total) * part /
                               parts);
}

absl::Status CheckWholeRegion(const TensorSpec& t, const char* which,
                              const BufferHandle& h, DType dtype) {
  const uint64_t want = t.numel * DTypeSize(dtype);
  if (h.kind == BufferHandle::Kind::kNone || h.size == want) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "tensor '", t.name, "': ", which, " buffer is ", h.size,
      " bytes but numel x element size is ", want,
      " (with shard_state every rank registers its whole tensors; the "
      "daemon keeps state for this rank's part)"));
}

}  // namespace

std::vector<ShardRange> PartitionGroup(const std::vector<uint64_t>& numels,
                                       uint32_t rank, uint32_t world_size) {
  uint64_t total = 0;
  for (uint64_t n : numels) total += n;
  const uint64_t lo = Boundary(total, rank, world_size);
  const uint64_t hi = Boundary(total, rank + 1, world_size);
  std::vector<ShardRange> out(numels.size());
  uint64_t start = 0;  // the tensor's first element in the flat space
  for (size_t i = 0; i < numels.size(); ++i) {
    const uint64_t end = start + numels[i];
    const uint64_t b = std::max(start, lo), e = std::min(end, hi);
    if (b < e) out[i] = ShardRange{b - start, e - b};
    start = end;
  }
  return out;
}

std::vector<OwnedPart> PartitionAll(const std::vector<uint64_t>& numels,
                                    uint32_t world_size) {
  uint64_t total = 0;
  for (uint64_t n : numels) total += n;
  std::vector<OwnedPart> out;
  size_t i = 0;        // the tensor holding the flat element `at`
  uint64_t start = 0;  // that tensor's first flat element
  for (uint32_t r = 0; r < world_size; ++r) {
    uint64_t at = Boundary(total, r, world_size);
    const uint64_t hi = Boundary(total, r + 1, world_size);
    while (at < hi) {
      while (start + numels[i] <= at) start += numels[i++];
      const uint64_t end = std::min(start + numels[i], hi);
      out.push_back(OwnedPart{r, static_cast<uint32_t>(i),
                              ShardRange{at - start, end - at}});
      at = end;
    }
  }
  return out;
}

BufferHandle SliceHandle(const BufferHandle& full, ShardRange range,
                         uint64_t element_bytes) {
  BufferHandle out = full;
  if (full.kind == BufferHandle::Kind::kNone) return out;
  out.offset = full.offset + range.begin * element_bytes;
  out.size = range.count * element_bytes;
  return out;
}

absl::StatusOr<GroupSpec> ShardGroupSpec(const GroupSpec& spec, uint32_t rank,
                                         uint32_t world_size,
                                         std::vector<ShardRange>* ranges) {
  std::vector<uint64_t> numels;
  numels.reserve(spec.tensors.size());
  for (const TensorSpec& t : spec.tensors) {
    // The whole tensor is held to the limit a session puts on any tensor
    // (Session::CheckTensor sees only this rank's part).
    if (t.numel > kMaxWholeNumel) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor '", t.name, "': numel ", t.numel,
                       " exceeds the limit ", kMaxWholeNumel));
    }
    // An FP8 parameter's scales belong to units of its 2-D view (whole
    // tensor, blocks of rows and columns): a flat part would cut them.
    if (IsFp8(t.param_dtype) || t.fp8_recipe != Fp8Recipe::kNone) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor '", t.name, "': FP8 parameters (", DTypeName(t.param_dtype),
          ") cannot be stepped with shard_state, whose flat parts would cut "
          "their scaling units; register them in a session without "
          "shard_state"));
    }
    if (t.numel > 0) {
      OPTIMD_RETURN_IF_ERROR(
          CheckWholeRegion(t, "param", t.param, t.param_dtype));
      OPTIMD_RETURN_IF_ERROR(CheckWholeRegion(t, "grad", t.grad, t.grad_dtype));
    }
    numels.push_back(t.numel);
  }
  *ranges = PartitionGroup(numels, rank, world_size);
  GroupSpec out = spec;
  for (size_t i = 0; i < out.tensors.size(); ++i) {
    TensorSpec& t = out.tensors[i];
    const ShardRange r = (*ranges)[i];
    t.shape.clear();
    if (t.numel == 0) continue;  // its own checks refuse bad regions
    t.numel = r.count;
    t.param = SliceHandle(t.param, r, DTypeSize(t.param_dtype));
    t.grad = SliceHandle(t.grad, r, DTypeSize(t.grad_dtype));
  }
  return out;
}

ParamPieces UpdatedParamPieces(const std::vector<Group*>& groups) {
  ParamPieces out;
  for (uint32_t gi = 0; gi < groups.size(); ++gi) {
    const Group& g = *groups[gi];
    for (uint32_t k = 0; k < g.plan.entries.size(); ++k) {
      if (g.plan.entries[k].grad == nullptr) continue;  // not stepped
      const uint32_t ti = g.plan.tensor_index[k];
      const TensorEntry& t = g.tensors[ti];
      if (!t.sharded) continue;
      const uint64_t size = DTypeSize(t.layout.param_dtype);
      out.push_back(ParamPiece{gi, ti, t.shard_begin * size, t.numel * size,
                               t.param.data});
    }
  }
  return out;
}

absl::StatusOr<uint8_t*> PieceTarget(const std::vector<Group*>& groups,
                                     const ParamPiece& piece) {
  const TensorEntry* t = nullptr;
  if (piece.group < groups.size() &&
      piece.tensor < groups[piece.group]->tensors.size()) {
    t = &groups[piece.group]->tensors[piece.tensor];
  }
  if (t == nullptr || !t->sharded || t->full_param.data == nullptr ||
      piece.offset > t->full_param.size ||
      piece.bytes > t->full_param.size - piece.offset) {
    return absl::FailedPreconditionError(absl::StrCat(
        "another rank updated bytes [", piece.offset, ", ",
        piece.offset + piece.bytes, ") of tensor ", piece.tensor, " of group ",
        piece.group,
        ", which this rank does not have: with shard_state every rank must "
        "register the same groups and tensors in the same order"));
  }
  return t->full_param.data + piece.offset;
}

}  // namespace optimd
