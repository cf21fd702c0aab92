#include "common/stale_files.h"

#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace optimd {
namespace {

// A pid that was a process a moment ago and is gone now.
long DeadPid() {
  const pid_t child = fork();
  if (child == 0) _exit(0);
  waitpid(child, nullptr, 0);
  return child;
}

bool Exists(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0;
}

void Touch(const std::string& path) { std::ofstream(path) << "x"; }

TEST(StaleFilesTest, NamesOfBothClients) {
  long pid = 0;
  EXPECT_TRUE(ParseSegmentName("optimd-py-1234-0a1b2c3d4e5f", &pid));
  EXPECT_EQ(pid, 1234);
  EXPECT_TRUE(ParseSegmentName("optimd-77-123456-0", &pid));
  EXPECT_EQ(pid, 77);
  for (const char* other :
       {"optimd-py-12-XYZ", "optimd-py--ab", "optimd-fuzz-params",
        "optimd-py-12-ab-c", "optimd-1-2", "sem.optimd-py-1-ab",
        "optimd-py-0-ab", "optimd-1234567890-1-1", "other"}) {
    EXPECT_FALSE(ParseSegmentName(other, &pid)) << other;
  }
}

TEST(StaleFilesTest, RemovesOnlyDeadCreatorsSegments) {
  char tmpl[] = "/tmp/optimd-segments-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  const long dead = DeadPid();
  const std::string gone_py = absl::StrCat(dir, "/optimd-py-", dead, "-ab12");
  const std::string gone_cc = absl::StrCat(dir, "/optimd-", dead, "-9-0");
  const std::string live =
      absl::StrCat(dir, "/optimd-py-", getppid(), "-cd34");  // our parent
  const std::string mine = absl::StrCat(dir, "/optimd-", getpid(), "-1-2");
  const std::string other = absl::StrCat(dir, "/notes-", dead);
  const std::string gone_dir = absl::StrCat(dir, "/optimd-py-", dead, "-ef");
  for (const std::string& f : {gone_py, gone_cc, live, mine, other}) Touch(f);
  ASSERT_EQ(mkdir(gone_dir.c_str(), 0700), 0);
  EXPECT_EQ(RemoveStaleSegments(dir), 2);
  EXPECT_FALSE(Exists(gone_py));
  EXPECT_FALSE(Exists(gone_cc));
  for (const std::string& kept : {live, mine, other, gone_dir}) {
    EXPECT_TRUE(Exists(kept)) << kept;
  }
  EXPECT_EQ(RemoveStaleSegments(dir + "/missing"), 0);
  for (const std::string& f : {live, mine, other}) unlink(f.c_str());
  rmdir(gone_dir.c_str());
  rmdir(dir.c_str());
}

}  // namespace
}  // namespace optimd
