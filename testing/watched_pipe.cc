#include "testing/watched_pipe.h"

#include <fcntl.h>
#include <unistd.h>

#include <utility>

#include "gtest/gtest.h"

namespace optimd {

Pipe MakePipe() {
  int ends[2] = {-1, -1};
  EXPECT_EQ(pipe2(ends, O_CLOEXEC | O_NONBLOCK), 0);
  return Pipe{UniqueFd(ends[0]), UniqueFd(ends[1])};
}

std::vector<Pipe> MakePipes(int n) {
  std::vector<Pipe> pipes;
  for (int i = 0; i < n; ++i) pipes.push_back(MakePipe());
  return pipes;
}

bool WriteEndClosed(const Pipe& p) {
  char c;
  return read(p.read.get(), &c, 1) == 0;
}

std::vector<UniqueFd> WriteEnds(std::vector<Pipe>& pipes) {
  std::vector<UniqueFd> fds;
  for (Pipe& p : pipes) fds.push_back(std::move(p.write));
  return fds;
}

}  // namespace optimd
