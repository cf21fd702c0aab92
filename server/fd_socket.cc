#include "server/fd_socket.h"

#include <poll.h>
#include <pthread.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "server/log.h"
#include "server/socket_file.h"

namespace optimd {

namespace {

// How long accepting pauses when descriptors or memory ran out (the
// waiting connections stay queued meanwhile; the loop would spin on a
// listener that stays readable otherwise).
constexpr std::chrono::milliseconds kAcceptPause(100);

// The longest valid message; a longer one arrives truncated (MSG_TRUNC).
constexpr size_t kMaxMessageBytes =
    FdSocket::kHeaderBytes + FdSocket::kMaxBatch * FdStore::kIdBytes;

// Owners are unique in the process, not only per socket, so that sockets
// sharing a store never mix their connections' descriptors.
std::atomic<uint64_t> next_owner{1};

// One message as received.
struct Message {
  enum Kind {
    kBatch,    // ids and fds hold a well-formed batch
    kBad,      // malformed: answer kRefused (fds are closed with it)
    kNoRoom,   // the daemon ran out of descriptors receiving it: kFull
    kNothing,  // nothing to read after all
    kEnded,    // the peer is gone, or the connection failed
  };
  Kind kind = kNothing;
  std::vector<std::string> ids;
  std::vector<UniqueFd> fds;
};

// Every descriptor that arrived in `msg`'s ancillary data, owned so that it
// is closed whatever becomes of the message. Sets *other when data of
// another kind than SCM_RIGHTS came.
std::vector<UniqueFd> TakeDescriptors(msghdr* msg, bool* other) {
  std::vector<UniqueFd> fds;
  for (cmsghdr* c = CMSG_FIRSTHDR(msg); c != nullptr; c = CMSG_NXTHDR(msg, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) {
      *other = true;
      continue;
    }
    const size_t n = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    const unsigned char* data = CMSG_DATA(c);
    for (size_t i = 0; i < n; ++i) {
      int fd;
      std::memcpy(&fd, data + i * sizeof(int), sizeof(int));
      fds.emplace_back(fd);
    }
  }
  return fds;
}

// Whether the peer of `fd` has closed (or shut down) its end: a read of 0
// bytes is then the end, not an empty message.
bool PeerHungUp(int fd) {
  pollfd p = {fd, POLLRDHUP, 0};
  return poll(&p, 1, 0) == 1 && (p.revents & (POLLRDHUP | POLLHUP)) != 0;
}

// Whether `fd` may be kept: neither a socket nor a file of no type (an
// anonymous inode: io_uring, epoll, eventfd). A socket keeps its peer's
// connection open, and an io_uring the files registered with it: either
// may be the other end of the very connection that brought it, which then
// never ends while the daemon holds it, and the daemon holds it until that
// connection ends. A trainer's memory is a character device (CUDA exports
// it as a descriptor of /dev/nvidiactl) or a regular file (a memfd).
bool Keepable(int fd) {
  struct stat st;
  if (fstat(fd, &st) != 0) return false;
  const mode_t type = st.st_mode & S_IFMT;
  return type != 0 && type != S_IFSOCK;
}

uint32_t LittleEndian32(const unsigned char* b) {
  return uint32_t{b[0]} | uint32_t{b[1]} << 8 | uint32_t{b[2]} << 16 |
         uint32_t{b[3]} << 24;
}

// Checks the payload of `bytes` bytes against the wire format and the
// descriptors that came with it; fills m->ids when it is a batch.
Message::Kind ParseBatch(const unsigned char* payload, size_t bytes,
                         Message* m) {
  if (bytes < FdSocket::kHeaderBytes ||
      std::memcmp(payload, FdSocket::kMagic, sizeof(FdSocket::kMagic)) != 0) {
    return Message::kBad;
  }
  const uint32_t count = LittleEndian32(payload + 4);
  if (count < 1 || count > FdSocket::kMaxBatch ||
      bytes != FdSocket::kHeaderBytes + count * FdStore::kIdBytes ||
      m->fds.size() != count) {
    return Message::kBad;
  }
  for (const UniqueFd& fd : m->fds) {
    if (!Keepable(fd.get())) return Message::kBad;
  }
  for (uint32_t i = 0; i < count; ++i) {
    m->ids.emplace_back(reinterpret_cast<const char*>(payload) +
                            FdSocket::kHeaderBytes + i * FdStore::kIdBytes,
                        FdStore::kIdBytes);
  }
  return Message::kBatch;
}

// Receives one message from connection `fd`.
Message Receive(int fd) {
  Message m;
  // One byte more than the longest valid message, so that a longer one is
  // seen even where MSG_TRUNC would not say so.
  unsigned char payload[kMaxMessageBytes + 1];
  union {
    cmsghdr align;
    char bytes[CMSG_SPACE(sizeof(int) * FdSocket::kMaxBatch)];
  } control;
  iovec iov = {payload, sizeof(payload)};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control.bytes;
  msg.msg_controllen = sizeof(control.bytes);
  const ssize_t n = recvmsg(fd, &msg, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
  if (n < 0) {
    const bool again =
        errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR;
    m.kind = again ? Message::kNothing : Message::kEnded;
    return m;
  }
  bool other = false;
  m.fds = TakeDescriptors(&msg, &other);
  if (n == 0 && m.fds.empty() && !other && PeerHungUp(fd)) {
    m.kind = Message::kEnded;
  } else if ((msg.msg_flags & MSG_TRUNC) != 0 || other) {
    m.kind = Message::kBad;
  } else if ((msg.msg_flags & MSG_CTRUNC) != 0) {
    // The control buffer holds kMaxBatch descriptors: fewer and truncated
    // means the daemon had no descriptor left for the rest (the kernel
    // closed those it could not give).
    m.kind =
        m.fds.size() < FdSocket::kMaxBatch ? Message::kNoRoom : Message::kBad;
  } else {
    m.kind = ParseBatch(payload, static_cast<size_t>(n), &m);
  }
  return m;
}

}  // namespace

absl::Status FdSocket::Start() {
  if (thread_.joinable()) return absl::FailedPreconditionError("started");
  wake_fd_.reset(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  absl::Status s =
      wake_fd_.valid()
          ? Listen()
          : absl::InternalError(absl::StrCat("cannot create an eventfd: ",
                                             std::strerror(errno)));
  if (!s.ok()) {
    return absl::Status(
        s.code(), absl::StrCat("cannot serve the descriptor socket ", path_,
                               ": ", s.message()));
  }
  thread_ = std::thread([this] { Run(); });
  pthread_setname_np(thread_.native_handle(), "optimd-fds");
  return absl::OkStatus();
}

absl::Status FdSocket::Listen() {
  OPTIMD_ASSIGN_OR_RETURN(const sockaddr_un addr, SocketFileAddress(path_));
  OPTIMD_ASSIGN_OR_RETURN(UniqueFd lock, LockSocketFile(path_));
  const absl::Status claimed =
      RemoveStaleSocketFile(path_, addr, SOCK_SEQPACKET);
  absl::StatusOr<UniqueFd> listener =
      claimed.ok() ? ListenOnSocketFile(path_, SOCK_SEQPACKET)
                   : absl::StatusOr<UniqueFd>(claimed);
  if (!listener.ok()) {
    // Still holding the lock, so no other daemon has the path.
    unlink((path_ + ".lock").c_str());
    return listener.status();
  }
  lock_ = std::move(lock);
  listener_ = *std::move(listener);
  return absl::OkStatus();
}

void FdSocket::Stop() {
  if (thread_.joinable()) {
    const uint64_t one = 1;
    // An eventfd's counter only fails to take a write when it would
    // overflow, which a single write cannot make it.
    (void)!write(wake_fd_.get(), &one, sizeof(one));
    thread_.join();
  }
  while (!connections_.empty()) Drop(connections_.size() - 1);
  listener_.reset();
  wake_fd_.reset();
  if (lock_.valid()) {
    RemoveSocketFiles(path_);  // still holding the lock
    lock_.reset();
  }
}

void FdSocket::Run() {
  using Clock = std::chrono::steady_clock;
  Clock::time_point accept_again = Clock::now();
  std::vector<pollfd> fds;
  for (;;) {
    const Clock::time_point now = Clock::now();
    const bool paused = now < accept_again;
    fds.assign(2 + connections_.size(), pollfd{});
    fds[0] = {wake_fd_.get(), POLLIN, 0};
    fds[1] = {paused ? -1 : listener_.get(), POLLIN, 0};  // -1: not watched
    for (size_t i = 0; i < connections_.size(); ++i) {
      fds[2 + i] = {connections_[i].fd.get(), POLLIN, 0};
    }
    const int timeout_ms =
        paused ? static_cast<int>(std::chrono::ceil<std::chrono::milliseconds>(
                                      accept_again - now)
                                      .count())
               : -1;
    const int ready = poll(fds.data(), fds.size(), timeout_ms);
    if (ready < 0) {
      // EINTR, or ENOMEM: try again, not at once for the latter.
      if (errno != EINTR) poll(nullptr, 0, kAcceptPause.count());
      continue;
    }
    if (fds[0].revents != 0) return;
    // From the last, so that dropping one keeps the others' indices.
    for (size_t i = connections_.size(); i-- > 0;) {
      if (fds[2 + i].revents != 0 && !Serve(connections_[i])) Drop(i);
    }
    if (fds[1].revents != 0 && !AcceptWaiting()) {
      accept_again = Clock::now() + kAcceptPause;
    }
  }
}

bool FdSocket::AcceptWaiting() {
  // A bounded number per wake, so that a stream of connections refused at
  // the limit cannot keep the loop from the connections it serves (the
  // listener stays readable for the rest).
  for (size_t accepted = 0; accepted <= max_connections_; ++accepted) {
    UniqueFd fd(accept4(listener_.get(), nullptr, nullptr,
                        SOCK_NONBLOCK | SOCK_CLOEXEC));
    if (!fd.valid()) {
      const int err = errno;
      if (err == EINTR || err == ECONNABORTED) continue;
      return err == EAGAIN || err == EWOULDBLOCK;  // else EMFILE, ENOMEM...
    }
    if (connections_.size() >= max_connections_) {
      if (!at_limit_) {
        at_limit_ = true;
        log::Warn(absl::StrCat("descriptor socket ", path_, ": ",
                               max_connections_,
                               " connections open; closing new ones until "
                               "one ends"));
      }
      continue;  // closed as `fd` goes
    }
    connections_.push_back(Connection{std::move(fd), next_owner.fetch_add(1)});
  }
  return true;
}

bool FdSocket::Serve(const Connection& c) {
  Message m = Receive(c.fd.get());
  switch (m.kind) {
    case Message::kNothing:
      return true;
    case Message::kEnded:
      return false;
    case Message::kBad:
    case Message::kNoRoom:
    case Message::kBatch:
      break;
  }
  Reply reply = m.kind == Message::kNoRoom ? Reply::kFull : Reply::kRefused;
  if (m.kind == Message::kBatch) {
    const absl::Status stored = store_->Put(c.owner, m.ids, std::move(m.fds));
    reply = stored.ok() ? Reply::kStored
            : stored.code() == absl::StatusCode::kResourceExhausted
                ? Reply::kFull
                : Reply::kRefused;
  }
  m.fds.clear();  // a refused message's descriptors are closed before the reply
  const uint8_t byte = static_cast<uint8_t>(reply);
  // A client that does not read its replies fills its socket's buffer:
  // it is dropped rather than waited for.
  return send(c.fd.get(), &byte, 1, MSG_NOSIGNAL | MSG_DONTWAIT) == 1;
}

void FdSocket::Drop(size_t i) {
  store_->DropOwner(connections_[i].owner);
  connections_.erase(connections_.begin() + static_cast<ptrdiff_t>(i));
  at_limit_ = false;
}

}  // namespace optimd
