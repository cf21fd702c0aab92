#include "server/admin_guard.h"

#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fstream>
#include <string>

#include "gtest/gtest.h"

namespace optimd {
namespace {

class AdminGuardTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char dir[] = "/tmp/optimd-admin-XXXXXX";
    ASSERT_NE(mkdtemp(dir), nullptr);
    dir_ = dir;
  }
  void TearDown() override {
    unlink(Path().c_str());
    rmdir(dir_.c_str());
  }
  std::string Path() const { return dir_ + "/token"; }
  void Write(const std::string& text, mode_t mode) {
    unlink(Path().c_str());
    std::ofstream(Path()) << text;
    ASSERT_EQ(chmod(Path().c_str(), mode), 0);
  }

  std::string dir_;
};

TEST_F(AdminGuardTest, TokenFileMustBePrivateAndSized) {
  Write("  0123456789abcdef0123\n", 0600);
  auto token = AdminGuard::ReadTokenFile(Path());
  ASSERT_TRUE(token.ok()) << token.status();
  EXPECT_EQ(*token, "0123456789abcdef0123");
  Write("0123456789abcdef0123", 0644);  // others may read it
  EXPECT_EQ(AdminGuard::ReadTokenFile(Path()).status().code(),
            absl::StatusCode::kInvalidArgument);
  Write("short", 0600);
  EXPECT_EQ(AdminGuard::ReadTokenFile(Path()).status().code(),
            absl::StatusCode::kInvalidArgument);
  Write(std::string(300, 'x'), 0600);
  EXPECT_EQ(AdminGuard::ReadTokenFile(Path()).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(AdminGuard::ReadTokenFile(dir_).status().code(),
            absl::StatusCode::kInvalidArgument);  // a directory
  EXPECT_EQ(AdminGuard::ReadTokenFile(dir_ + "/none").status().code(),
            absl::StatusCode::kNotFound);
}

TEST_F(AdminGuardTest, UnixCallersOrTheTokenAreAdmins) {
  const AdminGuard guard("0123456789abcdef", false);
  EXPECT_TRUE(guard.Check("unix:/run/optimd.sock", "", "ListSessions").ok());
  EXPECT_TRUE(guard.Check("ipv4:127.0.0.1:5000", "0123456789abcdef", "X").ok());
  for (const std::string& wrong :
       {std::string(), std::string("0123456789abcde"),
        std::string("0123456789abcdeF")}) {
    const absl::Status s = guard.Check("ipv4:127.0.0.1:5000", wrong, "Evict");
    EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied);
    EXPECT_NE(s.message().find("Evict is an admin call"), std::string::npos);
  }
  // Without a token only Unix callers are admins.
  const AdminGuard none;
  EXPECT_EQ(none.Check("ipv6:[::1]:5000", "", "ListSessions").code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_TRUE(none.Check("unix:/run/optimd.sock", "", "ListSessions").ok());
  // How gRPC names the connections the daemon's Unix socket listener
  // accepts and hands over.
  EXPECT_TRUE(none.Check("fd:12", "", "ListSessions").ok());
  // Verified client certificates do not make a caller an admin.
  const AdminGuard mutual("", true);
  EXPECT_EQ(mutual.Check("ipv4:127.0.0.1:5000", "", "ListSessions").code(),
            absl::StatusCode::kPermissionDenied);
}

// Over TCP a session is opened only by a caller the daemon knows: a
// verified client certificate or the admin token.
TEST_F(AdminGuardTest, SessionsOverTcpNeedAKnownCaller) {
  const std::string tcp = "ipv4:127.0.0.1:5000";
  const AdminGuard none;
  for (const char* unix_peer : {"unix:/run/optimd.sock", "fd:12"}) {
    EXPECT_TRUE(none.CheckSessionCaller(unix_peer, "").ok()) << unix_peer;
  }
  absl::Status s = none.CheckSessionCaller(tcp, "");
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_NE(s.message().find("--tls_client_ca"), std::string::npos) << s;
  EXPECT_NE(s.message().find("has none"), std::string::npos) << s;
  const AdminGuard token("0123456789abcdef", false);
  EXPECT_TRUE(token.CheckSessionCaller(tcp, "0123456789abcdef").ok());
  s = token.CheckSessionCaller("ipv6:[::1]:5000", "0123456789abcdeF");
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(s.message().find("has none"), std::string::npos) << s;
  EXPECT_TRUE(AdminGuard("", true).CheckSessionCaller(tcp, "").ok());
}

}  // namespace
}  // namespace optimd
