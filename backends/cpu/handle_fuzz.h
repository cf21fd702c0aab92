// A fuzz target for shared-memory handle resolution on the CPU backend:
// arbitrary bytes read as one buffer handle (which segment: one of several
// real ones of awkward sizes, or a name taken from the input; offset, size
// and alignment) and resolved as a trainer's buffer would be. Every input
// must give a Status, never a crash or a sanitizer report, and a resolved
// buffer must lie inside its segment (its first and last bytes are read
// and written). tools/fuzz.sh builds it with libFuzzer; handle_fuzz_test
// replays the seed corpus in the normal build.
#ifndef OPTIMD_BACKENDS_CPU_HANDLE_FUZZ_H_
#define OPTIMD_BACKENDS_CPU_HANDLE_FUZZ_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"

namespace optimd {

// Resolves one fuzz input (not thread-safe).
absl::Status ApplyFuzzHandle(const uint8_t* data, size_t size);

// Writes inputs that resolve into `dir` as "valid-<n>" (corpus seeds).
absl::Status WriteHandleSeeds(const std::string& dir);

}  // namespace optimd

#endif  // OPTIMD_BACKENDS_CPU_HANDLE_FUZZ_H_
