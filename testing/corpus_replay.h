// The main of a fuzz target's corpus-replay test: every input of the corpus
// directory goes through the target in the normal build and must give a
// Status without crashing; inputs named "valid-*" must give OK, and there
// must be at least `min_valid` of them. With --write_seeds=DIR it writes
// the target's valid seeds there instead.
//
// Thread-compatible (a test's main).
#ifndef OPTIMD_TESTING_CORPUS_REPLAY_H_
#define OPTIMD_TESTING_CORPUS_REPLAY_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

#include "absl/status/status.h"

namespace optimd {

struct CorpusReplay {
  std::string default_dir;  // relative to the test's working directory
  int min_valid = 1;
  std::function<absl::Status(const std::string& dir)> write_seeds;
  std::function<absl::Status(const uint8_t* data, size_t size)> run;
};

// Returns the process's exit status.
int ReplayCorpusMain(int argc, char** argv, const CorpusReplay& replay);

}  // namespace optimd

#endif  // OPTIMD_TESTING_CORPUS_REPLAY_H_
