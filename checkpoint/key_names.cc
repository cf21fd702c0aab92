#include "checkpoint/key_names.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/optimizer.h"

namespace optimd {

const std::vector<std::string>& CheckpointKeySuffixes() {
  static const std::vector<std::string>* suffixes = [] {
    auto* out = new std::vector<std::string>{".master", ".remainder",
                                             ".moment_scales", ".scale_inv"};
    for (const std::string& slot : AllStateSlotNames()) {
      out->push_back("." + slot);
    }
    return out;
  }();
  return *suffixes;
}

absl::Status CheckCheckpointKeys(const std::set<std::string>& fresh,
                                 const std::set<std::string>& registered) {
  auto collision = [](const std::string& base, const std::string& suffix) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor names '", base, "' and '", base, suffix,
                     "' collide in checkpoints, where the state of '", base,
                     "' is saved as '", base, suffix, "'; rename one of them"));
  };
  if (fresh.count("__metadata__") > 0) {
    return absl::InvalidArgumentError(
        "the tensor name '__metadata__' is reserved by the checkpoint "
        "format (safetensors); rename the tensor");
  }
  // A new name that ends in a suffix, whose stem is any tensor's name
  // (suffix checks are cheap; lookups only for the rare suffixed names).
  for (const std::string& n : fresh) {
    for (const std::string& suffix : CheckpointKeySuffixes()) {
      if (!absl::EndsWith(n, suffix)) continue;
      const std::string stem = n.substr(0, n.size() - suffix.size());
      if (fresh.count(stem) > 0 || registered.count(stem) > 0) {
        return collision(stem, suffix);
      }
    }
  }
  // A registered name that is a new name plus a suffix.
  if (registered.empty()) return absl::OkStatus();
  for (const std::string& n : fresh) {
    for (const std::string& suffix : CheckpointKeySuffixes()) {
      if (registered.count(n + suffix) > 0) return collision(n, suffix);
    }
  }
  return absl::OkStatus();
}

}  // namespace optimd
