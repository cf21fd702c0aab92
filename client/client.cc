#include "client/client.h"

#include <grpcpp/grpcpp.h>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "client/daemon_checks.h"
#include "common/pem_file.h"
#include "grpc/health/v1/health.grpc.pb.h"

namespace optimd {

absl::Status FromGrpcStatus(const grpc::Status& s) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                      s.error_message());
}

absl::Status LoadTlsFiles(const std::string& ca_path,
                          const std::string& cert_path,
                          const std::string& key_path, ClientOptions* options) {
  const std::pair<const std::string*, std::string*> files[] = {
      {&ca_path, &options->tls_root_certs},
      {&cert_path, &options->tls_cert_chain},
      {&key_path, &options->tls_private_key}};
  const char* what[] = {"CA certificate", "certificate", "key"};
  for (int i = 0; i < 3; ++i) {
    if (files[i].first->empty()) continue;
    auto pem = ReadPemFile(what[i], *files[i].first);
    if (!pem.ok()) return pem.status();
    *files[i].second = *std::move(pem);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Client>> Client::Create(
    const std::string& target, const ClientOptions& options) {
  if (absl::Status s = CheckAddress(target); !s.ok()) return s;
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  args.SetMaxSendMessageSize(-1);
  std::shared_ptr<grpc::ChannelCredentials> credentials;
  if (target.rfind("unix:", 0) == 0) {
    credentials = grpc::InsecureChannelCredentials();
  } else {
    if (options.tls_root_certs.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("a daemon on TCP (", target,
                       ") speaks TLS only: give the CA "
                       "certificate that signed its certificate (ClientOptions."
                       "tls_root_certs; optimctl --tls_ca)"));
    }
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = options.tls_root_certs;
    ssl.pem_cert_chain = options.tls_cert_chain;
    ssl.pem_private_key = options.tls_private_key;
    credentials = grpc::SslCredentials(ssl);
  }
  auto channel = grpc::CreateCustomChannel(target, credentials, args);
  if (!channel->WaitForConnected(
          absl::ToChronoTime(absl::Now() + options.connect_timeout))) {
    return absl::UnavailableError(
        absl::StrCat("no optimd daemon answers at ", target, " (waited ",
                     absl::FormatDuration(options.connect_timeout),
                     "); start it with `optimd --listen=", target, "`"));
  }
  return std::unique_ptr<Client>(
      new Client(target, std::move(channel), options));
}

Client::Client(std::string target, std::shared_ptr<grpc::Channel> channel,
               const ClientOptions& options)
    : options_(options),
      target_(std::move(target)),
      channel_(std::move(channel)),
      stub_(v1::Optimizer::NewStub(channel_)) {}

absl::Status Client::Explain(const absl::Status& s) const {
  return token_.empty() ? s : ExplainSessionStatus(target_, s);
}

bool Client::RepliesNotYetRead(const absl::Status& s) {
  return s.code() == absl::StatusCode::kResourceExhausted &&
         absl::StrContains(s.message(), "replies not yet read");
}

void Client::Prepare(grpc::ClientContext* context) const {
  context->set_deadline(absl::ToChronoTime(absl::Now() + options_.timeout));
  if (!token_.empty()) context->AddMetadata("x-optimd-session", token_);
  if (!options_.admin_token.empty()) {
    context->AddMetadata("x-optimd-admin", options_.admin_token);
  }
}

absl::StatusOr<v1::CreateSessionResponse> Client::CreateSession(
    const v1::CreateSessionRequest& request) {
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + options_.timeout));
  // No session token (a new session is asked for); the admin token opens
  // sessions over TCP to a daemon that checks no client certificates.
  if (!options_.admin_token.empty()) {
    context.AddMetadata("x-optimd-admin", options_.admin_token);
  }
  v1::CreateSessionResponse response;
  absl::Status s =
      FromGrpcStatus(stub_->CreateSession(&context, request, &response));
  if (!s.ok()) return s;
  token_ = response.session_token();
  s = CheckApiRevision(target_, response.daemon_version(),
                       response.api_revision(), options_.required_api_revision);
  if (!s.ok()) {
    // Too old to speak what this client sends: leave no session behind.
    (void)CloseSession();
    token_.clear();
    return s;
  }
  return response;
}

absl::Status Client::CheckDaemonVersion() {
  auto metrics = GetMetrics();
  if (!metrics.ok()) return metrics.status();
  return CheckApiRevision(target_, metrics->daemon_version(),
                          metrics->api_revision(),
                          options_.required_api_revision);
}

absl::Status Client::RefuseIfOlder() const {
  grpc::ClientContext context;
  Prepare(&context);
  v1::GetMetricsResponse metrics;
  if (!stub_->GetMetrics(&context, v1::GetMetricsRequest(), &metrics).ok()) {
    return absl::OkStatus();
  }
  return CheckApiRevision(target_, metrics.daemon_version(),
                          metrics.api_revision(),
                          options_.required_api_revision);
}

absl::Status Client::CloseSession() {
  if (stream_ != nullptr) {
    stream_->WritesDone();
    (void)stream_->Finish();
    stream_.reset();
    stream_context_.reset();
  }
  absl::Status s =
      Call(&v1::Optimizer::Stub::CloseSession, v1::CloseSessionRequest())
          .status();
  if (s.ok()) token_.clear();
  return s;
}

absl::StatusOr<v1::RegisterGroupResponse> Client::RegisterGroup(
    const v1::RegisterGroupRequest& request) {
  return Call(&v1::Optimizer::Stub::RegisterGroup, request);
}

absl::Status Client::UnregisterGroup(const std::string& group_id) {
  v1::UnregisterGroupRequest request;
  request.set_group_id(group_id);
  return Call(&v1::Optimizer::Stub::UnregisterGroup, request).status();
}

absl::Status Client::UpdateBuffers(const v1::UpdateBuffersRequest& request) {
  return Call(&v1::Optimizer::Stub::UpdateBuffers, request).status();
}

absl::StatusOr<v1::StepResponse> Client::Step(const v1::StepRequest& request) {
  return Call(&v1::Optimizer::Stub::Step, request);
}

absl::StatusOr<v1::StepResponse> Client::StreamStep(
    const v1::StepRequest& request) {
  if (stream_ == nullptr) {
    stream_context_ = std::make_unique<grpc::ClientContext>();
    if (!token_.empty()) {
      stream_context_->AddMetadata("x-optimd-session", token_);
    }
    stream_ = stub_->StepStream(stream_context_.get());
  }
  v1::StepResponse response;
  if (!stream_->Write(request) || !stream_->Read(&response)) {
    stream_->WritesDone();
    absl::Status s = FromGrpcStatus(stream_->Finish());
    stream_.reset();
    stream_context_.reset();
    if (s.ok()) s = absl::UnavailableError("step stream closed");
    return Explain(s);
  }
  return response;
}

absl::StatusOr<v1::GetParamsResponse> Client::GetParams(
    const v1::GetParamsRequest& request) {
  return Call(&v1::Optimizer::Stub::GetParams, request);
}

absl::StatusOr<v1::GetStateResponse> Client::GetState(
    const v1::GetStateRequest& request) {
  return Read(&v1::Optimizer::Stub::GetState, request);
}

absl::Status Client::SetState(const v1::SetStateRequest& request) {
  return Call(&v1::Optimizer::Stub::SetState, request).status();
}

absl::StatusOr<v1::SaveStateResponse> Client::SaveState(
    const v1::SaveStateRequest& request) {
  return Call(&v1::Optimizer::Stub::SaveState, request);
}

absl::StatusOr<v1::GetSaveStatusResponse> Client::GetSaveStatus() {
  return Call(&v1::Optimizer::Stub::GetSaveStatus, v1::GetSaveStatusRequest());
}

absl::StatusOr<v1::LoadStateResponse> Client::LoadState(
    const std::string& directory) {
  v1::LoadStateRequest request;
  request.set_directory(directory);
  return Call(&v1::Optimizer::Stub::LoadState, request);
}

absl::StatusOr<uint64_t> Client::SaveStateStream(
    const v1::SaveStateStreamRequest& request,
    const std::function<absl::Status(const v1::StateChunk&)>& sink) {
  grpc::ClientContext context;
  Prepare(&context);
  auto reader = stub_->SaveStateStream(&context, request);
  v1::StateChunk chunk;
  uint64_t total = 0;
  absl::Status refused;
  while (refused.ok() && reader->Read(&chunk)) {
    total = chunk.total_bytes();
    refused = sink(chunk);
  }
  if (!refused.ok()) {
    context.TryCancel();
    while (reader->Read(&chunk)) {
    }
  }
  const absl::Status s = FromGrpcStatus(reader->Finish());
  if (!refused.ok()) return refused;
  if (!s.ok()) return Explain(s);
  return total;
}

absl::StatusOr<v1::LoadStateResponse> Client::LoadStateStream(
    const std::function<bool(v1::StateChunk*)>& source) {
  grpc::ClientContext context;
  Prepare(&context);
  v1::LoadStateResponse response;
  auto writer = stub_->LoadStateStream(&context, &response);
  v1::StateChunk chunk;
  while (source(&chunk)) {
    // A failed write means the daemon ended the call: Finish says why.
    if (!writer->Write(chunk)) break;
    chunk.Clear();
  }
  writer->WritesDone();
  absl::Status s = FromGrpcStatus(writer->Finish());
  if (!s.ok()) return Explain(s);
  return response;
}

absl::StatusOr<v1::ListSessionsResponse> Client::ListSessions() {
  return Read(&v1::Optimizer::Stub::ListSessions, v1::ListSessionsRequest());
}

absl::Status Client::EvictSession(const std::string& job_id, uint32_t rank) {
  v1::EvictSessionRequest request;
  request.set_job_id(job_id);
  request.set_rank(rank);
  return Call(&v1::Optimizer::Stub::EvictSession, request).status();
}

absl::StatusOr<v1::GetMetricsResponse> Client::GetMetrics() {
  return Read(&v1::Optimizer::Stub::GetMetrics, v1::GetMetricsRequest());
}

absl::StatusOr<std::string> Client::Health() {
  absl::StatusOr<HealthReport> report = CheckHealth();
  if (!report.ok()) return report.status();
  return report->status;
}

absl::StatusOr<HealthReport> Client::CheckHealth() {
  auto stub = grpc::health::v1::Health::NewStub(channel_);
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + options_.timeout));
  grpc::health::v1::HealthCheckResponse response;
  absl::Status s = FromGrpcStatus(
      stub->Check(&context, grpc::health::v1::HealthCheckRequest(), &response));
  if (!s.ok()) return s;
  HealthReport report;
  report.status = grpc::health::v1::HealthCheckResponse::ServingStatus_Name(
      response.status());
  const auto& metadata = context.GetServerInitialMetadata();
  if (auto it = metadata.find(kVersionMetadataKey); it != metadata.end()) {
    report.daemon_version.assign(it->second.data(), it->second.size());
  }
  if (auto it = metadata.find(kApiRevisionMetadataKey); it != metadata.end()) {
    uint32_t revision = 0;
    if (absl::SimpleAtoi(
            absl::string_view(it->second.data(), it->second.size()),
            &revision)) {
      report.api_revision = revision;
    }
  }
  return report;
}

}  // namespace optimd
