// Starts the real optimd binary on a private Unix socket for end-to-end
// tests, and stops it with SIGTERM. Not thread-safe.
#ifndef OPTIMD_TESTS_DAEMON_PROCESS_H_
#define OPTIMD_TESTS_DAEMON_PROCESS_H_

#include <sys/resource.h>
#include <sys/types.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "client/client.h"

namespace optimd {

class DaemonProcess {
 public:
  // Starts `binary` (default: server/optimd in the test's runfiles) with
  // --listen on a fresh socket plus `extra_flags`, and waits until its
  // health service answers SERVING. `open_files_limit` > 0 sets the
  // daemon's soft and hard limits on open files (RLIMIT_NOFILE) to it.
  static absl::StatusOr<std::unique_ptr<DaemonProcess>> Start(
      const std::vector<std::string>& extra_flags = {},
      rlim_t open_files_limit = 0);

  DaemonProcess(const DaemonProcess&) = delete;
  DaemonProcess& operator=(const DaemonProcess&) = delete;
  // Stops the daemon if still running.
  ~DaemonProcess();

  const std::string& address() const { return address_; }
  const std::string& socket_path() const { return socket_path_; }
  pid_t pid() const { return pid_; }
  bool Alive() const;

  // A connected client without a session.
  absl::StatusOr<std::unique_ptr<Client>> Connect() const;

  // SIGSTOP, then waits (up to 10 s) until every thread of the daemon is
  // stopped: a thread running when the signal came may otherwise still
  // answer a call. False if it did not stop.
  bool Freeze() const;
  // SIGCONT; true if the signal was sent.
  bool Thaw() const;

  // Sends SIGTERM and waits; returns the exit status (0 on a clean stop).
  int Stop();

 private:
  DaemonProcess(pid_t pid, std::string socket_path)
      : pid_(pid),
        socket_path_(std::move(socket_path)),
        address_("unix:" + socket_path_) {}

  pid_t pid_;
  const std::string socket_path_;
  const std::string address_;
  mutable int exit_status_ = -1;
};

}  // namespace optimd

#endif  // OPTIMD_TESTS_DAEMON_PROCESS_H_
