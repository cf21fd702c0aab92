#include "server/log.h"

#include <memory>

#include "spdlog/sinks/stdout_sinks.h"
#include "spdlog/spdlog.h"

namespace optimd {
namespace log {
namespace {

spdlog::logger& Logger() {
  // Flushed after every line: the log is read while the daemon runs, and
  // lost lines are worse than slow ones (there are few).
  static const std::shared_ptr<spdlog::logger> logger = [] {
    auto l = spdlog::stderr_logger_mt("optimd");
    l->set_pattern("%Y-%m-%dT%H:%M:%S.%e%z %l %n: %v");
    l->flush_on(spdlog::level::info);
    return l;
  }();
  return *logger;
}

}  // namespace

void Info(const std::string& line) { Logger().info("{}", line); }

void Warn(const std::string& line) { Logger().warn("{}", line); }

void Error(const std::string& line) { Logger().error("{}", line); }

}  // namespace log
}  // namespace optimd
