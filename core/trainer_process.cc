#include "core/trainer_process.h"

#include <cstdio>
#include <cstring>
#include <string>

namespace optimd {

std::optional<TrainerProcess> FindTrainerProcess(uint32_t pid) {
  if (pid == 0) return std::nullopt;
  const std::string path = "/proc/" + std::to_string(pid) + "/stat";
  FILE* f = std::fopen(path.c_str(), "re");
  if (f == nullptr) return std::nullopt;
  char buf[1024];
  const size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  buf[n] = '\0';
  // The command name (field 2) is in parentheses and may hold anything:
  // the fields after it start behind the last ')'.
  const char* rest = std::strrchr(buf, ')');
  if (rest == nullptr) return std::nullopt;
  // Fields 3 .. 22 follow; the start time is the 20th of them.
  unsigned long long start = 0;
  int field = 2;
  for (const char* p = rest + 1; *p != '\0' && field < 22; ++p) {
    if (*p == ' ') {
      ++field;
      if (field == 22 && std::sscanf(p + 1, "%llu", &start) != 1) {
        return std::nullopt;
      }
    }
  }
  if (field != 22) return std::nullopt;
  return TrainerProcess{pid, static_cast<uint64_t>(start)};
}

bool TrainerGone(const TrainerProcess& p) {
  const std::optional<TrainerProcess> now = FindTrainerProcess(p.pid);
  return !now.has_value() || now->start_ticks != p.start_ticks;
}

}  // namespace optimd
