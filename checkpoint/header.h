// The safetensors header of a checkpoint (checkpoint/checkpoint.h): the
// pieces of state a session's groups hold and where they lie in the file,
// the header JSON written for them (header.cc), and the checks of a header
// read back, every field of an untrusted header checked before use
// (header_parse.cc). Internal to the writer, snapshots and the loader of
// this package.
//
// Thread-compatible: the functions share no state.
#ifndef OPTIMD_CHECKPOINT_HEADER_H_
#define OPTIMD_CHECKPOINT_HEADER_H_

#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/group.h"
#include "nlohmann/json.hpp"

namespace optimd {
namespace checkpoint_header {

using nlohmann::json;

// One piece of state (one tensor's parameter, master or moment) and where
// it lies in the file. Pieces with the same `key`, consecutive in the
// file, form one safetensors tensor: each piece alone in the per-tensor
// format (key "<name>.exp_avg"), all pieces of one kind and dtype of a
// group together in the packed format (key "g<group>.<kind>.<dtype>").
struct Entry {
  std::string name;   // "<tensor><suffix>", in messages and version 1 keys
  std::string dtype;  // safetensors dtype
  uint64_t numel = 0;
  uint64_t bytes = 0;
  uint8_t* data = nullptr;  // backend memory
  uint64_t offset = 0;      // within the data section
  // The crc32c of the file tensor's bytes up to the end of this piece: the
  // whole file tensor's at its last piece.
  uint32_t crc = 0;
  uint32_t group = 0;
  const char* kind = "";        // param, master, remainder, exp_avg, ...
  int block8_slot = -1;         // the state slot of block8 codes; -1 otherwise
  std::string key;              // the safetensors tensor the piece belongs to
  std::vector<uint64_t> shape;  // the tensor's; empty: [numel]
};

// Every piece of the groups, in tensor order, without offsets or keys.
std::vector<Entry> Entries(const std::vector<Group*>& groups);

// Orders the pieces as the file holds them and sets their keys and
// offsets: tensor order with one key per piece, or (packed) grouped by
// group, kind and dtype, tensor order within each.
void Arrange(std::vector<Entry>& entries, bool packed);

// True when piece `i` starts (ends) its file tensor.
bool RunStarts(const std::vector<Entry>& e, size_t i);
bool RunEnds(const std::vector<Entry>& e, size_t i);

// Whether a save uses the packed format: when the per-tensor header could
// come near `threshold` bytes (an estimate that errs high).
bool UsePacked(const std::vector<Entry>& entries,
               const std::vector<Group*>& groups, uint64_t threshold);

// The "optimd" metadata of a save of `groups` (format version, groups,
// hyperparameters, tensors, layouts; the job id for the record).
json MetaJson(const std::vector<Group*>& groups, bool packed,
              const std::string& job_id);

// The whole safetensors header text for `meta` and the arranged pieces
// (their checksums already computed).
std::string HeaderJson(json meta, const std::vector<Entry>& entries);

// RESOURCE_EXHAUSTED when `header` is past the safetensors header limit.
absl::Status CheckHeaderSize(const std::string& header);

// A layout as the header describes it (what a load compares).
json LayoutJson(const Layout& layout);

// A group's step counter and hyperparameters as its header says, checked.
struct GroupHeader {
  uint64_t step = 0;
  OptimizerHyper hyper;
  // Per tensor of the group, its missed steps (TensorEntry::missed_steps).
  std::vector<uint64_t> missed;
  // Per tensor of the group, the aliases the file lists for it (none in
  // files written before aliases existed). Informational: a load keeps
  // the aliases the session registered.
  std::vector<std::vector<std::string>> aliases;
};

// Parses and checks a whole header against the registered groups, setting
// the entries' offsets and checksums. Changes no state.
absl::StatusOr<std::vector<GroupHeader>> ParseHeader(
    const std::string& header, const std::vector<Group*>& groups,
    std::vector<Entry>& entries, uint64_t data_bytes, const std::string& path);

}  // namespace checkpoint_header
}  // namespace optimd

#endif  // OPTIMD_CHECKPOINT_HEADER_H_
