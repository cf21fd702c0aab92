// Logs every refused call (a status other than OK or CANCELLED, which is
// how a client's own close of a stream ends) with its method and message,
// at most `kLinesPerWindow` lines per `kWindow`; the rest are counted and
// reported in one line when the window has ended (Flush) or the next one
// opens, so that a client that sends bad requests in a loop cannot flood
// the log.
//
// RefusalLogFactory is a gRPC server interceptor factory (one interceptor
// per call, looking at the status the call sends). Thread-safe.
#ifndef OPTIMD_SERVER_REFUSAL_LOG_H_
#define OPTIMD_SERVER_REFUSAL_LOG_H_

#include <grpcpp/support/server_interceptor.h>

#include <cstdint>
#include <functional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/mutex.h"

namespace optimd {

class RefusalLog {
 public:
  static constexpr int kLinesPerWindow = 20;
  static constexpr absl::Duration kWindow = absl::Seconds(10);

  // `write` gets each line (e.g. log::Warn).
  explicit RefusalLog(std::function<void(const std::string&)> write)
      : write_(std::move(write)) {}

  // One refused call at `now`.
  void Note(const std::string& method, const grpc::Status& status,
            absl::Time now) ABSL_LOCKS_EXCLUDED(mu_);

  // Writes the count of calls left out of the current window if that
  // window has ended by `now`, so that a burst followed by quiet is counted
  // without waiting for the next refusal (the daemon calls it every second,
  // and with absl::InfiniteFuture() when it stops).
  void Flush(absl::Time now) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  static std::string LeftOut(uint64_t calls);

  const std::function<void(const std::string&)> write_;
  Mutex mu_;
  absl::Time window_start_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  int lines_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t suppressed_ ABSL_GUARDED_BY(mu_) = 0;
};

class RefusalLogFactory
    : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit RefusalLogFactory(RefusalLog* log) : log_(log) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override;

 private:
  RefusalLog* const log_;
};

}  // namespace optimd

#endif  // OPTIMD_SERVER_REFUSAL_LOG_H_
