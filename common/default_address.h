// The daemon's default listen address, shared by the daemon and its clients.
#ifndef OPTIMD_COMMON_DEFAULT_ADDRESS_H_
#define OPTIMD_COMMON_DEFAULT_ADDRESS_H_

#include <string>

namespace optimd {

// "unix:$XDG_RUNTIME_DIR/optimd.sock" when XDG_RUNTIME_DIR is set, else
// "unix:/tmp/optimd-<uid>.sock". OPTIMD_ADDRESS overrides both.
std::string DefaultAddress();

}  // namespace optimd

#endif  // OPTIMD_COMMON_DEFAULT_ADDRESS_H_
