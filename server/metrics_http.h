// The daemon's Prometheus endpoint: GET /metrics over HTTP (--metrics_listen),
// served by libmicrohttpd (Debian's libmicrohttpd-dev) on a thread of its
// own. Only GET /metrics is answered (404 for other paths, 405 for other
// methods); at most 512 connections at once, each closed after 3 s idle
// and given 8 KiB for its request (metrics_http.cc says why).
//
// Thread-safe: `render` is called on the server's thread and must be.
#ifndef OPTIMD_SERVER_METRICS_HTTP_H_
#define OPTIMD_SERVER_METRICS_HTTP_H_

#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

struct MHD_Daemon;

namespace optimd {

class MetricsHttpServer {
 public:
  // `listen`: "host:port" (an IPv4 address or "localhost"; an empty host
  // or "0.0.0.0" is every interface; port 0 picks a free one).
  // INVALID_ARGUMENT for a malformed address, UNAVAILABLE when it cannot be
  // bound.
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Start(
      const std::string& listen, std::function<std::string()> render);
  ~MetricsHttpServer();
  MetricsHttpServer(const MetricsHttpServer&) = delete;
  MetricsHttpServer& operator=(const MetricsHttpServer&) = delete;

  int port() const { return port_; }
  // The text served: the Prometheus text exposition format, version 0.0.4.
  std::string Render() const { return render_(); }

 private:
  explicit MetricsHttpServer(std::function<std::string()> render)
      : render_(std::move(render)) {}

  const std::function<std::string()> render_;
  MHD_Daemon* daemon_ = nullptr;
  int port_ = 0;
};

}  // namespace optimd

#endif  // OPTIMD_SERVER_METRICS_HTTP_H_
