// A fuzz target for checkpoint loading: arbitrary bytes, loaded as a
// checkpoint file into a fixed session (two groups, every layout), must
// give a Status, never a crash, a hang or an out-of-bounds access.
// tools/fuzz.sh builds it with libFuzzer and sanitizers;
// checkpoint_fuzz_test replays the seed corpus in the normal build.
#ifndef OPTIMD_TESTS_CORE_CHECKPOINT_FUZZ_H_
#define OPTIMD_TESTS_CORE_CHECKPOINT_FUZZ_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"

namespace optimd {

// Loads `data` as a checkpoint into the fuzz session (made on first use;
// not thread-safe).
absl::Status LoadFuzzCheckpoint(const uint8_t* data, size_t size);

// Saves the fuzz session's checkpoint into `dir` in both formats, as
// "valid-v1" and "valid-v2" (the seeds of the corpus).
absl::Status WriteFuzzSeeds(const std::string& dir);

}  // namespace optimd

#endif  // OPTIMD_TESTS_CORE_CHECKPOINT_FUZZ_H_
