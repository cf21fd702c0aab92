#include "server/version_metadata.h"

#include <string>

#include "common/version.h"

namespace optimd {
namespace {

class VersionMetadata : public grpc::experimental::Interceptor {
 public:
  void Intercept(
      grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(
            grpc::experimental::InterceptionHookPoints::
                PRE_SEND_INITIAL_METADATA)) {
      auto* metadata = methods->GetSendInitialMetadata();
      metadata->emplace(kVersionMetadataKey, kVersion);
      metadata->emplace(kApiRevisionMetadataKey, std::to_string(kApiRevision));
    }
    methods->Proceed();
  }
};

}  // namespace

grpc::experimental::Interceptor*
VersionMetadataFactory::CreateServerInterceptor(
    grpc::experimental::ServerRpcInfo* /*info*/) {
  return new VersionMetadata();
}

}  // namespace optimd
