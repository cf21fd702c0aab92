#include "server/accept_loop.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <vector>

#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace optimd {
namespace {

// A listening socket on 127.0.0.1 with a port the kernel picks.
UniqueFd Listen(int* port) {
  UniqueFd fd(socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  if (bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      listen(fd.get(), 16) != 0 ||
      getsockname(fd.get(), reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    return UniqueFd();
  }
  *port = ntohs(addr.sin_port);
  return fd;
}

bool Connect(int port) {
  const UniqueFd fd(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  return connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) ==
         0;
}

// Every listener's connections are handed over, with the listener they
// came from; once stopped, the listeners are closed.
TEST(AcceptLoopTest, HandsOverConnectionsOfEveryListener) {
  int port_a = 0, port_b = 0;
  UniqueFd a = Listen(&port_a), b = Listen(&port_b);
  ASSERT_TRUE(a.valid() && b.valid());
  const int fd_a = a.get(), fd_b = b.get();
  std::atomic<int> from_a{0}, from_b{0}, other{0};
  AcceptLoop loop("test listeners");
  std::vector<UniqueFd> listeners;
  listeners.push_back(std::move(a));
  listeners.push_back(std::move(b));
  ASSERT_TRUE(loop.Start(std::move(listeners),
                         [&](int listener, int fd) {
                           (listener == fd_a   ? from_a
                            : listener == fd_b ? from_b
                                               : other)
                               .fetch_add(1);
                           close(fd);
                         })
                  .ok());
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(Connect(port_a));
    ASSERT_TRUE(Connect(port_b));
  }
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while ((from_a.load() < 3 || from_b.load() < 3) && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_EQ(from_a.load(), 3);
  EXPECT_EQ(from_b.load(), 3);
  EXPECT_EQ(other.load(), 0);
  EXPECT_EQ(loop.refused(), 0u);
  loop.Stop();
  loop.Stop();  // idempotent
  EXPECT_FALSE(Connect(port_a)) << "still listening after Stop";
  EXPECT_FALSE(Connect(port_b)) << "still listening after Stop";
}

// A loop that was never started stops (and is destroyed) at once.
TEST(AcceptLoopTest, StopWithoutStart) {
  AcceptLoop loop("nothing");
  loop.Stop();
  EXPECT_EQ(loop.refused(), 0u);
}

}  // namespace
}  // namespace optimd
