#include "server/grpc_log.h"

#include <grpc/support/log.h>

#include <atomic>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "server/log.h"

namespace optimd {
namespace {

std::atomic<bool> listener_stopped{false};
// Set once, before gRPC logs anything through it.
const std::string* listener_stopped_line = nullptr;

void LogGrpcLine(gpr_log_func_args* args) {
  const std::string line = absl::StrCat("grpc: ", args->message, " (",
                                        args->file, ":", args->line, ")");
  if (args->severity == GPR_LOG_SEVERITY_ERROR) {
    log::Warn(line);
  } else {
    log::Info(line);
  }
  if (absl::StartsWith(args->message, "Failed accept4") &&
      !listener_stopped.exchange(true)) {
    log::Warn(*listener_stopped_line);
  }
}

}  // namespace

void RouteGrpcLog(const std::string& stopped_line) {
  listener_stopped_line = new std::string(stopped_line);
  gpr_set_log_function(LogGrpcLine);
}

bool GrpcListenerStopped() { return listener_stopped.load(); }

}  // namespace optimd
