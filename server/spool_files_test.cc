#include "server/spool_files.h"

#include <gtest/gtest.h>

#include <cerrno>
#include <utility>
#include <vector>

namespace optimd {
namespace {

TEST(SpoolFilesTest, EveryErrorHasASpecificCodeNamingTheDirectory) {
  const std::vector<std::pair<int, absl::StatusCode>> cases = {
      {ENOSPC, absl::StatusCode::kResourceExhausted},
      {EDQUOT, absl::StatusCode::kResourceExhausted},
      {EFBIG, absl::StatusCode::kResourceExhausted},
      {EMFILE, absl::StatusCode::kResourceExhausted},
      {ENFILE, absl::StatusCode::kResourceExhausted},
      {EACCES, absl::StatusCode::kPermissionDenied},
      {EPERM, absl::StatusCode::kPermissionDenied},
      {ENOENT, absl::StatusCode::kFailedPrecondition},
      {ENOTDIR, absl::StatusCode::kFailedPrecondition},
      {EROFS, absl::StatusCode::kFailedPrecondition},
      {EIO, absl::StatusCode::kUnavailable},
      {EINVAL, absl::StatusCode::kFailedPrecondition},
  };
  for (const auto& [err, code] : cases) {
    const absl::Status s = SpoolFileError(err, "writing", "/srv/ckpt");
    EXPECT_EQ(s.code(), code) << err << ": " << s;
    EXPECT_NE(s.message().find("writing the spool file"), std::string::npos)
        << s;
    EXPECT_NE(s.message().find("/srv/ckpt"), std::string::npos) << s;
    EXPECT_NE(s.message().find("nothing was loaded"), std::string::npos) << s;
    EXPECT_NE(s.code(), absl::StatusCode::kInternal);
  }
}

}  // namespace
}  // namespace optimd
