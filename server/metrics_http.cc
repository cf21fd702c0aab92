#include "server/metrics_http.h"

#include <arpa/inet.h>
#include <microhttpd.h>
#include <netinet/in.h>

#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace optimd {
namespace {

MHD_Result Reply(MHD_Connection* connection, unsigned int code,
                 const std::string& body, const char* type) {
  MHD_Response* response = MHD_create_response_from_buffer(
      body.size(), const_cast<char*>(body.data()), MHD_RESPMEM_MUST_COPY);
  if (response == nullptr) return MHD_NO;
  MHD_add_response_header(response, MHD_HTTP_HEADER_CONTENT_TYPE, type);
  const MHD_Result queued = MHD_queue_response(connection, code, response);
  MHD_destroy_response(response);
  return queued;
}

MHD_Result Handle(void* cls, MHD_Connection* connection, const char* url,
                  const char* method, const char*, const char*,
                  size_t* upload_size, void**) {
  const auto* server = static_cast<const MetricsHttpServer*>(cls);
  if (*upload_size != 0) {
    *upload_size = 0;  // a body is not read, only discarded
    return MHD_YES;
  }
  if (std::strcmp(url, "/metrics") != 0) {
    return Reply(connection, MHD_HTTP_NOT_FOUND, "only /metrics is served\n",
                 "text/plain");
  }
  if (std::strcmp(method, MHD_HTTP_METHOD_GET) != 0 &&
      std::strcmp(method, MHD_HTTP_METHOD_HEAD) != 0) {
    return Reply(connection, MHD_HTTP_METHOD_NOT_ALLOWED, "GET /metrics\n",
                 "text/plain");
  }
  return Reply(connection, MHD_HTTP_OK, server->Render(),
               "text/plain; version=0.0.4; charset=utf-8");
}

// "host:port" into an IPv4 socket address.
absl::StatusOr<sockaddr_in> ParseListen(const std::string& listen) {
  const size_t colon = listen.rfind(':');
  uint32_t port = 0;
  std::string host = colon == std::string::npos ? "" : listen.substr(0, colon);
  if (colon == std::string::npos ||
      !absl::SimpleAtoi(listen.substr(colon + 1), &port) || port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("--metrics_listen must be host:port (e.g. "
                     "127.0.0.1:9464 or :9464 for every interface), not '",
                     listen, "'"));
  }
  if (host == "localhost") host = "127.0.0.1";
  if (host.empty()) host = "0.0.0.0";
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  if (inet_pton(AF_INET, host.c_str(), &addr.sin_addr) != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--metrics_listen host '", host,
                     "' is not an IPv4 address (or localhost)"));
  }
  return addr;
}

}  // namespace

// Clients that send a request slowly (a byte at a time, each within the
// idle timeout) hold their connections: a limit far above what scrapers
// use keeps a few such clients from shutting the scraper out, a short idle
// timeout and a small buffer per connection (a scrape's request is a few
// hundred bytes; longer ones get 431) bound what each holds.
constexpr unsigned kMaxConnections = 512;
constexpr unsigned kIdleTimeoutS = 3;
constexpr size_t kConnectionMemory = 8 << 10;

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Start(
    const std::string& listen, std::function<std::string()> render) {
  auto addr = ParseListen(listen);
  if (!addr.ok()) return addr.status();
  std::unique_ptr<MetricsHttpServer> server(
      new MetricsHttpServer(std::move(render)));
  server->daemon_ = MHD_start_daemon(
      MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_EPOLL, 0, nullptr, nullptr,
      &Handle, server.get(), MHD_OPTION_SOCK_ADDR, &*addr,
      MHD_OPTION_CONNECTION_LIMIT, kMaxConnections,
      MHD_OPTION_CONNECTION_TIMEOUT, kIdleTimeoutS,
      MHD_OPTION_CONNECTION_MEMORY_LIMIT, kConnectionMemory, MHD_OPTION_END);
  if (server->daemon_ == nullptr) {
    return absl::UnavailableError(absl::StrCat(
        "cannot serve metrics on ", listen, " (address in use or not ours)"));
  }
  const MHD_DaemonInfo* info =
      MHD_get_daemon_info(server->daemon_, MHD_DAEMON_INFO_BIND_PORT);
  server->port_ = info != nullptr ? info->port : ntohs(addr->sin_port);
  return server;
}

MetricsHttpServer::~MetricsHttpServer() {
  if (daemon_ != nullptr) MHD_stop_daemon(daemon_);
}

}  // namespace optimd
