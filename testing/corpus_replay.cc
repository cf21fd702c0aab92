#include "testing/corpus_replay.h"

#include <dirent.h>

#include <cstdio>
#include <fstream>
#include <iterator>
#include <vector>

namespace optimd {

int ReplayCorpusMain(int argc, char** argv, const CorpusReplay& replay) {
  const std::string flag = "--write_seeds=";
  if (argc == 2 && std::string(argv[1]).rfind(flag, 0) == 0) {
    const absl::Status s =
        replay.write_seeds(std::string(argv[1]).substr(flag.size()));
    std::printf("%s\n", s.ToString().c_str());
    return s.ok() ? 0 : 1;
  }
  const std::string dir = argc > 1 ? argv[1] : replay.default_dir;
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) {
    std::printf("FAIL: no corpus at %s\n", dir.c_str());
    return 1;
  }
  std::vector<std::string> names;
  while (const dirent* e = readdir(d)) {
    if (e->d_name[0] != '.') names.push_back(e->d_name);
  }
  closedir(d);
  int failures = 0, valid = 0;
  for (const std::string& name : names) {
    std::ifstream in(dir + "/" + name, std::ios::binary);
    if (!in) {
      // A seed listed but unreadable (a dangling runfiles link, say) would
      // otherwise replay as empty input and hide what the corpus holds.
      std::printf("FAIL: cannot read %s/%s\n", dir.c_str(), name.c_str());
      ++failures;
      continue;
    }
    const std::string bytes((std::istreambuf_iterator<char>(in)),
                            std::istreambuf_iterator<char>());
    const absl::Status s = replay.run(
        reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
    if (name.rfind("valid-", 0) == 0) {
      ++valid;
      if (!s.ok()) {
        std::printf("FAIL: %s: %s\n", name.c_str(), s.ToString().c_str());
        ++failures;
      }
    }
  }
  std::printf("%zu inputs, %d valid seeds, %d failures\n", names.size(), valid,
              failures);
  return failures == 0 && valid >= replay.min_valid ? 0 : 1;
}

}  // namespace optimd
