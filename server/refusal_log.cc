#include "server/refusal_log.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace optimd {
namespace {

class RefusalInterceptor : public grpc::experimental::Interceptor {
 public:
  RefusalInterceptor(RefusalLog* log, const char* method)
      : log_(log), method_(method == nullptr ? "?" : method) {}

  void Intercept(
      grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(
            grpc::experimental::InterceptionHookPoints::PRE_SEND_STATUS)) {
      const grpc::Status status = methods->GetSendStatus();
      if (!status.ok() && status.error_code() != grpc::StatusCode::CANCELLED) {
        log_->Note(method_, status, absl::Now());
      }
    }
    methods->Proceed();
  }

 private:
  RefusalLog* const log_;
  const std::string method_;
};

// The status's message; for gRPC's own UNIMPLEMENTED without one, what it
// means: gRPC refuses so a call it could not read whole as well as an
// unknown method.
std::string Explained(const grpc::Status& status) {
  if (status.error_code() == grpc::StatusCode::UNIMPLEMENTED &&
      status.error_message().empty()) {
    return "no such method, or its request was not received whole (gRPC's "
           "request memory, --max_request_memory_bytes, ran short, or the "
           "client broke off)";
  }
  return status.error_message();
}

}  // namespace

void RefusalLog::Note(const std::string& method, const grpc::Status& status,
                      absl::Time now) {
  std::string line, summary;
  {
    MutexLock lock(&mu_);
    if (now - window_start_ >= kWindow) {
      if (suppressed_ > 0) summary = LeftOut(suppressed_);
      window_start_ = now;
      lines_ = 0;
      suppressed_ = 0;
    }
    if (lines_ < kLinesPerWindow) {
      ++lines_;
      // gRPC's codes are the canonical ones absl names.
      line =
          absl::StrCat("refused ", method, ": ",
                       absl::StatusCodeToString(
                           static_cast<absl::StatusCode>(status.error_code())),
                       ": ", Explained(status).substr(0, 512));
    } else {
      ++suppressed_;
    }
  }
  if (!summary.empty()) write_(summary);
  if (!line.empty()) write_(line);
}

void RefusalLog::Flush(absl::Time now) {
  std::string summary;
  {
    MutexLock lock(&mu_);
    if (suppressed_ == 0 || now - window_start_ < kWindow) return;
    summary = LeftOut(suppressed_);
    suppressed_ = 0;
  }
  write_(summary);
}

std::string RefusalLog::LeftOut(uint64_t calls) {
  return absl::StrCat(calls,
                      " more refused calls were not logged in the last window");
}

grpc::experimental::Interceptor* RefusalLogFactory::CreateServerInterceptor(
    grpc::experimental::ServerRpcInfo* info) {
  return new RefusalInterceptor(log_, info->method());
}

}  // namespace optimd
