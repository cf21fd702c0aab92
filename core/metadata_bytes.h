// What a registered group costs the daemon's host memory besides its state:
// each tensor's entry and name indexes, its name, aliases and shapes, and a
// steppable one's plan entry. An estimate from the request (the containers' own
// overheads approximated per node), counted against --max_metadata_bytes
// (core/state_budget.h) so that names and aliases cannot grow the daemon
// without bound.
#ifndef OPTIMD_CORE_METADATA_BYTES_H_
#define OPTIMD_CORE_METADATA_BYTES_H_

#include <cstdint>

#include "core/group.h"

namespace optimd {

// One tensor's share, as registered (its name kept three times: the entry,
// the session's name set and the group's index).
uint64_t TensorMetadataBytes(const TensorSpec& t);

// The group's whole share: its tensors' plus the group itself.
uint64_t GroupMetadataBytes(const GroupSpec& spec);

}  // namespace optimd

#endif  // OPTIMD_CORE_METADATA_BYTES_H_
