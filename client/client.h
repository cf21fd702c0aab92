// The optimd C++ client: one channel to a daemon and, after CreateSession,
// one session. Every call carries a deadline. Not thread-safe for
// CreateSession/CloseSession; other calls may run concurrently.
#ifndef OPTIMD_CLIENT_CLIENT_H_
#define OPTIMD_CLIENT_CLIENT_H_

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/version.h"
#include "optimd/v1/optimd.grpc.pb.h"

namespace optimd {

struct ClientOptions {
  // Deadline of every call.
  absl::Duration timeout = absl::Seconds(60);
  // How long Create waits for the channel to connect.
  absl::Duration connect_timeout = absl::Seconds(10);
  // TLS for a TCP target (a daemon on TCP always speaks TLS): PEM contents
  // of the CA that signed the daemon's certificate and, when the daemon
  // requires client certificates, this client's chain and key. Unused for
  // unix: targets.
  std::string tls_root_certs;
  std::string tls_cert_chain;
  std::string tls_private_key;
  // The daemon's admin token (its --admin_token_file), sent in the
  // x-optimd-admin metadata of every call when set: admin calls
  // (ListSessions, EvictSession) over TCP need it, and so does
  // CreateSession over TCP to a daemon that checks no client certificates.
  std::string admin_token;
  // The API revision this client needs of a daemon (common/version.h says
  // what each added): CreateSession and CheckDaemonVersion refuse an older
  // daemon. Tests raise it to see the refusal against a current daemon.
  uint32_t required_api_revision = kApiRevision;
};

// Fills the TLS fields of *options from PEM files; an empty path leaves its
// field as it is. NOT_FOUND or INVALID_ARGUMENT naming the file otherwise.
absl::Status LoadTlsFiles(const std::string& ca_path,
                          const std::string& cert_path,
                          const std::string& key_path, ClientOptions* options);

// A daemon's grpc.health.v1 status and the version it sends beside it.
struct HealthReport {
  // "SERVING", "NOT_SERVING", ...
  std::string status;
  // The daemon's version and API revision (common/version.h); empty and 0
  // when the daemon sends none (an older daemon).
  std::string daemon_version;
  uint32_t api_revision = 0;
};

// gRPC status to absl::Status (same code table), keeping the message.
absl::Status FromGrpcStatus(const grpc::Status& s);

class Client {
 public:
  // Connects to `target` ("unix:/path", or "host:port" over TLS);
  // UNAVAILABLE if no daemon answers within options.connect_timeout,
  // INVALID_ARGUMENT for a TCP target without options.tls_root_certs.
  // What cannot reach a daemon is refused at once, saying why
  // (CheckAddress: a bare socket path, a missing socket file, another
  // user's socket).
  static absl::StatusOr<std::unique_ptr<Client>> Create(
      const std::string& target, const ClientOptions& options = {});

  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  // FAILED_PRECONDITION, naming both versions, when the daemon speaks an
  // API revision below options.required_api_revision (asked by GetMetrics);
  // the error of that call when it fails.
  absl::Status CheckDaemonVersion();

  // Opens a session; later calls carry its token. A daemon older than
  // options.required_api_revision is refused (FAILED_PRECONDITION naming
  // both versions) and the session it opened is closed again.
  absl::StatusOr<v1::CreateSessionResponse> CreateSession(
      const v1::CreateSessionRequest& request);
  absl::Status CloseSession();
  absl::StatusOr<v1::RegisterGroupResponse> RegisterGroup(
      const v1::RegisterGroupRequest& request);
  absl::Status UnregisterGroup(const std::string& group_id);
  absl::Status UpdateBuffers(const v1::UpdateBuffersRequest& request);
  absl::StatusOr<v1::StepResponse> Step(const v1::StepRequest& request);
  // Steps over the session's StepStream (opened on first use, kept open).
  absl::StatusOr<v1::StepResponse> StreamStep(const v1::StepRequest& request);
  absl::StatusOr<v1::GetParamsResponse> GetParams(
      const v1::GetParamsRequest& request);
  absl::StatusOr<v1::GetStateResponse> GetState(
      const v1::GetStateRequest& request);
  absl::Status SetState(const v1::SetStateRequest& request);

  // Checkpoints written and read by the daemon (a directory on its
  // machine), and the progress of a background save.
  absl::StatusOr<v1::SaveStateResponse> SaveState(
      const v1::SaveStateRequest& request);
  absl::StatusOr<v1::GetSaveStatusResponse> GetSaveStatus();
  absl::StatusOr<v1::LoadStateResponse> LoadState(const std::string& directory);
  // The session's checkpoint file streamed to this process: `sink` gets
  // each chunk in order (a non-OK status from it cancels the stream and is
  // returned). The file's size on success.
  absl::StatusOr<uint64_t> SaveStateStream(
      const v1::SaveStateStreamRequest& request,
      const std::function<absl::Status(const v1::StateChunk&)>& sink);
  // A checkpoint file streamed from this process: `source` fills the next
  // chunk and returns true, or returns false after the last.
  absl::StatusOr<v1::LoadStateResponse> LoadStateStream(
      const std::function<bool(v1::StateChunk*)>& source);

  absl::StatusOr<v1::ListSessionsResponse> ListSessions();
  // Closes the session of `job_id` and `rank` (an operator's eviction).
  absl::Status EvictSession(const std::string& job_id, uint32_t rank);
  absl::StatusOr<v1::GetMetricsResponse> GetMetrics();
  // The grpc.health.v1 status of the daemon: "SERVING", "NOT_SERVING", ...
  absl::StatusOr<std::string> Health();
  // The same, with the version and API revision the daemon sends beside it
  // (HealthReport says what a daemon that sends none gives).
  absl::StatusOr<HealthReport> CheckHealth();

  const std::string& session_token() const { return token_; }
  // Uses another session's token (tests; tools).
  void set_session_token(std::string token) { token_ = std::move(token); }

 private:
  Client(std::string target, std::shared_ptr<grpc::Channel> channel,
         const ClientOptions& options);
  void Prepare(grpc::ClientContext* context) const;
  // `s`, said again as the loss of the daemon when a call of an open
  // session found none (ExplainSessionStatus).
  absl::Status Explain(const absl::Status& s) const;
  // One unary call: a context with the deadline and the session's (and
  // admin) metadata, the stub's `method`, its status as absl::Status
  // (Explain).
  // `deadline`: the call's, instead of the client's timeout from now.
  template <class Response, class Request>
  absl::StatusOr<Response> Call(
      grpc::Status (v1::Optimizer::Stub::*method)(grpc::ClientContext*,
                                                  const Request&, Response*),
      const Request& request,
      std::optional<absl::Time> deadline = std::nullopt) {
    grpc::ClientContext context;
    Prepare(&context);
    if (deadline) context.set_deadline(absl::ToChronoTime(*deadline));
    Response response;
    absl::Status s =
        FromGrpcStatus((stub_.get()->*method)(&context, request, &response));
    if (s.code() == absl::StatusCode::kUnimplemented) {
      if (absl::Status older = RefuseIfOlder(); !older.ok()) return older;
    }
    if (!s.ok()) return Explain(s);
    return response;
  }
  // Call for a call that changes nothing. Refused because the daemon's
  // replies not yet read hold its memory bound (other callers' large reads
  // at the same moment: RepliesNotYetRead), it is sent again after a pause
  // that grows from 50 ms to 1 s, within the client's timeout in all.
  template <class Response, class Request>
  absl::StatusOr<Response> Read(
      grpc::Status (v1::Optimizer::Stub::*method)(grpc::ClientContext*,
                                                  const Request&, Response*),
      const Request& request) {
    const absl::Time deadline = absl::Now() + options_.timeout;
    absl::Duration pause = absl::Milliseconds(50);
    for (;;) {
      absl::StatusOr<Response> r = Call(method, request, deadline);
      if (r.ok() || !RepliesNotYetRead(r.status()) ||
          absl::Now() + pause > deadline) {
        return r;
      }
      absl::SleepFor(pause);
      pause = std::min(2 * pause, absl::Seconds(1));
    }
  }
  // Whether `s` is the daemon's refusal of a reply while replies not yet
  // read by their callers hold its request memory.
  static bool RepliesNotYetRead(const absl::Status& s);
  // After an UNIMPLEMENTED call: FAILED_PRECONDITION naming both versions
  // when the daemon is older than this client needs (a call without a
  // session is never checked against the revision otherwise); OK when it
  // is not, or does not say.
  absl::Status RefuseIfOlder() const;

  const ClientOptions options_;
  const std::string target_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Optimizer::Stub> stub_;
  std::string token_;
  std::unique_ptr<grpc::ClientContext> stream_context_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::StepRequest, v1::StepResponse>>
      stream_;
};

}  // namespace optimd

#endif  // OPTIMD_CLIENT_CLIENT_H_
