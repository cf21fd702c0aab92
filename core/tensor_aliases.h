// The checks on a tensor's aliases (TensorSpec::aliases): the other names
// of a weight tied between modules (an embedding and an LM head share one
// parameter, which the session registers once). An alias is a name like
// any other: non-empty, at most kMaxNameBytes, and unique across the
// session's tensor names and aliases, so that an export that gives the
// tensor under each of its names never has two tensors under one key.
//
// Thread-compatible: NameTable is used by one registration at a time (the
// session's lock held).
#ifndef OPTIMD_CORE_TENSOR_ALIASES_H_
#define OPTIMD_CORE_TENSOR_ALIASES_H_

#include <set>
#include <string>

#include "absl/status/status.h"
#include "core/group.h"

namespace optimd {

// The names a group being registered may not take: the session's
// registered tensor names and aliases (not owned), and the group's own
// tensor names and aliases so far, which the checks add to.
struct NameTable {
  const std::set<std::string>* session_names = nullptr;
  const std::set<std::string>* session_aliases = nullptr;
  std::set<std::string> group_names;
  std::set<std::string> group_aliases;
};

// INVALID_ARGUMENT when the tensor name `name` is already an alias of the
// session or of the group so far.
absl::Status CheckNameIsNoAlias(const std::string& group_id,
                                const std::string& name,
                                const NameTable& taken);

// Checks the aliases of `t`, whose name is already in taken->group_names:
// at most kMaxAliasesPerTensor, each non-empty, at most kMaxNameBytes,
// neither the tensor's own name nor any tensor name or alias taken, and
// none twice (INVALID_ARGUMENT naming the alias and its tensor); adds them
// to taken->group_aliases.
absl::Status CheckAliases(const std::string& group_id, const TensorSpec& t,
                          NameTable* taken);

}  // namespace optimd

#endif  // OPTIMD_CORE_TENSOR_ALIASES_H_
