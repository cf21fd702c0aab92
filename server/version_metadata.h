// Sends the daemon's version and API revision in the initial metadata of
// every reply (kVersionMetadataKey, kApiRevisionMetadataKey of
// common/version.h), so that calls whose messages have no room for them,
// the grpc.health.v1 Check above all, still say which daemon answered.
//
// VersionMetadataFactory is a gRPC server interceptor factory (one
// interceptor per call). Thread-safe.
#ifndef OPTIMD_SERVER_VERSION_METADATA_H_
#define OPTIMD_SERVER_VERSION_METADATA_H_

#include <grpcpp/support/server_interceptor.h>

namespace optimd {

class VersionMetadataFactory
    : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override;
};

}  // namespace optimd

#endif  // OPTIMD_SERVER_VERSION_METADATA_H_
