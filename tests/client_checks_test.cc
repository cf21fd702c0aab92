// The C++ client and optimctl before a daemon they cannot use, and what
// they say: one older than the API revision they need (the real daemon with
// the client's need raised, and a stand-in for an older release), a bare
// socket path, a missing socket file, another user's socket, a socket file
// nobody listens on.
#include <fcntl.h>
#include <grp.h>
#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <string>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "common/version.h"
#include "gtest/gtest.h"
#include "tests/daemon_process.h"

namespace optimd {
namespace {

using absl::StatusCode;

// A fresh socket path under /tmp (Unix socket paths are limited to 107
// bytes; Bazel's TEST_TMPDIR may be longer).
std::string SocketPath(const std::string& what) {
  static std::atomic<int> counter{0};
  return absl::StrCat("/tmp/optimd-checks-", getpid(), "-",
                      counter.fetch_add(1), "-", what);
}

// Exit status and stdout+stderr of optimctl with `args`.
std::tuple<int, std::string> Optimctl(const std::string& args) {
  const std::string command =
      absl::StrCat("client/optimctl --timeout_s=5 ", args, " 2>&1");
  std::string out;
  FILE* f = popen(command.c_str(), "r");
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), f)) > 0) out.append(buf, n);
  const int status = pclose(f);
  return {WEXITSTATUS(status), out};
}

v1::CreateSessionRequest Session(const std::string& job) {
  v1::CreateSessionRequest r;
  r.set_job_id(job);
  r.set_world_size(1);
  r.set_device(-1);
  return r;
}

TEST(ClientChecksTest, RefusesADaemonOlderThanTheRevisionItNeeds) {
  auto d = DaemonProcess::Start();
  ASSERT_TRUE(d.ok()) << d.status();
  ClientOptions needs_more;
  needs_more.required_api_revision = kApiRevision + 1;
  auto c = Client::Create((*d)->address(), needs_more);
  ASSERT_TRUE(c.ok()) << c.status();
  const absl::Status s = (*c)->CreateSession(Session("too-new")).status();
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s;
  const std::string expected =
      absl::StrCat("the daemon at ", (*d)->address(), " is optimd ", kVersion,
                   " (API revision ", kApiRevision, "); this client, optimd ",
                   kVersion, ", needs API revision ", kApiRevision + 1,
                   " or later: upgrade the daemon");
  EXPECT_EQ(s.message(), expected);
  EXPECT_EQ((*c)->CheckDaemonVersion().message(), expected);
  EXPECT_TRUE((*c)->session_token().empty());

  // The refused session was closed again; a client needing no more than
  // the daemon speaks is served.
  auto ok = (*d)->Connect();
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ((*ok)->ListSessions()->sessions_size(), 0);
  EXPECT_TRUE((*ok)->CheckDaemonVersion().ok());
  auto created = (*ok)->CreateSession(Session("current"));
  ASSERT_TRUE(created.ok()) << created.status();
  EXPECT_EQ(created->api_revision(), kApiRevision);
  EXPECT_EQ(created->daemon_version(), kVersion);
}

// A stand-in for an earlier release: GetMetrics reports `version` and
// `revision` (both empty before 0.2.0); every other RPC is UNIMPLEMENTED.
class OlderDaemon final : public v1::Optimizer::Service {
 public:
  OlderDaemon(std::string version, uint32_t revision)
      : version_(std::move(version)), revision_(revision) {}

  grpc::Status GetMetrics(grpc::ServerContext*, const v1::GetMetricsRequest*,
                          v1::GetMetricsResponse* response) override {
    response->set_daemon_version(version_);
    response->set_api_revision(revision_);
    response->set_prometheus_text("optimd_steps_total 0\n");
    return grpc::Status::OK;
  }

 private:
  const std::string version_;
  const uint32_t revision_;
};

TEST(ClientChecksTest, OptimctlRefusesAnOlderDaemonNamingBothVersions) {
  for (const auto& [version, revision, says] :
       {std::make_tuple(std::string("0.4.0"), kApiRevision - 1,
                        std::string("optimd 0.4.0 (API revision ") +
                            std::to_string(kApiRevision - 1) + ")"),
        std::make_tuple(std::string(), 0u,
                        std::string("optimd older than 0.2.0 (API "
                                    "revision 0)"))}) {
    const std::string address = "unix:" + SocketPath("older.sock");
    OlderDaemon service(version, revision);
    grpc::ServerBuilder builder;
    builder.AddListeningPort(address, grpc::InsecureServerCredentials());
    builder.RegisterService(&service);
    std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
    ASSERT_NE(server, nullptr);
    // The library's calls without a session, too: not a bare UNIMPLEMENTED.
    auto c = Client::Create(address);
    ASSERT_TRUE(c.ok()) << c.status();
    const absl::Status evicted = (*c)->EvictSession("job", 0);
    EXPECT_EQ(evicted.code(), StatusCode::kFailedPrecondition) << evicted;
    EXPECT_EQ(evicted.message(),
              absl::StrCat("the daemon at ", address, " is ", says,
                           "; this client, optimd ", kVersion,
                           ", needs API revision ", kApiRevision,
                           " or later: upgrade the daemon"));
    EXPECT_EQ((*c)->ListSessions().status().code(),
              StatusCode::kFailedPrecondition);
    for (const char* command : {"metrics", "sessions", "evict job 0"}) {
      auto [rc, out] =
          Optimctl(absl::StrCat("--target=", address, " ", command));
      EXPECT_EQ(rc, 1) << command << ": " << out;
      EXPECT_NE(
          out.find(absl::StrCat("FAILED_PRECONDITION: the daemon at ", address,
                                " is ", says, "; this client, optimd ",
                                kVersion, ", needs API revision ", kApiRevision,
                                " or later: upgrade the daemon")),
          std::string::npos)
          << command << ": " << out;
    }
    server->Shutdown();
  }
}

TEST(ClientChecksTest, ABareSocketPathIsRefusedSayingWriteUnix) {
  for (const std::string path : {"/tmp/optimd-checks.sock", "optimd.sock"}) {
    const auto c = Client::Create(path);
    EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(
        c.status().message(),
        absl::StrCat("'", path, "' looks like a socket path: write unix:", path,
                     " (without the prefix it is a TCP address, which "
                     "the daemon serves over TLS only)"));
    auto [rc, out] = Optimctl("--target=" + path + " health");
    EXPECT_EQ(rc, 1) << out;
    EXPECT_NE(out.find("INVALID_ARGUMENT: '" + path +
                       "' looks like a socket path: write unix:" + path),
              std::string::npos)
        << out;
  }
}

TEST(ClientChecksTest, AMissingSocketFileFailsAtOnceNamingIt) {
  const std::string path = SocketPath("missing.sock");
  const std::string expected = absl::StrCat(
      "no optimd daemon at unix:", path, ": the socket file ", path,
      " does not exist, so no daemon listens there; start one with `optimd "
      "--listen=unix:",
      path, "`");
  ClientOptions patient;
  patient.connect_timeout = absl::Seconds(10);
  const absl::Time start = absl::Now();
  const auto c = Client::Create("unix:" + path, patient);
  EXPECT_EQ(c.status().code(), StatusCode::kUnavailable);
  EXPECT_EQ(c.status().message(), expected);
  auto [rc, out] = Optimctl("--timeout_s=10 --target=unix:" + path + " health");
  EXPECT_EQ(rc, 1) << out;
  EXPECT_NE(out.find("UNAVAILABLE: " + expected), std::string::npos) << out;
  EXPECT_LT(absl::Now() - start, absl::Seconds(5)) << "waited for nothing";
}

// A socket file left by a daemon that died without removing it: nothing
// listens, and the client says so at once instead of waiting.
TEST(ClientChecksTest, ASocketNobodyListensOnFailsAtOnceSayingSo) {
  const std::string path = SocketPath("stale.sock");
  const int fd = socket(AF_UNIX, SOCK_STREAM, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  close(fd);
  ClientOptions patient;
  patient.connect_timeout = absl::Seconds(10);
  const absl::Time start = absl::Now();
  const auto c = Client::Create("unix:" + path, patient);
  EXPECT_EQ(c.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(c.status().message().find("is there but nothing listens on it"),
            std::string::npos)
      << c.status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(5)) << "waited for nothing";
  unlink(path.c_str());
}

// Runs `fn` in a child process under `uid` (its own group too, no
// supplementary groups) and returns what the child wrote to the returned
// pipe's write end `fd`: `fn` writes its result there, or execs with it as
// its stdout and stderr.
std::string AsUser(uid_t uid, const std::function<void(int fd)>& fn) {
  int pipe_fds[2];
  if (pipe(pipe_fds) != 0) return "pipe failed";
  const pid_t pid = fork();
  if (pid == 0) {
    close(pipe_fds[0]);
    if (setgroups(0, nullptr) != 0 || setgid(uid) != 0 || setuid(uid) != 0) {
      (void)!write(pipe_fds[1], "setuid failed", 13);
      _exit(1);
    }
    fn(pipe_fds[1]);
    _exit(0);
  }
  close(pipe_fds[1]);
  std::string out;
  char buf[4096];
  ssize_t n;
  while ((n = read(pipe_fds[0], buf, sizeof(buf))) > 0) out.append(buf, n);
  close(pipe_fds[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  return out;
}

// The message for a socket this user may not open; `mode` as octal digits.
std::string NotYours(const std::string& path, const std::string& owner,
                     const std::string& mode) {
  return absl::StrCat("the daemon socket ", path, " belongs to ", owner,
                      " and only it may connect (mode ", mode,
                      "); run as that user, or start a daemon of your own on "
                      "another socket (optimd --listen=unix:/path)");
}

TEST(ClientChecksTest, AnotherUsersSocketNamesItsOwner) {
  auto d = DaemonProcess::Start();  // its socket: ours, mode 0600
  ASSERT_TRUE(d.ok()) << d.status();
  const std::string address = (*d)->address();
  if (geteuid() != 0) {
    // Only root can make a socket of another user; a socket closed even to
    // its owner takes the same path.
    const std::string path = (*d)->socket_path();
    ASSERT_EQ(chmod(path.c_str(), 0), 0);
    const absl::Status s = Client::Create(address).status();
    ASSERT_EQ(chmod(path.c_str(), 0600), 0);
    EXPECT_EQ(s.code(), StatusCode::kUnavailable);
    EXPECT_NE(s.message().find(" belongs to user "), std::string::npos) << s;
    EXPECT_NE(s.message().find("only it may connect (mode 0)"),
              std::string::npos)
        << s;
    return;
  }
  const std::string expected =
      NotYours((*d)->socket_path(), "user root (uid 0)", "600");
  constexpr uid_t kNobody = 65534;
  const std::string said = AsUser(kNobody, [&address](int fd) {
    const std::string m = Client::Create(address).status().ToString();
    (void)!write(fd, m.data(), m.size());
  });
  EXPECT_EQ(said, "UNAVAILABLE: " + expected);

  // optimctl too, from a copy that user may run (the runfiles tree may be
  // closed to it).
  const std::string dir = SocketPath("bin");
  std::filesystem::create_directory(dir);
  chmod(dir.c_str(), 0755);
  const std::string optimctl = dir + "/optimctl";
  std::filesystem::copy_file("client/optimctl", optimctl);
  chmod(optimctl.c_str(), 0755);
  const std::string target = "--target=" + address;
  const std::string out = AsUser(kNobody, [&](int fd) {
    dup2(fd, 1);
    dup2(fd, 2);
    execl(optimctl.c_str(), optimctl.c_str(), target.c_str(), "health",
          nullptr);
  });
  EXPECT_NE(out.find("optimctl: UNAVAILABLE: " + expected), std::string::npos)
      << out;
  std::filesystem::remove_all(dir);
  // Root itself may use any socket: no diagnosis there.
  EXPECT_TRUE(Client::Create(address).ok());
}

// A daemon killed under an open session: every kind of session call says
// that it went away and that the state it held is lost unless saved.
TEST(ClientChecksTest, ADaemonGoneUnderASessionSaysTheStateIsLost) {
  auto d = DaemonProcess::Start();
  ASSERT_TRUE(d.ok()) << d.status();
  auto c = (*d)->Connect();
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_TRUE((*c)->CreateSession(Session("gone")).ok());
  ASSERT_EQ(kill((*d)->pid(), SIGKILL), 0);
  while ((*d)->Alive()) absl::SleepFor(absl::Milliseconds(10));
  const std::string said =
      absl::StrCat("the optimd daemon at ", (*d)->address(),
                   " went away during the session (");
  const std::string lost =
      "): the optimizer state it held is lost unless it was checkpointed "
      "(SaveState) or saved at a clean stop (--save_dir); restart it and "
      "resume (CreateSession with resume, or LoadState)";
  const absl::Status statuses[] = {
      (*c)->GetSaveStatus().status(),
      (*c)->StreamStep(v1::StepRequest()).status(),
      (*c)->SaveStateStream(
              {}, [](const v1::StateChunk&) { return absl::OkStatus(); })
          .status(),
  };
  for (const absl::Status& s : statuses) {
    EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s;
    EXPECT_EQ(s.message().rfind(said, 0), 0u) << s;
    EXPECT_NE(s.message().find(lost), std::string::npos) << s;
  }
  // Without a session there was no state to lose: gRPC's own words.
  (*c)->set_session_token("");
  const absl::Status plain = (*c)->ListSessions().status();
  EXPECT_EQ(plain.code(), StatusCode::kUnavailable);
  EXPECT_EQ(plain.message().find("went away"), std::string::npos) << plain;
}

// A socket in a directory closed to this user (systemd's RuntimeDirectory
// of another user, mode 0700) is named with that directory and its owner,
// not reported missing.
TEST(ClientChecksTest, ASocketInAClosedDirectoryNamesTheDirectory) {
  const std::string dir = SocketPath("closed");
  ASSERT_TRUE(std::filesystem::create_directory(dir));
  const std::string address = "unix:" + dir + "/optimd.sock";
  const std::string why =
      absl::StrCat("the daemon socket ", dir,
                   "/optimd.sock is out of this user's reach: the directory ",
                   dir, " on its path belongs to ");
  if (geteuid() != 0) {
    // A directory closed to its own owner takes the same path.
    ASSERT_EQ(chmod(dir.c_str(), 0), 0);
    const absl::Status s = Client::Create(address).status();
    ASSERT_EQ(chmod(dir.c_str(), 0700), 0);
    std::filesystem::remove_all(dir);
    EXPECT_EQ(s.code(), StatusCode::kUnavailable);
    EXPECT_NE(s.message().find(why), std::string::npos) << s;
    EXPECT_NE(s.message().find("closed to this user (mode 0)"),
              std::string::npos)
        << s;
    return;
  }
  ASSERT_EQ(chmod(dir.c_str(), 0700), 0);
  constexpr uid_t kNobody = 65534;
  const std::string said = AsUser(kNobody, [&address](int fd) {
    const std::string m = Client::Create(address).status().ToString();
    (void)!write(fd, m.data(), m.size());
  });
  std::filesystem::remove_all(dir);
  EXPECT_EQ(said, absl::StrCat("UNAVAILABLE: ", why,
                               "user root (uid 0) and is closed to this user "
                               "(mode 700); run as that user, or start a "
                               "daemon of your own on another socket (optimd "
                               "--listen=unix:/path)"));
}

}  // namespace
}  // namespace optimd
