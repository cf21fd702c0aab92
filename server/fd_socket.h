// FdSocket: the daemon's descriptor socket, on which trainers pass it the
// POSIX file descriptors of their CUDA memory (cuMemExportToShareableHandle
// of torch's expandable segments), which gRPC cannot carry. Each descriptor
// goes into an FdStore under a 16-byte id the trainer chose, and stays
// there while its connection lasts: the CUDA backend imports the chunk
// from a duplicate whenever a buffer names the id and it holds no mapping.
//
// The socket is a Unix socket of type SOCK_SEQPACKET (the daemon puts it
// at "<its socket path>.fds"), created with mode 0600 and claimed as the
// gRPC socket is (server/socket_file.h: "<path>.lock" held while it lives,
// a dead daemon's stale file replaced, a live one's refused).
//
// Wire format, one message per batch of descriptors:
//   payload: "OFD1", N as a uint32 little-endian (1..kMaxBatch), then N
//            ids of 16 bytes;
//   ancillary data: SCM_RIGHTS carrying exactly N descriptors, the i-th
//            kept under the i-th id.
// Each message is answered with one byte (Reply): stored; refused (a
// malformed message, an id given twice or already held, or a descriptor
// that is a socket or an anonymous inode such as an io_uring, which could
// keep its own connection from ever ending: none of its descriptors is
// kept); store full (or the daemon out of descriptors). A connection's
// descriptors are closed when it ends, so a trainer keeps it open while it
// names their chunks.
//
// Bounds: at most max_connections connections at once (more are closed as
// soon as accepted), the FdStore's own bounds on descriptors. One thread
// serves every connection through poll(); sockets are non-blocking, a
// client that does not read its replies is disconnected, and no message
// can make the daemon keep a descriptor it was not asked to keep.
//
// Thread-safety: Start, Stop and the destructor are called from one
// thread; the loop runs on a thread of its own, the only one that touches
// the sockets once started. The FdStore is thread-safe and must outlive
// the FdSocket.
#ifndef OPTIMD_SERVER_FD_SOCKET_H_
#define OPTIMD_SERVER_FD_SOCKET_H_

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "common/fd_store.h"
#include "common/unique_fd.h"

namespace optimd {

class FdSocket {
 public:
  // Connections served at once by default; one more is closed when
  // accepted. Each optimizer of a trainer under expandable segments holds
  // one, and briefly one more per release of memory (until its steps sent
  // before are answered): a node's trainers stay far below this.
  static constexpr size_t kDefaultMaxConnections = 1024;
  // Descriptors in one message at most.
  static constexpr uint32_t kMaxBatch = 64;
  // The first four bytes of every message.
  static constexpr char kMagic[4] = {'O', 'F', 'D', '1'};
  // Magic and count.
  static constexpr size_t kHeaderBytes = 8;

  // The byte answering each message.
  enum class Reply : uint8_t {
    kStored = 0,   // every descriptor of the message is kept
    kRefused = 1,  // malformed, a bad id or a bad descriptor: none kept
    kFull = 2,     // the store's bounds, or no descriptor left: none kept
  };

  // Serves `path` into `store`, which must outlive this FdSocket, to at
  // most `max_connections` connections at once (at least 1).
  FdSocket(std::string path, FdStore* store,
           size_t max_connections = kDefaultMaxConnections)
      : path_(std::move(path)),
        store_(store),
        max_connections_(std::max<size_t>(max_connections, 1)) {}
  FdSocket(const FdSocket&) = delete;
  FdSocket& operator=(const FdSocket&) = delete;
  ~FdSocket() { Stop(); }

  // Claims the path (ALREADY_EXISTS when another daemon holds it,
  // FAILED_PRECONDITION when a file that is not a socket is there,
  // INVALID_ARGUMENT for a path too long), creates the socket file and
  // starts serving. The message says which socket and what to do. Call
  // once.
  absl::Status Start();

  // Stops serving, closes every connection (and with it the descriptors
  // it brought and nobody took), then removes the socket file and its lock
  // file. Idempotent.
  void Stop();

  const std::string& path() const { return path_; }

 private:
  struct Connection {
    UniqueFd fd;
    uint64_t owner;  // its descriptors' owner in the store
  };

  // Claims path_ and listens on it (sets lock_ and listener_); on failure
  // holds neither and leaves no file of its own behind.
  absl::Status Listen();
  // The loop's body: until Stop, waits for connections and messages.
  void Run();
  // Accepts the connections waiting (at most max_connections_ + 1 a call);
  // false when descriptors or memory ran out (the loop then waits before
  // accepting again).
  bool AcceptWaiting();
  // Receives one message of `c` and answers it; false when the connection
  // has ended or must be dropped.
  bool Serve(const Connection& c);
  // Ends connection `i`: closes it and the descriptors it brought.
  void Drop(size_t i);

  // Constant after construction.
  const std::string path_;
  FdStore* const store_;
  const size_t max_connections_;

  // Set by Start, reset by Stop; read by the loop's thread while it runs.
  UniqueFd lock_;      // "<path>.lock", held while the socket file is ours
  UniqueFd listener_;  // the listening socket
  UniqueFd wake_fd_;   // an eventfd: written by Stop to end the loop
  std::thread thread_;

  // The loop thread's own while it runs.
  std::vector<Connection> connections_;
  bool at_limit_ = false;  // connections refused since the last free slot
};

}  // namespace optimd

#endif  // OPTIMD_SERVER_FD_SOCKET_H_
