// optimctl: the operator's command line for a running optimd daemon.
//
//   optimctl [--target=unix:/path] health     status and version
//   optimctl [--target=unix:/path] metrics    Prometheus text
//   optimctl [--target=unix:/path] sessions   open sessions, one per line
//   optimctl [--target=unix:/path] evict JOB RANK   close that session
// A TCP target ("host:port") needs --tls_ca (and --tls_cert/--tls_key when
// the daemon requires client certificates), and --admin_token_file for the
// admin calls (sessions, evict). A daemon older than this build's API
// revision is refused, naming both versions (health excepted).
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/client.h"
#include "common/default_address.h"

ABSL_FLAG(std::string, target, "",
          "Daemon address; default: the daemon's default socket "
          "($OPTIMD_ADDRESS, $XDG_RUNTIME_DIR/optimd.sock or "
          "/tmp/optimd-<uid>.sock).");
ABSL_FLAG(int, timeout_s, 10, "Deadline of each call, in seconds.");
ABSL_FLAG(std::string, tls_ca, "",
          "TCP targets: PEM file of the CA that signed the daemon's "
          "certificate.");
ABSL_FLAG(std::string, tls_cert, "",
          "TCP targets: PEM file of this client's certificate chain, for a "
          "daemon that requires one.");
ABSL_FLAG(std::string, tls_key, "", "TCP targets: PEM file of its key.");
ABSL_FLAG(std::string, admin_token_file, "",
          "TCP targets: the file holding the daemon's admin token (its "
          "--admin_token_file), for sessions and evict.");

namespace {

int Fail(const absl::Status& s) {
  std::fprintf(stderr, "optimctl: %s\n", s.ToString().c_str());
  return 1;
}

// The token in `path`, surrounding white space trimmed.
absl::StatusOr<std::string> ReadToken(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  if (!in) {
    return absl::NotFoundError("cannot read --admin_token_file " + path);
  }
  return std::string(absl::StripAsciiWhitespace(text.str()));
}

int Usage() {
  std::fprintf(stderr, "usage: %s\n", absl::ProgramUsageMessage().data());
  return 2;
}

// The client options the flags give: deadlines, TLS files, admin token.
absl::StatusOr<optimd::ClientOptions> OptionsFromFlags() {
  optimd::ClientOptions options;
  options.timeout = absl::Seconds(absl::GetFlag(FLAGS_timeout_s));
  options.connect_timeout = options.timeout;
  if (absl::Status s = optimd::LoadTlsFiles(
          absl::GetFlag(FLAGS_tls_ca), absl::GetFlag(FLAGS_tls_cert),
          absl::GetFlag(FLAGS_tls_key), &options);
      !s.ok()) {
    return s;
  }
  if (!absl::GetFlag(FLAGS_admin_token_file).empty()) {
    auto token = ReadToken(absl::GetFlag(FLAGS_admin_token_file));
    if (!token.ok()) return token.status();
    options.admin_token = *token;
  }
  return options;
}

// "-" for a session whose trainer runs, else how long ago it went
// (orphaned: kept for a resume until the daemon's --orphan_grace_s).
std::string OrphanedFor(double orphaned_since) {
  if (orphaned_since <= 0) return "-";
  const double now = absl::ToUnixMicros(absl::Now()) * 1e-6;
  return absl::StrFormat("%.0fs", std::max(0.0, now - orphaned_since));
}

int PrintSessions(optimd::Client& client) {
  auto sessions = client.ListSessions();
  if (!sessions.ok()) return Fail(sessions.status());
  std::printf("%-24s %5s %5s %6s %10s %10s %14s %9s  %s\n", "JOB", "RANK",
              "WORLD", "DEVICE", "STEPS", "SKIPPED", "STATE_BYTES", "ORPHANED",
              "GROUPS");
  for (const auto& s : sessions->sessions()) {
    std::printf("%-24s %5u %5u %6d %10llu %10llu %14llu %9s  %s\n",
                s.job_id().c_str(), s.rank(), s.world_size(), s.device(),
                static_cast<unsigned long long>(s.steps()),
                static_cast<unsigned long long>(s.skipped_steps()),
                static_cast<unsigned long long>(s.state_bytes()),
                OrphanedFor(s.orphaned_since()).c_str(),
                absl::StrJoin(s.group_ids(), ",").c_str());
  }
  if (sessions->sessions_omitted() > 0) {
    std::printf(
        "(%u more sessions not listed: the daemon caps the reply's size, "
        "--max_listing_bytes)\n",
        sessions->sessions_omitted());
  }
  return 0;
}

// Runs a checked command on a connected client; the process's exit status.
int Run(optimd::Client& client, const std::string& command,
        const std::vector<char*>& args, uint32_t rank) {
  if (command == "health") {
    auto report = client.CheckHealth();
    if (!report.ok()) return Fail(report.status());
    if (report->daemon_version.empty()) {
      std::printf("%s\n", report->status.c_str());
    } else {
      std::printf("%s (optimd %s, API revision %u)\n", report->status.c_str(),
                  report->daemon_version.c_str(), report->api_revision);
    }
    return report->status == "SERVING" ? 0 : 1;
  }
  // Health is grpc.health.v1, which every daemon speaks; the other commands
  // need the daemon's API at this build's revision.
  if (absl::Status s = client.CheckDaemonVersion(); !s.ok()) return Fail(s);
  if (command == "metrics") {
    auto metrics = client.GetMetrics();
    if (!metrics.ok()) return Fail(metrics.status());
    std::fputs(metrics->prometheus_text().c_str(), stdout);
    return 0;
  }
  if (command == "evict") {
    if (absl::Status s = client.EvictSession(args[2], rank); !s.ok()) {
      return Fail(s);
    }
    std::printf("evicted job '%s' rank %u\n", args[2], rank);
    return 0;
  }
  return PrintSessions(client);
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "optimctl [--target=ADDR] health|metrics|sessions|evict JOB RANK");
  std::vector<char*> args = absl::ParseCommandLine(argc, argv);
  if (args.size() < 2) return Usage();
  const std::string command = args[1];
  uint32_t rank = 0;
  if (command == "evict" &&
      (args.size() != 4 || !absl::SimpleAtoi(args[3], &rank))) {
    return Usage();
  }
  if (command != "evict" && args.size() != 2) return Usage();
  if (command != "health" && command != "metrics" && command != "sessions" &&
      command != "evict") {
    std::fprintf(stderr,
                 "optimctl: unknown command '%s'; use health, "
                 "metrics, sessions or evict\n",
                 command.c_str());
    return 2;
  }
  std::string target = absl::GetFlag(FLAGS_target);
  if (target.empty()) target = optimd::DefaultAddress();
  auto options = OptionsFromFlags();
  if (!options.ok()) return Fail(options.status());
  auto client = optimd::Client::Create(target, *options);
  if (!client.ok()) return Fail(client.status());
  return Run(**client, command, args, rank);
}
