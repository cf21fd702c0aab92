// optimd: the optimizer-step daemon.
//
// Serves optimd.v1.Optimizer, grpc.health.v1 and server reflection on a Unix
// domain socket (default) or, with TLS, on TCP. Shuts down cleanly on
// SIGINT/SIGTERM: in-flight calls finish, the socket file is removed.
#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/resource_quota.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "backends/cpu/cpu_backend.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/key_names.h"
#include "checkpoint/temporaries.h"
#include "common/default_address.h"
#include "common/fd_store.h"
#include "common/pem_file.h"
#include "common/stale_files.h"
#include "common/version.h"
#include "core/session_registry.h"
#include "core/state_budget.h"
#include "server/device_worker.h"
#include "server/fd_socket.h"
#include "server/grpc_log.h"
#include "server/log.h"
#include "server/metrics_http.h"
#include "server/optimizer_service.h"
#include "server/refusal_log.h"
#include "server/restart_store.h"
#include "server/session_listing.h"
#include "server/session_reaper.h"
#include "server/tcp_listener.h"
#include "server/unix_socket_listener.h"
#include "server/version_metadata.h"

#ifdef OPTIMD_WITH_CUDA
#include "backends/cuda/cuda_backend.h"
#endif

ABSL_FLAG(std::string, listen, "",
          "Address to serve on: unix:/path/to/socket (created 0600) or "
          "host:port (TLS only: see --tls_cert). Default: "
          "unix:$XDG_RUNTIME_DIR/optimd.sock, else "
          "unix:/tmp/optimd-<uid>.sock ($OPTIMD_ADDRESS overrides).");
ABSL_FLAG(std::string, backend, "auto",
          "auto|cpu|cuda. auto picks cuda when a GPU is usable, else cpu.");
ABSL_FLAG(uint64_t, max_state_bytes, 0,
          "Upper bound on optimizer state held for all sessions, in bytes; "
          "0 means no limit. Registrations past it fail with "
          "RESOURCE_EXHAUSTED.");
ABSL_FLAG(uint64_t, max_metadata_bytes, optimd::kDefaultMetadataLimit,
          "Upper bound on the daemon's memory for registered tensors' "
          "names, aliases, shapes and entries, all sessions together, in "
          "bytes (an estimate); 0 means no limit. Registrations past it "
          "fail with RESOURCE_EXHAUSTED.");
ABSL_FLAG(int, cpu_threads, 0,
          "Threads for the CPU backend's steps; 0 means one per hardware "
          "thread.");
ABSL_FLAG(bool, cuda_graphs, true,
          "CUDA backend: launch each step as one CUDA graph (captured once "
          "per session configuration); false launches its kernels one by "
          "one.");
ABSL_FLAG(bool, cuda_blocking_sync, false,
          "CUDA backend: wait for each step's completion blocking in the "
          "driver instead of spinning on a CPU (which the trainer's host may "
          "need); see bench/RESULTS.md, runs 78-80.");
ABSL_FLAG(std::string, state_dir, "",
          "When set, SaveState and LoadState only accept directories within "
          "this one (a client cannot make the daemon write anywhere else).");
ABSL_FLAG(std::string, tls_cert, "",
          "TCP: PEM file of the server's certificate chain (TCP listening "
          "needs TLS).");
ABSL_FLAG(std::string, tls_key, "", "TCP: PEM file of the server's key.");
ABSL_FLAG(std::string, tls_client_ca, "",
          "TCP: PEM file of the CA whose certificates clients must present "
          "(mutual TLS); empty: clients are not asked for one, and "
          "CreateSession over TCP then needs the admin token.");
ABSL_FLAG(std::string, save_dir, "",
          "keeps sessions across the daemon's own restarts: on SIGINT or "
          "SIGTERM every session is saved here (a directory per job), and a "
          "restarted daemon offers it to CreateSession(resume=true). Empty: "
          "sessions end with the daemon");
ABSL_FLAG(std::string, metrics_listen, "",
          "host:port on which to serve Prometheus metrics over HTTP "
          "(GET /metrics), e.g. 127.0.0.1:9464; empty: none. They show "
          "job ids: bind to a trusted interface.");
ABSL_FLAG(std::string, admin_token_file, "",
          "A file (mode 0600) holding the token that admin calls "
          "(ListSessions, EvictSession) over TCP must send in the "
          "x-optimd-admin metadata, as must CreateSession over TCP without "
          "--tls_client_ca; callers on the Unix socket need none.");
ABSL_FLAG(int, orphan_grace_s, 600,
          "how long the session of a trainer gone without closing it (killed) "
          "is kept for a resume before it is freed; negative: kept until "
          "evicted (optimctl evict)");
ABSL_FLAG(double, rank_timeout_s, 600,
          "how long a step of a job whose ranks agree on the gradient norm "
          "(CreateSession gradient_sharding) waits for the same step of the "
          "other ranks before it fails with DEADLINE_EXCEEDED, changing "
          "nothing");
ABSL_FLAG(uint64_t, max_request_memory_bytes, uint64_t{4} << 30,
          "Memory gRPC may hold for calls being received and sent, all "
          "connections together (a grpc::ResourceQuota); past it calls are "
          "reset (RESOURCE_EXHAUSTED, or UNAVAILABLE for a reclaimed "
          "connection). The same bound holds the parsed requests waiting "
          "for or running on the workers (their cost once parsed, counted "
          "from their bytes before parsing; past it a request "
          "is refused with RESOURCE_EXHAUSTED) and the replies not yet "
          "read by their callers (past it a GetState, GetMetrics or "
          "ListSessions reply is refused). A message alone may be "
          "1 GiB: keep it above that. 0: no bound.");
ABSL_FLAG(uint64_t, max_listing_bytes, optimd::kMaxListingBytes,
          "The most bytes the session list of a ListSessions or GetMetrics "
          "reply may take, encoded (a session that would cross it is left "
          "out and counted in sessions_omitted / session_infos_omitted); "
          "from 4096 to the default, 256 MiB.");
ABSL_FLAG(optimd::log::Level, log_level, optimd::log::Level::kInfo,
          "The least severe log lines written: info (sessions, groups, "
          "checkpoints, shutdown), warning (refusals and failures) or "
          "error.");
ABSL_FLAG(int, shutdown_grace_s, 30,
          "On SIGINT/SIGTERM, how long in-flight calls may run before they "
          "are cancelled.");
ABSL_FLAG(double, shutdown_save_s, 540,
          "At shutdown, at most this many seconds for saving the sessions to "
          "--save_dir (smallest first); sessions not saved by then are named "
          "in the log and lost, and the daemon exits with status 1. Keep it "
          "below the service manager's stop timeout (deploy/: 600 s).");

namespace {

// Descriptors that trainers passed over the descriptor socket, held while
// their connections last (the daemon imports a chunk from its descriptor
// whenever a buffer names it and no mapping of it lives), each an open
// file of the daemon: bounded. 16384 chunks of 20 MiB (torch's expandable
// segments grow by such chunks) are 320 GiB, more than a GPU's memory, per
// connection; the total allows four such connections where the daemon's
// limit on open files does (HeldDescriptorBound).
constexpr size_t kMaxHeldDescriptors = 65536;
constexpr size_t kMaxHeldDescriptorsPerConnection = 16384;

// The bound on held descriptors in all for a limit of `files` open files
// (0: unknown): at most three quarters of it, so that trainers' chunks
// cannot take the descriptors the daemon needs for its clients'
// connections, checkpoint files and mappings (deploy/'s limit is 65536,
// kMaxHeldDescriptors too).
size_t HeldDescriptorBound(rlim_t files) {
  if (files == 0) return kMaxHeldDescriptors;
  return static_cast<size_t>(
      std::min<rlim_t>(kMaxHeldDescriptors, files / 4 * 3));
}

void Log(const std::string& line) { optimd::log::Info(line); }
// What keeps the daemon from starting (it exits non-zero next).
void Fail(const std::string& line) { optimd::log::Error(line); }

// The contents of the PEM file named by --`flag`, or false (logged).
bool ReadPem(const std::string& flag, const std::string& path,
             std::string* out) {
  auto pem = optimd::ReadPemFile(absl::StrCat("--", flag), path);
  if (!pem.ok()) {
    Fail(std::string(pem.status().message()));
    return false;
  }
  *out = *std::move(pem);
  return true;
}

// Raises the soft limit on open files to the hard one: every client
// connection, mapped segment and checkpoint file takes a descriptor. (The
// daemon survives running out of them: see AcceptLoop.) Returns the soft
// limit now in force.
rlim_t RaiseFileLimit() {
  rlimit limit{};
  if (getrlimit(RLIMIT_NOFILE, &limit) != 0) return 0;
  if (limit.rlim_cur < limit.rlim_max) {
    rlimit raised = limit;
    raised.rlim_cur = limit.rlim_max;
    if (setrlimit(RLIMIT_NOFILE, &raised) == 0) return raised.rlim_cur;
  }
  return limit.rlim_cur;
}

// --help lists this file's flags (absl matches flags to the program by file
// name by default, and the binary is not named after main.cc); --version
// says the version and API revision.
void ParseFlags(int argc, char** argv) {
  absl::FlagsUsageConfig usage;
  usage.contains_help_flags = [](absl::string_view path) {
    return absl::EndsWith(path, "server/main.cc");
  };
  usage.contains_helpshort_flags = usage.contains_help_flags;
  usage.version_string = [] {
    return absl::StrCat("optimd ", optimd::kVersion, " (API revision ",
                        optimd::kApiRevision, ")\n");
  };
  absl::SetFlagsUsageConfig(usage);
  absl::SetProgramUsageMessage(
      "optimd [--listen=unix:/path] [--backend=auto|cpu|cuda] "
      "[--max_state_bytes=N]");
  absl::ParseCommandLine(argc, argv);
  optimd::log::SetLevel(absl::GetFlag(FLAGS_log_level));
}

// One backend per GPU (--backend), then the CPU backend, which serves
// sessions of CPU tensors (device -1) beside the GPUs if there are any.
// The GPUs' backends take trainers' descriptors from `fd_store`. Empty
// (logged) when --backend cannot be honoured.
// Trainers' shared-memory segments the CPU backend holds open at most for
// a limit of `files` open files (0: unknown): an eighth of it, beside the
// held descriptors' three quarters (HeldDescriptorBound), so that one
// trainer's segments cannot take the descriptors of others' connections.
int64_t OpenSegmentBound(rlim_t files) {
  constexpr int64_t kMost = optimd::SegmentCache::kDefaultMaxOpen;
  if (files == 0) return kMost;
  return std::min<int64_t>(kMost, static_cast<int64_t>(files / 8));
}

std::vector<std::unique_ptr<optimd::Backend>> MakeBackends(
    [[maybe_unused]] optimd::FdStore* fd_store, rlim_t files) {
  std::vector<std::unique_ptr<optimd::Backend>> backends;
  const std::string flag = absl::GetFlag(FLAGS_backend);
  if (flag != "auto" && flag != "cpu" && flag != "cuda") {
    Fail(absl::StrCat("--backend must be auto, cpu or cuda, not '", flag, "'"));
    return backends;
  }
  std::string no_gpu = "this build of optimd has no CUDA backend";
#ifdef OPTIMD_WITH_CUDA
  if (flag != "cpu") {
    const int gpus = optimd::CudaDeviceCount(&no_gpu);
    for (int d = 0; d < gpus; ++d) {
      optimd::CudaBackendOptions cuda_options;
      cuda_options.use_graphs = absl::GetFlag(FLAGS_cuda_graphs);
      cuda_options.blocking_sync = absl::GetFlag(FLAGS_cuda_blocking_sync);
      cuda_options.fd_store = fd_store;
      auto b = optimd::CreateCudaBackend(d, cuda_options);
      if (!b.ok()) {
        optimd::log::Warn(
            absl::StrCat("GPU ", d, " unusable: ", b.status().ToString()));
        backends.clear();
        no_gpu = std::string(b.status().message());
        break;
      }
      backends.push_back(*std::move(b));
    }
  }
#endif
  if (backends.empty() && flag == "cuda") {
    Fail(absl::StrCat("--backend=cuda but no GPU is usable: ", no_gpu));
    return backends;
  }
  if (backends.empty()) {
    Log(absl::StrCat("backend: cpu (",
                     flag == "auto"
                         ? absl::StrCat("auto: no usable GPU: ", no_gpu)
                         : std::string("requested"),
                     ")"));
  } else {
    Log(absl::StrCat("backend: cuda on ", backends.size(), " GPU(s)",
                     flag == "auto" ? " (auto)" : "",
                     ", and cpu for sessions of CPU tensors"));
  }
  optimd::CpuBackend::Options cpu_options;
  cpu_options.threads = absl::GetFlag(FLAGS_cpu_threads);
  cpu_options.max_open_segments = OpenSegmentBound(files);
  backends.push_back(std::make_unique<optimd::CpuBackend>(cpu_options));
  return backends;
}

// Where the daemon listens (--listen, --tls_*).
// The daemon accepts connections itself on either, and hands them to gRPC
// (see server/accept_loop.h for why).
struct Listener {
  std::string address;
  // The Unix socket; null on TCP.
  std::unique_ptr<optimd::UnixSocketListener> unix_socket;
  // The descriptor socket beside the Unix socket ("<path>.fds"); null on
  // TCP, which cannot carry descriptors. Declared after unix_socket, so
  // that it goes first.
  std::unique_ptr<optimd::FdSocket> fd_socket;
  // TCP: the listening sockets, the TLS credentials, and where gRPC takes
  // the connections (set by StartServer); null on a Unix socket.
  std::unique_ptr<optimd::TcpListener> tcp;
  std::shared_ptr<grpc::ServerCredentials> credentials;
  std::unique_ptr<grpc::experimental::ExternalConnectionAcceptor> tcp_acceptor;
};

// TCP serves operators and tools, and never in the clear: trainers hand the
// daemon shared memory and CUDA IPC handles, which only a local process can
// use. Null (logged) on bad TLS flags.
std::shared_ptr<grpc::ServerCredentials> TlsCredentials(
    const std::string& address) {
  if (absl::GetFlag(FLAGS_tls_cert).empty() ||
      absl::GetFlag(FLAGS_tls_key).empty()) {
    Fail(absl::StrCat("listening on TCP (", address,
                      ") needs TLS: pass --tls_cert and --tls_key (and "
                      "--tls_client_ca to require client certificates)"));
    return nullptr;
  }
  grpc::SslServerCredentialsOptions ssl(
      GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  grpc::SslServerCredentialsOptions::PemKeyCertPair pair;
  if (!ReadPem("tls_key", absl::GetFlag(FLAGS_tls_key), &pair.private_key) ||
      !ReadPem("tls_cert", absl::GetFlag(FLAGS_tls_cert), &pair.cert_chain)) {
    return nullptr;
  }
  ssl.pem_key_cert_pairs.push_back(pair);
  if (!absl::GetFlag(FLAGS_tls_client_ca).empty()) {
    if (!ReadPem("tls_client_ca", absl::GetFlag(FLAGS_tls_client_ca),
                 &ssl.pem_root_certs)) {
      return nullptr;
    }
    ssl.client_certificate_request =
        GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
  }
  return grpc::SslServerCredentials(ssl);
}

// Fills *l from the flags; the daemon's exit code on failure (logged), else
// 0. A Unix socket path is claimed (locked, a stale socket file removed).
int OpenListener(Listener* l) {
  l->address = absl::GetFlag(FLAGS_listen);
  if (l->address.empty()) l->address = optimd::DefaultAddress();
  const bool tls = !absl::GetFlag(FLAGS_tls_cert).empty() ||
                   !absl::GetFlag(FLAGS_tls_key).empty() ||
                   !absl::GetFlag(FLAGS_tls_client_ca).empty();
  if (!absl::StartsWith(l->address, "unix:")) {
    l->credentials = TlsCredentials(l->address);
    if (l->credentials == nullptr) return 2;
    auto bound = optimd::TcpListener::Bind(l->address);
    if (!bound.ok()) {
      Fail(std::string(bound.status().message()));
      return bound.status().code() == absl::StatusCode::kInvalidArgument ? 2
                                                                         : 1;
    }
    l->tcp = *std::move(bound);
    l->address = l->tcp->address();  // port 0: the kernel's pick
    return 0;
  }
  if (tls) {
    Fail(
        "--tls_* flags are for TCP; a Unix socket is guarded by its file "
        "mode (0600) instead");
    return 2;
  }
  std::string path = l->address.substr(5);
  if (absl::StartsWith(path, "//")) path = path.substr(2);
  auto claimed = optimd::UnixSocketListener::Claim(path);
  if (!claimed.ok()) {
    Fail(std::string(claimed.status().message()));
    return 1;
  }
  l->unix_socket = *std::move(claimed);
  return 0;
}

// Starts the descriptor socket beside the claimed Unix socket, serving
// `fd_store`; nothing on TCP. One that cannot start (a path too long for
// a socket, say) is logged and done without: 0 either way.
int StartFdSocket(Listener* l, optimd::FdStore* fd_store, rlim_t files) {
  if (l->unix_socket == nullptr) return 0;
  // An eighth of the open-files limit at most, as for the held descriptors
  // (HeldDescriptorBound): the daemon's own connections and files first.
  const size_t connections =
      files == 0 || files == RLIM_INFINITY
          ? optimd::FdSocket::kDefaultMaxConnections
          : std::min<size_t>(optimd::FdSocket::kDefaultMaxConnections,
                             static_cast<size_t>(files / 8));
  auto fd_socket = std::make_unique<optimd::FdSocket>(
      l->unix_socket->path() + ".fds", fd_store, connections);
  if (const absl::Status started = fd_socket->Start(); !started.ok()) {
    // Trainers then copy what CUDA IPC cannot share (the client falls
    // back by itself); the daemon serves all the rest.
    optimd::log::Warn(absl::StrCat(
        "no descriptor socket (", started.message(),
        "): trainers' expandable segments will be copied, not mapped"));
    return 0;
  }
  Log(absl::StrCat("descriptor socket on ", fd_socket->path(),
                   " (trainers' CUDA memory descriptors)"));
  l->fd_socket = std::move(fd_socket);
  return 0;
}

// Saves that were killed midway (the daemon killed while saving) leave
// temporaries as large as their checkpoints: removes those of writers that
// are gone from the directories the daemon owns. Saves elsewhere remove
// theirs at the next save of the same file.
void RemoveStaleCheckpointTemporaries(const std::vector<std::string>& dirs) {
  for (const std::string& dir : dirs) {
    if (dir.empty()) continue;
    const int removed =
        optimd::RemoveStaleTemporariesUnder(dir, optimd::kTemporarySearchDepth);
    if (removed > 0) {
      Log(absl::StrCat("removed ", removed,
                       " temporary files of interrupted checkpoint saves "
                       "under ",
                       dir));
    }
  }
}

// --save_dir, --admin_token_file, --max_listing_bytes and the service's
// hooks; the exit code on
// failure (logged), else 0. `restart_store` must outlive the service.
int ConfigureService(optimd::OptimizerServiceImpl& service,
                     const optimd::CheckpointOptions& checkpoint_options,
                     std::unique_ptr<optimd::RestartStore>* restart_store) {
  const std::string save_dir = absl::GetFlag(FLAGS_save_dir);
  if (!save_dir.empty() &&
      (save_dir[0] != '/' ||
       (mkdir(save_dir.c_str(), 0777) != 0 && errno != EEXIST))) {
    Fail(
        absl::StrCat("--save_dir must be an absolute directory the daemon "
                     "can create or use, not '",
                     save_dir, "'"));
    return 1;
  }
  RemoveStaleCheckpointTemporaries({save_dir, checkpoint_options.state_dir});
  // Trainers' shared-memory segments left when a trainer and the daemon
  // died together.
  if (const int removed = optimd::RemoveStaleSegments("/dev/shm"); removed) {
    Log(absl::StrCat("removed ", removed,
                     " shared-memory segments of trainers that are gone"));
  }
  optimd::CheckpointOptions save_options = checkpoint_options;
  save_options.state_dir.clear();  // the operator's own directory
  *restart_store =
      std::make_unique<optimd::RestartStore>(save_dir, save_options);
  service.set_restart_store(restart_store->get());
  std::string admin_token;
  if (!absl::GetFlag(FLAGS_admin_token_file).empty()) {
    auto token = optimd::AdminGuard::ReadTokenFile(
        absl::GetFlag(FLAGS_admin_token_file));
    if (!token.ok()) {
      Fail(std::string(token.status().message()));
      return 2;
    }
    admin_token = *std::move(token);
  }
  service.set_admin_guard(optimd::AdminGuard(
      std::move(admin_token), !absl::GetFlag(FLAGS_tls_client_ca).empty()));
  const uint64_t listing = absl::GetFlag(FLAGS_max_listing_bytes);
  if (listing < optimd::kMinListingBytes ||
      listing > optimd::kMaxListingBytes) {
    Log(absl::StrCat("--max_listing_bytes must be from ",
                     optimd::kMinListingBytes, " to ", optimd::kMaxListingBytes,
                     " (256 MiB), not ", listing));
    return 2;
  }
  service.set_max_listing_bytes(listing);
  // The parsed copies of requests held for the workers, beside gRPC's
  // buffers (StartServer's quota), under the same bound.
  service.set_max_held_request_bytes(
      absl::GetFlag(FLAGS_max_request_memory_bytes));
  return 0;
}

// Builds and starts the gRPC server, then the Unix socket's accept loop
// (null, logged, when it cannot listen).
std::unique_ptr<grpc::Server> StartServer(Listener& l,
                                          optimd::OptimizerServiceImpl& service,
                                          optimd::RefusalLog* refusals) {
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  if (l.tcp != nullptr) {
    l.tcp_acceptor = builder.experimental().AddExternalConnectionAcceptor(
        grpc::ServerBuilder::experimental_type::ExternalConnectionType::FROM_FD,
        l.credentials);
  }
  builder.SetMaxReceiveMessageSize(1 << 30);
  builder.SetMaxSendMessageSize(1 << 30);
  // Requests arriving at once are bounded together, not only one by one:
  // gRPC charges its read and write buffers to this quota and refuses what
  // does not fit.
  grpc::ResourceQuota quota("optimd-calls");
  if (const uint64_t bytes = absl::GetFlag(FLAGS_max_request_memory_bytes);
      bytes > 0) {
    quota.Resize(bytes);
    builder.SetResourceQuota(quota);
  }
  builder.RegisterService(&service);
  std::vector<
      std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>>
      interceptors;
  interceptors.push_back(std::make_unique<optimd::RefusalLogFactory>(refusals));
  interceptors.push_back(std::make_unique<optimd::VersionMetadataFactory>());
  builder.experimental().SetInterceptorCreators(std::move(interceptors));
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr) {
    Fail(absl::StrCat("cannot listen on ", l.address));
    return nullptr;
  }
  const absl::Status started = l.unix_socket != nullptr
                                   ? l.unix_socket->Start(server.get())
                                   : l.tcp->Start(l.tcp_acceptor.get());
  if (!started.ok()) {
    Fail(std::string(started.message()));
    server->Shutdown();
    return nullptr;
  }
  return server;
}

void LogListening(const Listener& l, rlim_t files, uint64_t state_limit) {
  Log(absl::StrCat(
      "listening on ", l.address,
      l.unix_socket == nullptr ? (absl::GetFlag(FLAGS_tls_client_ca).empty()
                                      ? " (TLS)"
                                      : " (TLS, client certificates required)")
                               : "",
      "; open files limit ",
      files == RLIM_INFINITY ? std::string("unlimited") : absl::StrCat(files),
      "; max_state_bytes=",
      state_limit == 0 ? std::string("unlimited") : absl::StrCat(state_limit)));
}

// Waits for SIGINT or SIGTERM (meanwhile, every second, logs how many
// refused calls an ended window of the refusal log left out), then stops:
// new calls are refused while the queued ones finish (--shutdown_grace_s at
// most), the server shuts down, and every session is saved to --save_dir.
void AwaitShutdown(const sigset_t& signals,
                   optimd::OptimizerServiceImpl& service, grpc::Server& server,
                   Listener& listener,
                   const optimd::RestartStore& restart_store,
                   optimd::SessionRegistry& registry,
                   optimd::RefusalLog& refusals) {
  const timespec second = {1, 0};
  int sig;
  while ((sig = sigtimedwait(&signals, nullptr, &second)) < 0) {
    refusals.Flush(absl::Now());
  }
  Log(absl::StrCat("received ", sig == SIGINT ? "SIGINT" : "SIGTERM",
                   "; finishing in-flight calls"));
  // Every slow call runs on a device worker, so in-flight work is what the
  // workers still hold. gRPC's own Shutdown then has nothing left to wait
  // for (given a deadline, it would also wait on idle client connections).
  service.StartDraining();
  // Steps waiting for the other ranks of their job would hold their
  // sessions (and the save below) until --rank_timeout_s: end those waits.
  registry.AbortExchanges("the daemon is stopping");
  const absl::Time deadline =
      absl::Now() + absl::Seconds(absl::GetFlag(FLAGS_shutdown_grace_s));
  while (service.pending() > 0 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  if (service.pending() > 0) {
    optimd::log::Warn("grace period over; cancelling the calls still running");
  }
  // No connection may reach the server once it shuts down. The descriptor
  // socket goes first, and closes the descriptors no registration took.
  if (listener.fd_socket != nullptr) listener.fd_socket->Stop();
  if (listener.unix_socket != nullptr) listener.unix_socket->Stop();
  if (listener.tcp != nullptr) listener.tcp->Stop();
  server.Shutdown(absl::ToChronoTime(absl::Now()));
  // Steps of a trainer gone since the reaper's last look (or with no
  // reaper) still wait on the device for ready flags nobody will write;
  // the saves below and the sessions' end wait for the device's stream.
  // Let them through first (no session is freed: the grace is infinite).
  optimd::SessionRegistry::Reaped last =
      registry.Reap(absl::Now(), absl::InfiniteDuration());
  last.orphaned.clear();  // saved or dropped below, not kept
  optimd::LogReaped(last, absl::InfiniteDuration(), Log);
  refusals.Flush(absl::InfiniteFuture());  // no call is refused from here on
  // Nothing runs on the workers now: every session's state is at a step
  // boundary.
  const auto saved = restart_store.SaveAll(
      registry, absl::Seconds(absl::GetFlag(FLAGS_shutdown_save_s)), Log,
      optimd::log::Warn);
  if (saved.out_of_time) {
    // A save is still writing on its own thread, over state the normal
    // exit would free: end here (its temporary file is removed at the next
    // start).
    // (The log is flushed line by line.)
    Fail("stopped before every session was saved");
    std::_Exit(1);
  }
}

// One device worker per backend (GPUs come first, by device).
std::vector<std::unique_ptr<optimd::DeviceWorker>> MakeWorkers(
    const std::vector<std::unique_ptr<optimd::Backend>>& backends) {
  std::vector<std::unique_ptr<optimd::DeviceWorker>> workers;
  for (size_t d = 0; d < backends.size(); ++d) {
    workers.push_back(std::make_unique<optimd::DeviceWorker>(
        backends[d]->kind() == optimd::BackendKind::kCpu
            ? std::string("optimd-cpu")
            : absl::StrCat("optimd-gpu", d)));
  }
  return workers;
}

// The reaper of orphaned sessions (null with a negative --orphan_grace_s:
// they are kept until evicted).
std::unique_ptr<optimd::SessionReaper> StartReaper(
    optimd::SessionRegistry& registry) {
  if (absl::GetFlag(FLAGS_orphan_grace_s) < 0) return nullptr;
  const absl::Duration grace =
      absl::Seconds(absl::GetFlag(FLAGS_orphan_grace_s));
  return std::make_unique<optimd::SessionReaper>(
      &registry, grace,
      std::min(absl::Seconds(1), grace / 4 + absl::Milliseconds(50)), Log);
}

// The HTTP metrics endpoint when --metrics_listen is set; non-zero (the
// exit code, logged) when it cannot start.
int StartMetricsHttp(const optimd::OptimizerServiceImpl& service,
                     std::unique_ptr<optimd::MetricsHttpServer>* out) {
  if (absl::GetFlag(FLAGS_metrics_listen).empty()) return 0;
  auto started = optimd::MetricsHttpServer::Start(
      absl::GetFlag(FLAGS_metrics_listen),
      [&service] { return service.PrometheusText(); });
  if (!started.ok()) {
    Fail(std::string(started.status().message()));
    return 2;
  }
  *out = *std::move(started);
  Log(absl::StrCat("metrics on http port ", (*out)->port(), " (GET /metrics)"));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  ParseFlags(argc, argv);
  // Block the shutdown signals in every thread; one thread waits for them.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  // A client closing its connection mid-write must not kill the daemon.
  signal(SIGPIPE, SIG_IGN);
  // A file written past the file size limit (ulimit -f) must fail its write
  // (EFBIG, a status for the call), not kill the daemon.
  signal(SIGXFSZ, SIG_IGN);
  const rlim_t files = RaiseFileLimit();

  // Outlives the backends and the descriptor socket, which use it.
  const size_t held_bound = HeldDescriptorBound(files);
  optimd::FdStore fd_store(
      held_bound, std::min(held_bound, kMaxHeldDescriptorsPerConnection));
  std::vector<std::unique_ptr<optimd::Backend>> backends =
      MakeBackends(&fd_store, files);
  if (backends.empty()) return 2;
  Listener listener;
  if (const int code = OpenListener(&listener); code != 0) return code;
  if (const int code = StartFdSocket(&listener, &fd_store, files); code != 0) {
    return code;
  }
  optimd::StateBudget budget(absl::GetFlag(FLAGS_max_state_bytes),
                             absl::GetFlag(FLAGS_max_metadata_bytes));
  std::vector<optimd::Backend*> backend_ptrs;
  for (const auto& b : backends) backend_ptrs.push_back(b.get());
  std::vector<std::unique_ptr<optimd::DeviceWorker>> workers =
      MakeWorkers(backends);
  std::vector<optimd::DeviceWorker*> worker_ptrs;
  for (const auto& w : workers) worker_ptrs.push_back(w.get());
  optimd::SessionRegistry registry(backend_ptrs, &budget);
  registry.set_rank_timeout(
      absl::Seconds(std::max(0.0, absl::GetFlag(FLAGS_rank_timeout_s))));
  registry.set_tensor_name_rule(optimd::CheckCheckpointKeys);
  optimd::CheckpointOptions checkpoint_options;
  checkpoint_options.state_dir = absl::GetFlag(FLAGS_state_dir);
  optimd::OptimizerServiceImpl service(&registry, worker_ptrs,
                                       checkpoint_options);
  std::unique_ptr<optimd::RestartStore> restart_store;
  if (const int code =
          ConfigureService(service, checkpoint_options, &restart_store);
      code != 0) {
    return code;
  }
  std::unique_ptr<optimd::SessionReaper> reaper = StartReaper(registry);
  std::unique_ptr<optimd::MetricsHttpServer> metrics_http;
  if (const int code = StartMetricsHttp(service, &metrics_http); code != 0) {
    return code;
  }

  optimd::RefusalLog refusals(
      [](const std::string& line) { optimd::log::Warn(line); });
  std::unique_ptr<grpc::Server> server =
      StartServer(listener, service, &refusals);
  if (server == nullptr) return 1;
  LogListening(listener, files, budget.limit());
  optimd::RouteGrpcLog();
  std::thread waiter([&] {
    AwaitShutdown(signals, service, *server, listener, *restart_store, registry,
                  refusals);
  });
  server->Wait();
  waiter.join();
  service.EndDrains();           // the workers go now, the sessions later
  workers.clear();               // runs what is still queued
  listener.fd_socket.reset();    // stopped above: its files are gone
  listener.unix_socket.reset();  // removes the socket file and its lock
  Log("stopped");
  return 0;
}
