// The C++ client and optimctl before a daemon they cannot use: one older
// than the API revision they need (the real daemon with the client's need
// raised, and a stand-in for an older release).
#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <string>
#include <tuple>

#include "absl/strings/str_cat.h"
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

}  // namespace
}  // namespace optimd
