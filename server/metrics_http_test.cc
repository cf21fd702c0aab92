#include "server/metrics_http.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace optimd {
namespace {

// A connected TCP socket to 127.0.0.1:port, or -1.
int Connect(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

// The reply to one GET of `path`, read until the server closes or
// `timeout_ms` passes without a byte.
std::string Get(int port, const std::string& path, int timeout_ms) {
  const int fd = Connect(port);
  if (fd < 0) return "";
  const std::string request =
      "GET " + path + " HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
  std::string reply;
  if (send(fd, request.data(), request.size(), 0) ==
      static_cast<ssize_t>(request.size())) {
    char buf[4096];
    pollfd p{fd, POLLIN, 0};
    while (poll(&p, 1, timeout_ms) == 1) {
      const ssize_t n = recv(fd, buf, sizeof(buf), 0);
      if (n <= 0) break;
      reply.append(buf, static_cast<size_t>(n));
    }
  }
  close(fd);
  return reply;
}

TEST(MetricsHttpTest, ServesMetricsAndRefusesOtherPaths) {
  auto server = MetricsHttpServer::Start("127.0.0.1:0",
                                         [] { return std::string("up 1\n"); });
  ASSERT_TRUE(server.ok()) << server.status();
  const int port = (*server)->port();
  const std::string ok = Get(port, "/metrics", 5000);
  EXPECT_NE(ok.find("200"), std::string::npos) << ok;
  EXPECT_NE(ok.find("up 1"), std::string::npos) << ok;
  EXPECT_NE(Get(port, "/other", 5000).find("404"), std::string::npos);
}

// Clients that hold connections with requests they never finish do not
// shut a scraper out.
TEST(MetricsHttpTest, SlowClientsLeaveRoomForAScrape) {
  auto server = MetricsHttpServer::Start("127.0.0.1:0",
                                         [] { return std::string("up 1\n"); });
  ASSERT_TRUE(server.ok()) << server.status();
  const int port = (*server)->port();
  std::vector<int> slow;
  for (int i = 0; i < 32; ++i) {
    const int fd = Connect(port);
    ASSERT_GE(fd, 0);
    const std::string part = "GET /metrics HTTP/1.1\r\nHost: x\r\n";
    ASSERT_EQ(send(fd, part.data(), part.size(), 0),
              static_cast<ssize_t>(part.size()));
    slow.push_back(fd);
  }
  const std::string reply = Get(port, "/metrics", 2000);
  EXPECT_NE(reply.find("up 1"), std::string::npos)
      << "no answer while 32 requests were left unfinished";
  for (int fd : slow) close(fd);
}

}  // namespace
}  // namespace optimd
