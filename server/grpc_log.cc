#include "server/grpc_log.h"

#include <grpc/support/log.h>

#include <string>

#include "absl/strings/str_cat.h"
#include "server/log.h"

namespace optimd {
namespace {

void LogGrpcLine(gpr_log_func_args* args) {
  const std::string line = absl::StrCat("grpc: ", args->message, " (",
                                        args->file, ":", args->line, ")");
  if (args->severity == GPR_LOG_SEVERITY_ERROR) {
    log::Warn(line);
  } else {
    log::Info(line);
  }
}

}  // namespace

void RouteGrpcLog() { gpr_set_log_function(LogGrpcLine); }

}  // namespace optimd
