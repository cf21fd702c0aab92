// FileReadGate holds another process's reads of one file, so that a test
// can change the file at a known point of that process's work: after it
// opened the file, before it read past the first bytes. Built on Linux's
// fanotify permission events (the kernel asks the gate before each read of
// the marked file), so the process under test needs no hook of its own.
// Needs CAP_SYS_ADMIN; Create says so (FAILED_PRECONDITION) where it is
// missing or the kernel has no fanotify permission events.
//
// While the gate is closed, the test's own process must not read the file:
// the gate answers only from WaitForRead, so such a read would wait forever.
//
// Thread-compatible: one thread drives a gate.
#ifndef OPTIMD_TESTING_FILE_READ_GATE_H_
#define OPTIMD_TESTING_FILE_READ_GATE_H_

#include <sys/types.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/unique_fd.h"

namespace optimd {

class FileReadGate {
 public:
  // Closes the gate on `path`: from now on every read of the file by any
  // process waits until the gate lets it go.
  static absl::StatusOr<std::unique_ptr<FileReadGate>> Create(
      const std::string& path);

  FileReadGate(const FileReadGate&) = delete;
  FileReadGate& operator=(const FileReadGate&) = delete;
  // Opens the gate.
  ~FileReadGate() { Open(); }

  // Waits up to `timeout` for a read of the file by process `reader` and
  // holds it (reads of other processes are let through meanwhile);
  // DEADLINE_EXCEEDED when none came.
  absl::Status HoldNextRead(pid_t reader, absl::Duration timeout);

  // Lets the reads held go, and every later one: the gate is gone.
  void Open();

 private:
  explicit FileReadGate(UniqueFd fanotify) : fanotify_(std::move(fanotify)) {}

  // Answers one permission event.
  void Allow(int event_fd);

  UniqueFd fanotify_;
  std::vector<int> held_;  // event descriptors of the reads held
};

}  // namespace optimd

#endif  // OPTIMD_TESTING_FILE_READ_GATE_H_
