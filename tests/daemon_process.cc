#include "tests/daemon_process.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace optimd {

absl::StatusOr<std::unique_ptr<DaemonProcess>> DaemonProcess::Start(
    const std::vector<std::string>& extra_flags, rlim_t open_files_limit) {
  static std::atomic<int> counter{0};
  // Unix socket paths are limited to 107 bytes; Bazel's TEST_TMPDIR can be
  // longer, so the socket lives directly under /tmp.
  const std::string socket_path = absl::StrCat(
      "/tmp/optimd-test-", getpid(), "-", counter.fetch_add(1), ".sock");
  std::string binary = "server/optimd";
  if (const char* b = std::getenv("OPTIMD_BINARY"); b != nullptr && *b) {
    binary = b;
  }
  std::vector<std::string> args = {binary,
                                   absl::StrCat("--listen=unix:", socket_path),
                                   "--backend=cpu", "--cpu_threads=2"};
  args.insert(args.end(), extra_flags.begin(), extra_flags.end());
  // Built before fork: the child of a multi-threaded process may only make
  // async-signal-safe calls (no allocation) before exec.
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  const pid_t pid = fork();
  if (pid < 0) return absl::InternalError("fork failed");
  if (pid == 0) {
    if (open_files_limit > 0) {
      const rlimit limit = {open_files_limit, open_files_limit};
      if (setrlimit(RLIMIT_NOFILE, &limit) != 0) _exit(126);
    }
    execv(argv[0], argv.data());
    _exit(127);
  }
  std::unique_ptr<DaemonProcess> d(new DaemonProcess(pid, socket_path));
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (absl::Now() < deadline) {
    if (!d->Alive()) {
      return absl::InternalError(
          absl::StrCat("optimd exited during start-up (", binary, ")"));
    }
    if (access(socket_path.c_str(), F_OK) == 0) {
      ClientOptions o;
      o.connect_timeout = absl::Seconds(2);
      o.timeout = absl::Seconds(2);
      auto c = Client::Create(d->address(), o);
      if (c.ok()) {
        auto h = (*c)->Health();
        if (h.ok() && *h == "SERVING") return d;
      }
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  return absl::DeadlineExceededError("optimd did not become healthy in 30s");
}

DaemonProcess::~DaemonProcess() {
  if (exit_status_ < 0) Stop();
}

bool DaemonProcess::Alive() const {
  if (exit_status_ >= 0) return false;
  int status = 0;
  if (waitpid(pid_, &status, WNOHANG) == 0) return true;
  exit_status_ =
      WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return false;
}

namespace {

// Whether every thread under /proc/<pid>/task is in state T (stopped).
bool AllThreadsStopped(pid_t pid) {
  std::error_code ec;
  const std::filesystem::path tasks = absl::StrCat("/proc/", pid, "/task");
  for (const auto& task : std::filesystem::directory_iterator(tasks, ec)) {
    std::ifstream in(task.path() / "stat");
    std::stringstream text;
    text << in.rdbuf();
    const std::string stat = text.str();
    // The state follows the parenthesised command name.
    const size_t close = stat.rfind(')');
    if (close == std::string::npos || close + 2 >= stat.size()) continue;
    const char state = stat[close + 2];
    if (state != 'T' && state != 't') return false;
  }
  return !ec;
}

}  // namespace

bool DaemonProcess::Freeze() const {
  if (kill(pid_, SIGSTOP) != 0) return false;
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (!AllThreadsStopped(pid_)) {
    if (absl::Now() > deadline) return false;
    absl::SleepFor(absl::Milliseconds(1));
  }
  return true;
}

bool DaemonProcess::Thaw() const { return kill(pid_, SIGCONT) == 0; }

absl::StatusOr<std::unique_ptr<Client>> DaemonProcess::Connect() const {
  return Client::Create(address_);
}

int DaemonProcess::Stop() {
  if (exit_status_ >= 0) return exit_status_;
  kill(pid_, SIGTERM);
  int status = 0;
  waitpid(pid_, &status, 0);
  exit_status_ =
      WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return exit_status_;
}

}  // namespace optimd
