// The daemon's log: one line per event on stderr, with date, time, zone and
// level ("2026-11-30T12:00:00.123+00:00 info optimd: session created: ..."),
// through spdlog. Session events, registrations, checkpoints, orphans and
// shutdown are logged; per-step traffic is not.
//
// Thread-safe.
#ifndef OPTIMD_SERVER_LOG_H_
#define OPTIMD_SERVER_LOG_H_

#include <string>

#include "absl/strings/string_view.h"

namespace optimd {
namespace log {

// The least severe lines written; those below it are dropped (the daemon's
// --log_level: a node with many short sessions may keep only warnings).
enum class Level { kInfo, kWarning, kError };
void SetLevel(Level level);
// Flag syntax: "info", "warning" or "error".
bool AbslParseFlag(absl::string_view text, Level* level, std::string* error);
std::string AbslUnparseFlag(Level level);

void Info(const std::string& line);
// Something went wrong for one session or call; the daemon goes on.
void Warn(const std::string& line);
// The daemon cannot go on (bad flags, a socket it cannot claim): it exits
// with a non-zero status after this line.
void Error(const std::string& line);

}  // namespace log
}  // namespace optimd

#endif  // OPTIMD_SERVER_LOG_H_
