#include "core/tensor_aliases.h"

#include "absl/strings/str_cat.h"

namespace optimd {
namespace {

// The first 64 bytes of a name, for messages about names too long to quote.
std::string Start(const std::string& name) { return name.substr(0, 64); }

absl::Status Refuse(const std::string& group_id, const TensorSpec& t,
                    const std::string& alias, const std::string& problem) {
  return absl::InvalidArgumentError(
      absl::StrCat("group '", group_id, "': alias '", Start(alias),
                   "' of tensor '", t.name, "' ", problem));
}

}  // namespace

absl::Status CheckNameIsNoAlias(const std::string& group_id,
                                const std::string& name,
                                const NameTable& taken) {
  if (taken.group_aliases.count(name) == 0 &&
      taken.session_aliases->count(name) == 0) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(
      absl::StrCat("group '", group_id, "': tensor name '", name,
                   "' is already an alias of another tensor in this session; "
                   "a name may belong to one tensor only"));
}

absl::Status CheckAliases(const std::string& group_id, const TensorSpec& t,
                          NameTable* taken) {
  if (t.aliases.size() > kMaxAliasesPerTensor) {
    return absl::InvalidArgumentError(absl::StrCat(
        "group '", group_id, "': tensor '", t.name, "' has ", t.aliases.size(),
        " aliases; at most ", kMaxAliasesPerTensor, " are allowed"));
  }
  for (const std::string& alias : t.aliases) {
    if (alias.empty()) return Refuse(group_id, t, alias, "is empty");
    if (alias.size() > kMaxNameBytes) {
      return Refuse(group_id, t, alias,
                    absl::StrCat("is ", alias.size(), " bytes, longer than ",
                                 kMaxNameBytes));
    }
    if (alias == t.name) {
      return Refuse(group_id, t, alias, "is the tensor's own name");
    }
    if (taken->group_names.count(alias) > 0 ||
        taken->session_names->count(alias) > 0) {
      return Refuse(group_id, t, alias,
                    "is another tensor's name in this session");
    }
    if (!taken->group_aliases.insert(alias).second ||
        taken->session_aliases->count(alias) > 0) {
      return Refuse(group_id, t, alias,
                    "is already an alias (of this or another tensor) in "
                    "this session");
    }
  }
  return absl::OkStatus();
}

}  // namespace optimd
