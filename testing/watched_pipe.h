// Pipes whose write ends a test hands to code that should keep or close
// them: the test keeps each read end (non-blocking), which reads the end
// of the file once every copy of the write end is closed, in this process
// or any other.
#ifndef OPTIMD_TESTING_WATCHED_PIPE_H_
#define OPTIMD_TESTING_WATCHED_PIPE_H_

#include <vector>

#include "common/unique_fd.h"

namespace optimd {

struct Pipe {
  UniqueFd read;
  UniqueFd write;
};

// A new pipe (close-on-exec, non-blocking); a failure fails the test.
Pipe MakePipe();
std::vector<Pipe> MakePipes(int n);

// Whether every copy of the pipe's write end is closed.
bool WriteEndClosed(const Pipe& p);

// The write ends of `pipes`, handed over (the pipes keep their read ends).
std::vector<UniqueFd> WriteEnds(std::vector<Pipe>& pipes);

}  // namespace optimd

#endif  // OPTIMD_TESTING_WATCHED_PIPE_H_
