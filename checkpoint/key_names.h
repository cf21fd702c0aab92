// Tensor names as checkpoints need them: a checkpoint keys a tensor's
// parameter by its name and each piece of its state by its name plus a
// suffix (checkpoint.h: ".master", ".remainder", ".moment_scales", "." and
// a state slot's name), beside the safetensors header's own key
// "__metadata__". Names whose keys would collide are refused when a group
// registers (the daemon installs CheckCheckpointKeys as its sessions'
// tensor-name rule, core/session.h), so that every session can be saved
// and loaded back. Thread-safe.
#ifndef OPTIMD_CHECKPOINT_KEY_NAMES_H_
#define OPTIMD_CHECKPOINT_KEY_NAMES_H_

#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace optimd {

// The suffixes of state keys, every optimizer's slots included, so that a
// name stays valid whatever optimizer a later group uses.
const std::vector<std::string>& CheckpointKeySuffixes();

// INVALID_ARGUMENT, naming both, when a name of `fresh` (a new group's
// names) and a name of `fresh` or `registered` (the session's) would
// collide in checkpoints (`w` and `w.exp_avg`: one's moment would load as
// the other's parameter), or when `fresh` holds "__metadata__".
absl::Status CheckCheckpointKeys(const std::set<std::string>& fresh,
                                 const std::set<std::string>& registered);

}  // namespace optimd

#endif  // OPTIMD_CHECKPOINT_KEY_NAMES_H_
