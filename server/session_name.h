// How log lines name a session: "job '<id>' rank <r>", the id cut at 200
// bytes (a client chooses it; a line stays readable). Thread-safe.
#ifndef OPTIMD_SERVER_SESSION_NAME_H_
#define OPTIMD_SERVER_SESSION_NAME_H_

#include <string>

#include "core/session.h"

namespace optimd {

std::string SessionName(const SessionIdentity& id);

}  // namespace optimd

#endif  // OPTIMD_SERVER_SESSION_NAME_H_
