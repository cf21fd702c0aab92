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

// What a steppable tensor adds in its group's plan (pointers, layout,
// indexes, its item and task) and in what a backend keeps per plan entry
// beside it: about 550 bytes measured on the CPU backend with one-element
// tensors (bench/RESULTS.md, 2026-12-07), rounded up.
constexpr uint64_t kPlanEntryBytes = 576;
// Per tensor, what the allocator and the hash tables add around the above
// (chunk headers, buckets): about 115 bytes measured, rounded up.
constexpr uint64_t kTensorSlackBytes = 128;

}  // namespace

uint64_t TensorMetadataBytes(const TensorSpec& t) {
  uint64_t bytes =
      sizeof(TensorEntry) + StringBytes(t.name) - sizeof(std::string);
  if (t.numel > 0 && !t.frozen) bytes += kPlanEntryBytes;
  bytes += 2 * (kIndexNodeBytes + StringBytes(t.name));  // name set, index
  for (const std::string& a : t.aliases) {
    bytes += StringBytes(a);                    // the entry's copy
    bytes += kIndexNodeBytes + StringBytes(a);  // the session's alias set
  }
  // Shapes: measured at about one and a half times their elements' bytes
  // (the entry's copy and the allocations around it).
  bytes += 3 * sizeof(uint64_t) *
           (t.shape.size() + t.global_shape.size() + t.global_offset.size()) /
           2;
  bytes += kTensorSlackBytes;
  return bytes;
}

uint64_t GroupMetadataBytes(const GroupSpec& spec) {
  uint64_t bytes = sizeof(Group) + StringBytes(spec.id);
  for (const TensorSpec& t : spec.tensors) bytes += TensorMetadataBytes(t);
  return bytes;
}

}  // namespace optimd
