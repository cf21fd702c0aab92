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

void SetLevel(Level level) {
  switch (level) {
    case Level::kInfo:
      Logger().set_level(spdlog::level::info);
      break;
    case Level::kWarning:
      Logger().set_level(spdlog::level::warn);
      break;
    case Level::kError:
      Logger().set_level(spdlog::level::err);
      break;
  }
}

bool AbslParseFlag(absl::string_view text, Level* level, std::string* error) {
  if (text == "info") {
    *level = Level::kInfo;
  } else if (text == "warning") {
    *level = Level::kWarning;
  } else if (text == "error") {
    *level = Level::kError;
  } else {
    *error = "must be info, warning or error";
    return false;
  }
  return true;
}

std::string AbslUnparseFlag(Level level) {
  switch (level) {
    case Level::kInfo:
      return "info";
    case Level::kWarning:
      return "warning";
    case Level::kError:
      return "error";
  }
  return "info";
}

void Info(const std::string& line) { Logger().info("{}", line); }

void Warn(const std::string& line) { Logger().warn("{}", line); }

void Error(const std::string& line) { Logger().error("{}", line); }

}  // namespace log
}  // namespace optimd
