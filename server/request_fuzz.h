// A fuzz target for request validation: arbitrary bytes, read as one
// session request (the first byte picks RegisterGroup, UpdateBuffers, Step,
// SetState or GetState; the rest is the serialized message), converted and
// applied to a fresh session holding one registered group, then stepped.
// Every input must give a Status, never a crash or a sanitizer report.
// tools/fuzz.sh builds it with libFuzzer; request_fuzz_test replays the
// seed corpus in the normal build.
#ifndef OPTIMD_SERVER_REQUEST_FUZZ_H_
#define OPTIMD_SERVER_REQUEST_FUZZ_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"

namespace optimd {

// Applies one fuzz input (not thread-safe).
absl::Status ApplyFuzzRequest(const uint8_t* data, size_t size);

// Writes valid requests of every kind into `dir` as "valid-<kind>" (the
// seeds of the corpus).
absl::Status WriteRequestSeeds(const std::string& dir);

}  // namespace optimd

#endif  // OPTIMD_SERVER_REQUEST_FUZZ_H_
