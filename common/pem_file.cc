#include "common/pem_file.h"

#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"

namespace optimd {

absl::StatusOr<std::string> ReadPemFile(const std::string& what,
                                        const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::NotFoundError(
        absl::StrCat("cannot read the ", what, " file ", path));
  }
  std::ostringstream text;
  text << in.rdbuf();
  if (text.str().find("-----BEGIN") == std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("the ", what, " file ", path, " is not PEM"));
  }
  return text.str();
}

}  // namespace optimd
