// gRPC's own log lines (gpr_log, errors only by default) in the daemon's
// log, and the one among them that says a listener of gRPC's stopped for
// good: the gRPC of Debian 12 (1.51) never accepts on a listener again once
// its accept has failed for lack of descriptors (grpc/grpc#16058, #20418,
// #31080), and says so only in that line ("Failed accept4"). The daemon
// accepts its Unix socket itself (UnixSocketListener), so that line is
// about a TCP listener.
//
// Thread-safe. Install once, before the server starts.
#ifndef OPTIMD_SERVER_GRPC_LOG_H_
#define OPTIMD_SERVER_GRPC_LOG_H_

#include <string>

namespace optimd {

// Routes gRPC's log lines into the daemon's log; the first "Failed accept4"
// also logs `listener_stopped` (what it means for the operator).
void RouteGrpcLog(const std::string& listener_stopped);

// Whether gRPC has said that a listener's accept failed.
bool GrpcListenerStopped();

}  // namespace optimd

#endif  // OPTIMD_SERVER_GRPC_LOG_H_
