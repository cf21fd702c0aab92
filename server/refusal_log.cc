#include "server/refusal_log.h"

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace optimd {
namespace {

const char* CodeName(grpc::StatusCode code) {
  switch (code) {
    case grpc::StatusCode::INVALID_ARGUMENT:
      return "INVALID_ARGUMENT";
    case grpc::StatusCode::NOT_FOUND:
      return "NOT_FOUND";
    case grpc::StatusCode::ALREADY_EXISTS:
      return "ALREADY_EXISTS";
    case grpc::StatusCode::PERMISSION_DENIED:
      return "PERMISSION_DENIED";
    case grpc::StatusCode::UNAUTHENTICATED:
      return "UNAUTHENTICATED";
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
      return "RESOURCE_EXHAUSTED";
    case grpc::StatusCode::FAILED_PRECONDITION:
      return "FAILED_PRECONDITION";
    case grpc::StatusCode::UNAVAILABLE:
      return "UNAVAILABLE";
    case grpc::StatusCode::DATA_LOSS:
      return "DATA_LOSS";
    case grpc::StatusCode::INTERNAL:
      return "INTERNAL";
    default:
      return "error";
  }
}

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

}  // namespace

void RefusalLog::Note(const std::string& method, const grpc::Status& status,
                      absl::Time now) {
  std::string line, summary;
  {
    MutexLock lock(&mu_);
    if (now - window_start_ >= kWindow) {
      if (suppressed_ > 0) {
        summary = absl::StrCat(suppressed_,
                               " more refused calls were not "
                               "logged in the last window");
      }
      window_start_ = now;
      lines_ = 0;
      suppressed_ = 0;
    }
    if (lines_ < kLinesPerWindow) {
      ++lines_;
      line =
          absl::StrCat("refused ", method, ": ", CodeName(status.error_code()),
                       ": ", status.error_message().substr(0, 512));
    } else {
      ++suppressed_;
    }
  }
  if (!summary.empty()) write_(summary);
  if (!line.empty()) write_(line);
}

grpc::experimental::Interceptor* RefusalLogFactory::CreateServerInterceptor(
    grpc::experimental::ServerRpcInfo* info) {
  return new RefusalInterceptor(log_, info->method());
}

}  // namespace optimd
