#include "client/client.h"

#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"
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
    return absl::UnavailableError(absl::StrCat(
        "no optimd daemon answers at ", target, " (waited ",
        absl::FormatDuration(options.connect_timeout),
        "); start it with bazel-bin/server/optimd --listen=", target));
  }
  return std::unique_ptr<Client>(new Client(std::move(channel), options));
}

Client::Client(std::shared_ptr<grpc::Channel> channel,
               const ClientOptions& options)
    : options_(options),
      channel_(std::move(channel)),
      stub_(v1::Optimizer::NewStub(channel_)) {}

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
  v1::CreateSessionResponse response;
  absl::Status s =
      FromGrpcStatus(stub_->CreateSession(&context, request, &response));
  if (!s.ok()) return s;
  token_ = response.session_token();
  return response;
}

absl::Status Client::CloseSession() {
  if (stream_ != nullptr) {
    stream_->WritesDone();
    (void)stream_->Finish();
    stream_.reset();
    stream_context_.reset();
  }
  grpc::ClientContext context;
  Prepare(&context);
  v1::CloseSessionResponse response;
  absl::Status s = FromGrpcStatus(
      stub_->CloseSession(&context, v1::CloseSessionRequest(), &response));
  if (s.ok()) token_.clear();
  return s;
}

absl::StatusOr<v1::RegisterGroupResponse> Client::RegisterGroup(
    const v1::RegisterGroupRequest& request) {
  grpc::ClientContext context;
  Prepare(&context);
  v1::RegisterGroupResponse response;
  absl::Status s =
      FromGrpcStatus(stub_->RegisterGroup(&context, request, &response));
  if (!s.ok()) return s;
  return response;
}

absl::Status Client::UnregisterGroup(const std::string& group_id) {
  grpc::ClientContext context;
  Prepare(&context);
  v1::UnregisterGroupRequest request;
  request.set_group_id(group_id);
  v1::UnregisterGroupResponse response;
  return FromGrpcStatus(stub_->UnregisterGroup(&context, request, &response));
}

absl::Status Client::UpdateBuffers(const v1::UpdateBuffersRequest& request) {
  grpc::ClientContext context;
  Prepare(&context);
  v1::UpdateBuffersResponse response;
  return FromGrpcStatus(stub_->UpdateBuffers(&context, request, &response));
}

absl::StatusOr<v1::StepResponse> Client::Step(const v1::StepRequest& request) {
  grpc::ClientContext context;
  Prepare(&context);
  v1::StepResponse response;
  absl::Status s = FromGrpcStatus(stub_->Step(&context, request, &response));
  if (!s.ok()) return s;
  return response;
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
    return s;
  }
  return response;
}

absl::StatusOr<v1::GetParamsResponse> Client::GetParams(
    const v1::GetParamsRequest& request) {
  grpc::ClientContext context;
  Prepare(&context);
  v1::GetParamsResponse response;
  absl::Status s =
      FromGrpcStatus(stub_->GetParams(&context, request, &response));
  if (!s.ok()) return s;
  return response;
}

absl::StatusOr<v1::GetStateResponse> Client::GetState(
    const v1::GetStateRequest& request) {
  grpc::ClientContext context;
  Prepare(&context);
  v1::GetStateResponse response;
  absl::Status s =
      FromGrpcStatus(stub_->GetState(&context, request, &response));
  if (!s.ok()) return s;
  return response;
}

absl::Status Client::SetState(const v1::SetStateRequest& request) {
  grpc::ClientContext context;
  Prepare(&context);
  v1::SetStateResponse response;
  return FromGrpcStatus(stub_->SetState(&context, request, &response));
}

absl::StatusOr<v1::ListSessionsResponse> Client::ListSessions() {
  grpc::ClientContext context;
  Prepare(&context);
  v1::ListSessionsResponse response;
  absl::Status s = FromGrpcStatus(
      stub_->ListSessions(&context, v1::ListSessionsRequest(), &response));
  if (!s.ok()) return s;
  return response;
}

absl::Status Client::EvictSession(const std::string& job_id, uint32_t rank) {
  grpc::ClientContext context;
  Prepare(&context);
  v1::EvictSessionRequest request;
  request.set_job_id(job_id);
  request.set_rank(rank);
  v1::EvictSessionResponse response;
  return FromGrpcStatus(stub_->EvictSession(&context, request, &response));
}

absl::StatusOr<v1::GetMetricsResponse> Client::GetMetrics() {
  grpc::ClientContext context;
  Prepare(&context);
  v1::GetMetricsResponse response;
  absl::Status s = FromGrpcStatus(
      stub_->GetMetrics(&context, v1::GetMetricsRequest(), &response));
  if (!s.ok()) return s;
  return response;
}

absl::StatusOr<std::string> Client::Health() {
  auto stub = grpc::health::v1::Health::NewStub(channel_);
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + options_.timeout));
  grpc::health::v1::HealthCheckResponse response;
  absl::Status s = FromGrpcStatus(
      stub->Check(&context, grpc::health::v1::HealthCheckRequest(), &response));
  if (!s.ok()) return s;
  return grpc::health::v1::HealthCheckResponse::ServingStatus_Name(
      response.status());
}

}  // namespace optimd
