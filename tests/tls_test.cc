// TCP is served only over TLS: the real daemon binary on 127.0.0.1 with
// certificates made by openssl for this test, the real client, and the
// refusals (no TLS flags, a client without the CA, a client without a
// certificate when the daemon requires one).
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "gtest/gtest.h"

namespace optimd {
namespace {

// A scratch directory with a CA, a server certificate for 127.0.0.1 and
// localhost, a client certificate, and a second, unrelated CA.
class Certificates {
 public:
  Certificates() {
    char dir[] = "/tmp/optimd-tls-XXXXXX";
    dir_ = mkdtemp(dir);
    std::ofstream(Path("server.ext"))
        << "subjectAltName=DNS:localhost,IP:127.0.0.1\n";
    ok_ = MakeCa("ca") && MakeCa("other") && MakeLeaf("server", "server.ext") &&
          MakeLeaf("client", "");
  }
  ~Certificates() { Run("rm -rf " + dir_); }

  bool ok() const { return ok_; }
  std::string Path(const std::string& name) const { return dir_ + "/" + name; }
  // Writes an admin token file (mode 0600, as the daemon requires) beside
  // the certificates and returns its path; empty if chmod failed.
  std::string AdminTokenFile() const {
    const std::string path = Path("admin-token");
    std::ofstream(path) << "0123456789abcdef0123456789abcdef\n";
    return chmod(path.c_str(), 0600) == 0 ? path : "";
  }
  // The daemon's TLS flags with the server certificate made here.
  std::vector<std::string> ServerFlags() const {
    return {"--tls_cert=" + Path("server.pem"),
            "--tls_key=" + Path("server.key")};
  }

 private:
  bool Run(const std::string& cmd) {
    return std::system(
               ("cd " + dir_ + " && " + cmd + " >/dev/null 2>&1").c_str()) == 0;
  }
  bool MakeCa(const std::string& name) {
    return Run(
        "openssl req -x509 -newkey ec -pkeyopt "
        "ec_paramgen_curve:prime256v1 -nodes -days 1 -subj /CN=" +
        name + " -keyout " + name + ".key -out " + name + ".pem");
  }
  bool MakeLeaf(const std::string& name, const std::string& ext) {
    return Run("openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 "
               "-nodes -subj /CN=" +
               name + " -keyout " + name + ".key -out " + name + ".csr") &&
           Run("openssl x509 -req -in " + name +
               ".csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 1 -out " +
               name + ".pem" + (ext.empty() ? "" : " -extfile " + ext));
  }

  std::string dir_;
  bool ok_ = false;
};

std::string Slurp(const std::string& path) {
  std::ifstream in(path);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

// The daemon on 127.0.0.1 with a port the kernel picks, read from its log.
class TcpDaemon {
 public:
  // `open_files` > 0: the daemon's soft and hard limits on open files.
  explicit TcpDaemon(const std::vector<std::string>& flags,
                     rlim_t open_files = 0) {
    log_ = absl::StrCat("/tmp/optimd-tls-log-", getpid(), "-", ++count_);
    pid_ = fork();
    if (pid_ == 0) {
      freopen(log_.c_str(), "w", stderr);
      if (open_files > 0) {
        const rlimit limit{open_files, open_files};
        setrlimit(RLIMIT_NOFILE, &limit);
      }
      std::vector<std::string> argv = {"server/optimd", "--listen=127.0.0.1:0",
                                       "--backend=cpu", "--cpu_threads=1"};
      argv.insert(argv.end(), flags.begin(), flags.end());
      std::vector<char*> raw;
      for (std::string& a : argv) raw.push_back(a.data());
      raw.push_back(nullptr);
      execv(raw[0], raw.data());
      _exit(127);
    }
    const absl::Time deadline = absl::Now() + absl::Seconds(20);
    while (absl::Now() < deadline) {
      const std::string log = Slurp(log_);
      const size_t at = log.find("listening on 127.0.0.1:");
      if (at != std::string::npos) {
        const size_t start = at + std::string("listening on ").size();
        address_ = log.substr(start, log.find_first_of(" ;", start) - start);
        return;
      }
      int status = 0;
      if (waitpid(pid_, &status, WNOHANG) == pid_) {
        exit_status_ = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
        pid_ = -1;
        return;
      }
      absl::SleepFor(absl::Milliseconds(20));
    }
  }
  ~TcpDaemon() {
    if (pid_ > 0) {
      kill(pid_, SIGTERM);
      waitpid(pid_, nullptr, 0);
    }
    unlink(log_.c_str());
  }

  const std::string& address() const { return address_; }  // empty: none
  pid_t pid() const { return pid_; }
  // SIGTERM, then the exit status once it exits (-1: killed or still
  // running after `limit`, then killed).
  int Stop(absl::Duration limit) {
    if (pid_ <= 0) return exit_status_;
    kill(pid_, SIGTERM);
    const absl::Time deadline = absl::Now() + limit;
    int status = 0;
    while (waitpid(pid_, &status, WNOHANG) == 0) {
      if (absl::Now() > deadline) {
        kill(pid_, SIGKILL);
        waitpid(pid_, &status, 0);
        break;
      }
      absl::SleepFor(absl::Milliseconds(10));
    }
    pid_ = -1;
    exit_status_ = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    return exit_status_;
  }
  int exit_status() const { return exit_status_; }  // if it exited
  std::string log() const { return Slurp(log_); }

 private:
  static inline int count_ = 0;
  pid_t pid_ = -1;
  int exit_status_ = -1;
  std::string log_, address_;
};

ClientOptions Options(const Certificates& c, const std::string& ca,
                      bool client_cert) {
  ClientOptions o;
  o.connect_timeout = absl::Seconds(3);
  o.timeout = absl::Seconds(10);
  EXPECT_TRUE(LoadTlsFiles(c.Path(ca + ".pem"),
                           client_cert ? c.Path("client.pem") : "",
                           client_cert ? c.Path("client.key") : "", &o)
                  .ok());
  return o;
}

TEST(TlsTest, TcpWithoutTlsIsRefusedAtStartup) {
  TcpDaemon d({});
  EXPECT_TRUE(d.address().empty());
  EXPECT_EQ(d.exit_status(), 2);
  EXPECT_NE(d.log().find("needs TLS"), std::string::npos) << d.log();
}

TEST(TlsTest, ServerCertificateIsChecked) {
  Certificates certs;
  ASSERT_TRUE(certs.ok()) << "openssl could not make test certificates";
  TcpDaemon d({"--tls_cert=" + certs.Path("server.pem"),
               "--tls_key=" + certs.Path("server.key")});
  ASSERT_FALSE(d.address().empty()) << d.log();
  EXPECT_NE(d.log().find("(TLS)"), std::string::npos);

  auto good = Client::Create(d.address(), Options(certs, "ca", false));
  ASSERT_TRUE(good.ok()) << good.status();
  auto health = (*good)->Health();
  ASSERT_TRUE(health.ok()) << health.status();
  EXPECT_EQ(*health, "SERVING");
  EXPECT_TRUE((*good)->GetMetrics().ok());

  // No CA: refused before connecting. The wrong CA: the handshake fails.
  EXPECT_EQ(Client::Create(d.address()).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Client::Create(d.address(), Options(certs, "other", false))
                .status()
                .code(),
            absl::StatusCode::kUnavailable);
}

TEST(TlsTest, ClientCertificatesWhenRequired) {
  Certificates certs;
  ASSERT_TRUE(certs.ok()) << "openssl could not make test certificates";
  TcpDaemon d({"--tls_cert=" + certs.Path("server.pem"),
               "--tls_key=" + certs.Path("server.key"),
               "--tls_client_ca=" + certs.Path("ca.pem")});
  ASSERT_FALSE(d.address().empty()) << d.log();
  EXPECT_NE(d.log().find("client certificates required"), std::string::npos);
  EXPECT_EQ(
      Client::Create(d.address(), Options(certs, "ca", false)).status().code(),
      absl::StatusCode::kUnavailable);
  auto c = Client::Create(d.address(), Options(certs, "ca", true));
  ASSERT_TRUE(c.ok()) << c.status();
  auto health = (*c)->Health();
  ASSERT_TRUE(health.ok()) << health.status();
  EXPECT_EQ(*health, "SERVING");
}

// ListSessions (every job id) and EvictSession over TCP need the admin
// token; a session's own calls and metrics do not.
TEST(TlsTest, AdminCallsOverTcpNeedTheAdminToken) {
  Certificates certs;
  ASSERT_TRUE(certs.ok()) << "openssl could not make test certificates";
  const std::string token_file = certs.AdminTokenFile();
  ASSERT_FALSE(token_file.empty());
  const std::vector<std::string> tls = certs.ServerFlags();
  std::vector<std::string> flags = tls;
  flags.push_back("--admin_token_file=" + token_file);
  TcpDaemon d(flags);
  ASSERT_FALSE(d.address().empty()) << d.log();
  auto plain = Client::Create(d.address(), Options(certs, "ca", false));
  ASSERT_TRUE(plain.ok());
  v1::CreateSessionRequest cs;
  cs.set_job_id("tcp-job");
  cs.set_world_size(1);
  cs.set_device(-1);
  ClientOptions trainer = Options(certs, "ca", false);
  trainer.admin_token = "0123456789abcdef0123456789abcdef";
  ASSERT_TRUE((*Client::Create(d.address(), trainer))->CreateSession(cs).ok());
  EXPECT_TRUE((*plain)->GetMetrics().ok());
  EXPECT_EQ((*plain)->ListSessions().status().code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_EQ((*plain)->EvictSession("tcp-job", 0).code(),
            absl::StatusCode::kPermissionDenied);
  ClientOptions wrong = Options(certs, "ca", false);
  wrong.admin_token = "0123456789abcdef0123456789abcdeX";
  EXPECT_EQ(
      (*Client::Create(d.address(), wrong))->ListSessions().status().code(),
      absl::StatusCode::kPermissionDenied);
  ClientOptions admin = Options(certs, "ca", false);
  admin.admin_token = "0123456789abcdef0123456789abcdef";
  auto root = Client::Create(d.address(), admin);
  ASSERT_TRUE(root.ok());
  auto listed = (*root)->ListSessions();
  ASSERT_TRUE(listed.ok()) << listed.status();
  ASSERT_EQ(listed->sessions_size(), 1);
  EXPECT_TRUE((*root)->EvictSession("tcp-job", 0).ok());
  // A token file others may read is refused at start.
  ASSERT_EQ(chmod(token_file.c_str(), 0644), 0);
  TcpDaemon loose(flags);
  EXPECT_TRUE(loose.address().empty());
  EXPECT_EQ(loose.exit_status(), 2);
  EXPECT_NE(loose.log().find("chmod 600"), std::string::npos) << loose.log();
}

// Over TCP, CreateSession needs a caller the daemon knows: an anonymous
// TLS client could otherwise open a session and make the daemon map the
// node's shared memory, or save and load checkpoints, as the daemon's
// user. Without --tls_client_ca the admin token is needed; with it, a
// client's certificate is enough. Nothing is created by a refused call.
TEST(TlsTest, SessionsOverTcpNeedAKnownCaller) {
  Certificates certs;
  ASSERT_TRUE(certs.ok()) << "openssl could not make test certificates";
  const std::string token_file = certs.AdminTokenFile();
  ASSERT_FALSE(token_file.empty());
  const std::vector<std::string> tls = certs.ServerFlags();
  v1::CreateSessionRequest cs;
  cs.set_job_id("tcp-job");
  cs.set_world_size(1);
  cs.set_device(-1);
  {
    TcpDaemon d(tls);  // no token, no client certificates
    ASSERT_FALSE(d.address().empty()) << d.log();
    auto anonymous = Client::Create(d.address(), Options(certs, "ca", false));
    ASSERT_TRUE(anonymous.ok()) << anonymous.status();
    auto refused = (*anonymous)->CreateSession(cs);
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kPermissionDenied)
        << refused.status();
    EXPECT_NE(refused.status().message().find("--tls_client_ca"),
              std::string::npos)
        << refused.status();
    cs.set_resume(true);
    EXPECT_EQ((*anonymous)->CreateSession(cs).status().code(),
              absl::StatusCode::kPermissionDenied);
    cs.set_resume(false);
    auto metrics = (*anonymous)->GetMetrics();
    ASSERT_TRUE(metrics.ok()) << metrics.status();
    EXPECT_EQ(metrics->sessions(), 0u);
  }
  {
    std::vector<std::string> flags = tls;
    flags.push_back("--admin_token_file=" + token_file);
    TcpDaemon d(flags);
    ASSERT_FALSE(d.address().empty()) << d.log();
    ClientOptions wrong = Options(certs, "ca", false);
    wrong.admin_token = "0123456789abcdef0123456789abcdeX";
    EXPECT_EQ((*Client::Create(d.address(), wrong))
                  ->CreateSession(cs)
                  .status()
                  .code(),
              absl::StatusCode::kPermissionDenied);
    ClientOptions known = Options(certs, "ca", false);
    known.admin_token = "0123456789abcdef0123456789abcdef";
    auto c = Client::Create(d.address(), known);
    ASSERT_TRUE(c.ok()) << c.status();
    auto created = (*c)->CreateSession(cs);
    ASSERT_TRUE(created.ok()) << created.status();
    EXPECT_EQ((*c)->GetMetrics()->sessions(), 1u);
  }
  {
    std::vector<std::string> flags = tls;
    flags.push_back("--tls_client_ca=" + certs.Path("ca.pem"));
    TcpDaemon d(flags);
    ASSERT_FALSE(d.address().empty()) << d.log();
    auto c = Client::Create(d.address(), Options(certs, "ca", true));
    ASSERT_TRUE(c.ok()) << c.status();
    auto created = (*c)->CreateSession(cs);
    ASSERT_TRUE(created.ok()) << created.status();
    // A caller with a certificate is known: it sees job ids.
    auto metrics = (*c)->GetMetrics();
    ASSERT_TRUE(metrics.ok()) << metrics.status();
    ASSERT_EQ(metrics->session_infos_size(), 1);
    EXPECT_EQ(metrics->session_infos(0).job_id(), "tcp-job");
  }
}

// GetMetrics shows job ids only to callers the daemon knows (as for
// sessions): an anonymous TCP caller sees each session as "session-<n>",
// with its rank and sizes but no job or group id, in the listing and the
// Prometheus text alike; the admin token shows them.
TEST(TlsTest, AnonymousMetricsOverTcpHideJobIds) {
  Certificates certs;
  ASSERT_TRUE(certs.ok()) << "openssl could not make test certificates";
  const std::string token_file = certs.AdminTokenFile();
  ASSERT_FALSE(token_file.empty());
  std::vector<std::string> flags = certs.ServerFlags();
  flags.push_back("--admin_token_file=" + token_file);
  TcpDaemon d(flags);
  ASSERT_FALSE(d.address().empty()) << d.log();
  ClientOptions known = Options(certs, "ca", false);
  known.admin_token = "0123456789abcdef0123456789abcdef";
  auto admin = Client::Create(d.address(), known);
  ASSERT_TRUE(admin.ok()) << admin.status();
  v1::CreateSessionRequest cs;
  cs.set_job_id("secret-job-name");
  cs.set_rank(3);
  cs.set_world_size(4);
  cs.set_device(-1);
  ASSERT_TRUE((*admin)->CreateSession(cs).ok());
  auto anonymous = Client::Create(d.address(), Options(certs, "ca", false));
  ASSERT_TRUE(anonymous.ok()) << anonymous.status();
  auto hidden = (*anonymous)->GetMetrics();
  ASSERT_TRUE(hidden.ok()) << hidden.status();
  EXPECT_EQ(hidden->sessions(), 1u);
  ASSERT_EQ(hidden->session_infos_size(), 1);
  EXPECT_EQ(hidden->session_infos(0).job_id(), "session-0");
  EXPECT_EQ(hidden->session_infos(0).rank(), 3u);
  EXPECT_EQ(hidden->session_infos(0).world_size(), 4u);
  EXPECT_EQ(hidden->DebugString().find("secret-job-name"), std::string::npos);
  EXPECT_NE(hidden->prometheus_text().find("job_id=\"session-0\""),
            std::string::npos);
  auto shown = (*admin)->GetMetrics();
  ASSERT_TRUE(shown.ok()) << shown.status();
  ASSERT_EQ(shown->session_infos_size(), 1);
  EXPECT_EQ(shown->session_infos(0).job_id(), "secret-job-name");
  EXPECT_NE(shown->prometheus_text().find("job_id=\"secret-job-name\""),
            std::string::npos);
}

TEST(TlsTest, BadTlsFlags) {
  Certificates certs;
  ASSERT_TRUE(certs.ok()) << "openssl could not make test certificates";
  // A key file that is not PEM.
  TcpDaemon bad({"--tls_cert=" + certs.Path("server.pem"),
                 "--tls_key=" + certs.Path("server.ext")});
  EXPECT_TRUE(bad.address().empty());
  EXPECT_EQ(bad.exit_status(), 2);
  EXPECT_NE(bad.log().find("--tls_key file"), std::string::npos) << bad.log();
  EXPECT_NE(bad.log().find("is not PEM"), std::string::npos) << bad.log();
}

// Raw TCP connections to `address` (127.0.0.1:port) that say nothing, as
// many as connect, up to `n`.
std::vector<int> ConnectRaw(const std::string& address, int n) {
  const int port = std::stoi(address.substr(address.rfind(':') + 1));
  std::vector<int> conns;
  for (int i = 0; i < n; ++i) {
    const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(port);
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
      close(fd);
      break;
    }
    conns.push_back(fd);
  }
  return conns;
}

// How many of `conns` the other end has closed.
int ClosedByPeer(const std::vector<int>& conns) {
  int closed = 0;
  for (const int fd : conns) {
    pollfd p = {fd, POLLIN, 0};
    char byte;
    if (poll(&p, 1, 0) == 1 && recv(fd, &byte, 1, MSG_DONTWAIT) == 0) {
      ++closed;
    }
  }
  return closed;
}

// Debian 12's gRPC (1.51) never accepts on a TCP listener of its own again
// once accept has failed for lack of descriptors (grpc/grpc#16058, #20418,
// #31080). The daemon accepts TCP itself: it closes what it cannot serve,
// keeps serving the connections already open, and accepts new TLS
// connections again once descriptors come free.
TEST(TlsTest, TcpListenerServesAgainAfterRunningOutOfDescriptors) {
  Certificates certs;
  ASSERT_TRUE(certs.ok()) << "openssl could not make test certificates";
  TcpDaemon d({"--tls_cert=" + certs.Path("server.pem"),
               "--tls_key=" + certs.Path("server.key")},
              /*open_files=*/64);
  ASSERT_FALSE(d.address().empty()) << d.log();
  auto open = Client::Create(d.address(), Options(certs, "ca", false));
  ASSERT_TRUE(open.ok()) << open.status();
  ASSERT_TRUE((*open)->GetMetrics().ok());
  std::vector<int> conns = ConnectRaw(d.address(), 200);
  ASSERT_GT(conns.size(), 64u);
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while ((d.log().find("out of file descriptors") == std::string::npos ||
          ClosedByPeer(conns) == 0) &&
         absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_NE(d.log().find("out of file descriptors"), std::string::npos)
      << "never ran out: " << d.log();
  EXPECT_GT(ClosedByPeer(conns), 0)
      << "connections past the limit were left waiting";
  EXPECT_EQ(kill(d.pid(), 0), 0) << "the daemon died";
  // The connection opened before is still served.
  EXPECT_TRUE((*open)->GetMetrics().ok());
  for (const int fd : conns) close(fd);
  // Once the connections are gone, a new TLS connection is served within
  // seconds.
  absl::Status last = absl::UnknownError("no call made");
  const absl::Time serve_deadline = absl::Now() + absl::Seconds(10);
  while (!last.ok() && absl::Now() < serve_deadline) {
    ClientOptions o = Options(certs, "ca", false);
    o.connect_timeout = absl::Seconds(1);
    o.timeout = absl::Seconds(2);
    auto c = Client::Create(d.address(), o);
    last = c.ok() ? (*c)->GetMetrics().status() : c.status();
    if (!last.ok()) absl::SleepFor(absl::Milliseconds(50));
  }
  EXPECT_TRUE(last.ok()) << "not served again after running out: " << last
                         << "\n"
                         << d.log();
  EXPECT_NE(d.log().find("accepting connections on " + d.address() + " again"),
            std::string::npos)
      << d.log();
  EXPECT_EQ(d.Stop(absl::Seconds(30)), 0) << d.log();
}

// Many TLS clients at once, each on its own connection: every call is
// answered.
TEST(TlsTest, ManyConcurrentTlsConnections) {
  Certificates certs;
  ASSERT_TRUE(certs.ok()) << "openssl could not make test certificates";
  TcpDaemon d({"--tls_cert=" + certs.Path("server.pem"),
               "--tls_key=" + certs.Path("server.key")});
  ASSERT_FALSE(d.address().empty()) << d.log();
  constexpr int kClients = 32;
  std::vector<absl::Status> metrics(kClients);
  std::vector<std::thread> threads;
  for (int i = 0; i < kClients; ++i) {
    threads.emplace_back([&, i] {
      ClientOptions o = Options(certs, "ca", false);
      // Handshakes of every client at once take long under the sanitizers.
      o.connect_timeout = absl::Seconds(60);
      o.timeout = absl::Seconds(60);
      auto c = Client::Create(d.address(), o);
      metrics[i] = c.ok() ? (*c)->GetMetrics().status() : c.status();
    });
  }
  for (std::thread& t : threads) t.join();
  for (int i = 0; i < kClients; ++i) {
    EXPECT_TRUE(metrics[i].ok()) << i << ": " << metrics[i];
  }
  EXPECT_EQ(d.Stop(absl::Seconds(30)), 0) << d.log();
}

// Requests of several MiB cross TLS connections whole, several at once.
TEST(TlsTest, LargeRequestsOverTls) {
  Certificates certs;
  ASSERT_TRUE(certs.ok()) << "openssl could not make test certificates";
  TcpDaemon d({"--tls_cert=" + certs.Path("server.pem"),
               "--tls_key=" + certs.Path("server.key"),
               "--tls_client_ca=" + certs.Path("ca.pem")});
  ASSERT_FALSE(d.address().empty()) << d.log();
  constexpr int kClients = 4;
  std::vector<absl::Status> large(kClients);
  std::vector<std::thread> threads;
  for (int i = 0; i < kClients; ++i) {
    threads.emplace_back([&, i] {
      ClientOptions o = Options(certs, "ca", true);
      o.timeout = absl::Seconds(60);
      auto c = Client::Create(d.address(), o);
      if (!c.ok()) {
        large[i] = c.status();
        return;
      }
      // A job id of 8 MiB crosses the connection whole before the daemon
      // refuses it by its length.
      v1::CreateSessionRequest cs;
      cs.set_job_id(std::string(8 << 20, 'a' + i));
      cs.set_world_size(1);
      cs.set_device(-1);
      large[i] = (*c)->CreateSession(cs).status();
    });
  }
  for (std::thread& t : threads) t.join();
  for (int i = 0; i < kClients; ++i) {
    EXPECT_EQ(large[i].code(), absl::StatusCode::kInvalidArgument)
        << i << ": " << large[i];
    EXPECT_NE(large[i].message().find("job_id"), absl::string_view::npos)
        << large[i];
  }
}

// Clients that vanish mid-handshake or send garbage do not disturb the
// others, and a daemon with connections open (served, half-handshaken and
// silent) stops promptly and cleanly on SIGTERM.
TEST(TlsTest, BrokenClientsAndStopWithConnectionsOpen) {
  Certificates certs;
  ASSERT_TRUE(certs.ok()) << "openssl could not make test certificates";
  TcpDaemon d({"--tls_cert=" + certs.Path("server.pem"),
               "--tls_key=" + certs.Path("server.key")});
  ASSERT_FALSE(d.address().empty()) << d.log();
  auto served = Client::Create(d.address(), Options(certs, "ca", false));
  ASSERT_TRUE(served.ok()) << served.status();
  ASSERT_TRUE((*served)->GetMetrics().ok());
  // Garbage instead of a TLS ClientHello, then gone; a TLS record header
  // that promises more than is ever sent, then gone.
  for (int fd : ConnectRaw(d.address(), 8)) {
    const char garbage[] = "GET / HTTP/1.1\r\n\r\n";
    (void)!send(fd, garbage, sizeof(garbage) - 1, MSG_NOSIGNAL);
    close(fd);
  }
  for (int fd : ConnectRaw(d.address(), 8)) {
    const unsigned char partial[] = {0x16, 0x03, 0x01, 0x02, 0x00, 0x01};
    (void)!send(fd, partial, sizeof(partial), MSG_NOSIGNAL);
    close(fd);
  }
  EXPECT_TRUE((*served)->GetMetrics().ok());
  auto fresh = Client::Create(d.address(), Options(certs, "ca", false));
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  EXPECT_TRUE((*fresh)->GetMetrics().ok());
  // Stop with a served connection, silent connections and one mid-record.
  std::vector<int> silent = ConnectRaw(d.address(), 8);
  std::vector<int> midway = ConnectRaw(d.address(), 1);
  ASSERT_EQ(midway.size(), 1u);
  const unsigned char partial[] = {0x16, 0x03, 0x01, 0x02, 0x00, 0x01};
  ASSERT_EQ(send(midway[0], partial, sizeof(partial), MSG_NOSIGNAL),
            static_cast<ssize_t>(sizeof(partial)));
  const absl::Time start = absl::Now();
  EXPECT_EQ(d.Stop(absl::Seconds(10)), 0) << d.log();
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  EXPECT_NE(d.log().find("stopped"), std::string::npos) << d.log();
  for (int fd : silent) close(fd);
  close(midway[0]);
}

}  // namespace
}  // namespace optimd
