// gRPC's own log lines (gpr_log, errors only by default) in the daemon's
// log, as warnings (errors) or information (the rest).
//
// Thread-safe. Install once, before the server starts.
#ifndef OPTIMD_SERVER_GRPC_LOG_H_
#define OPTIMD_SERVER_GRPC_LOG_H_

namespace optimd {

// Routes gRPC's log lines into the daemon's log.
void RouteGrpcLog();

}  // namespace optimd

#endif  // OPTIMD_SERVER_GRPC_LOG_H_
