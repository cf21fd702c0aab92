#include "core/metadata_bytes.h"

#include <string>
#include <vector>

namespace optimd {
namespace {

// A node of a hash set or map of strings, with its bucket and allocation
// header (libstdc++ on 64-bit: about this much beyond the string).
constexpr uint64_t kIndexNodeBytes = 64;

uint64_t StringBytes(const std::string& s) {
  // Short strings live in the object itself.
  return sizeof(std::string) + (s.size() > 15 ? s.size() + 1 : 0);
}

}  // namespace

uint64_t TensorMetadataBytes(const TensorSpec& t) {
  uint64_t bytes = sizeof(TensorEntry) + sizeof(PlanItem) +
                   StringBytes(t.name) - sizeof(std::string);
  bytes += 2 * (kIndexNodeBytes + StringBytes(t.name));  // name set, index
  for (const std::string& a : t.aliases) {
    bytes += StringBytes(a);                    // the entry's copy
    bytes += kIndexNodeBytes + StringBytes(a);  // the session's alias set
  }
  bytes += sizeof(uint64_t) *
           (t.shape.size() + t.global_shape.size() + t.global_offset.size());
  return bytes;
}

uint64_t GroupMetadataBytes(const GroupSpec& spec) {
  uint64_t bytes = sizeof(Group) + StringBytes(spec.id);
  for (const TensorSpec& t : spec.tensors) bytes += TensorMetadataBytes(t);
  return bytes;
}

}  // namespace optimd
