#include "server/tcp_listener.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>

#include "absl/strings/match.h"
#include "gtest/gtest.h"

namespace optimd {
namespace {

int PortOf(const std::string& address) {
  return std::stoi(address.substr(address.rfind(':') + 1));
}

TEST(TcpListenerTest, PortZeroTakesTheKernelsPick) {
  auto l = TcpListener::Bind("127.0.0.1:0");
  ASSERT_TRUE(l.ok()) << l.status();
  EXPECT_TRUE(absl::StartsWith((*l)->address(), "127.0.0.1:"));
  EXPECT_GT(PortOf((*l)->address()), 0);
}

// "localhost" may name 127.0.0.1 and ::1: every address is bound on the
// same port, and the port reported is that one.
TEST(TcpListenerTest, HostNameBindsItsAddressesOnOnePort) {
  auto l = TcpListener::Bind("localhost:0");
  ASSERT_TRUE(l.ok()) << l.status();
  const int port = PortOf((*l)->address());
  ASSERT_GT(port, 0);
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  close(fd);
}

TEST(TcpListenerTest, BadAddressesAreRefused) {
  for (const char* bad : {"127.0.0.1", "127.0.0.1:http", "127.0.0.1:70000",
                          "127.0.0.1:-1", "no-such-host.invalid:1"}) {
    auto l = TcpListener::Bind(bad);
    EXPECT_EQ(l.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_TRUE(absl::StrContains(l.status().message(), bad))
        << l.status().message();
  }
}

TEST(TcpListenerTest, PortInUseIsUnavailable) {
  auto first = TcpListener::Bind("127.0.0.1:0");
  ASSERT_TRUE(first.ok()) << first.status();
  auto second = TcpListener::Bind((*first)->address());
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(absl::StrContains(second.status().message(), "in use"))
      << second.status().message();
  // An address that is not this host's.
  auto foreign = TcpListener::Bind("192.0.2.1:0");
  EXPECT_EQ(foreign.status().code(), absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace optimd
