#include "server/fd_socket.h"

#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/fd_store.h"
#include "common/unique_fd.h"
#include "gtest/gtest.h"
#include "testing/watched_pipe.h"

namespace optimd {
namespace {

// How long a test waits for the socket's thread to act.
constexpr absl::Duration kPatience = absl::Seconds(20);

std::string Id(int n) {
  std::string id(FdStore::kIdBytes, 'd');
  id[0] = static_cast<char>(n);
  id[1] = static_cast<char>(n >> 8);
  return id;
}

// The payload of a batch: `magic`, `count`, then `ids`.
std::string Payload(const std::vector<std::string>& ids, uint32_t count,
                    const std::string& magic = "OFD1") {
  std::string p = magic;
  for (int i = 0; i < 4; ++i) p.push_back(static_cast<char>(count >> (8 * i)));
  for (const std::string& id : ids) p += id;
  return p;
}

std::vector<std::string> Ids(int n, int first = 0) {
  std::vector<std::string> ids;
  for (int i = 0; i < n; ++i) ids.push_back(Id(first + i));
  return ids;
}

// Sends `payload` with `fds` as SCM_RIGHTS (none when empty); false when
// the socket would not take it.
bool Send(int sock, const std::string& payload, const std::vector<int>& fds) {
  iovec iov = {const_cast<char*>(payload.data()), payload.size()};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  std::vector<char> control(CMSG_SPACE(sizeof(int) * fds.size()));
  if (!fds.empty()) {
    msg.msg_control = control.data();
    msg.msg_controllen = control.size();
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
    std::memcpy(CMSG_DATA(c), fds.data(), sizeof(int) * fds.size());
  }
  return sendmsg(sock, &msg, MSG_NOSIGNAL) ==
         static_cast<ssize_t>(payload.size());
}

// The daemon's one-byte answer; -1 when the connection ended (or nothing
// came in time).
int Reply(int sock) {
  pollfd p = {sock, POLLIN, 0};
  if (poll(&p, 1, absl::ToInt64Milliseconds(kPatience)) != 1) return -1;
  unsigned char byte;
  return recv(sock, &byte, 1, 0) == 1 ? byte : -1;
}

int OpenDescriptors() {
  int n = 0;
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return -1;
  while (readdir(dir) != nullptr) ++n;
  closedir(dir);
  return n;
}

// The highest descriptor number open in this process.
int HighestDescriptor() {
  int highest = -1;
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return -1;
  while (const dirent* e = readdir(dir)) {
    if (e->d_name[0] != '.') highest = std::max(highest, atoi(e->d_name));
  }
  closedir(dir);
  return highest;
}

bool Exists(const std::string& path) { return access(path.c_str(), F_OK) == 0; }

// Waits until `done` holds (or kPatience passed); whether it held.
template <typename F>
bool Eventually(F done) {
  const absl::Time deadline = absl::Now() + kPatience;
  while (!done()) {
    if (absl::Now() > deadline) return false;
    absl::SleepFor(absl::Milliseconds(2));
  }
  return true;
}

class FdSocketTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/optimd-fd-socket-XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    path_ = dir_ + "/optimd.sock.fds";
  }
  void TearDown() override {
    unlink(path_.c_str());
    unlink((path_ + ".lock").c_str());
    rmdir(dir_.c_str());
  }

  // A connection to the socket at path_ (invalid when refused).
  UniqueFd Connect() const {
    UniqueFd fd(socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::strncpy(addr.sun_path, path_.c_str(), sizeof(addr.sun_path) - 1);
    if (connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) !=
        0) {
      return UniqueFd();
    }
    return fd;
  }

  // A connection the socket has taken up: an empty message on it was
  // answered (1, malformed), so the connection's own descriptors are in
  // any count made after. Invalid when the socket does not serve.
  UniqueFd Accepted() const {
    UniqueFd conn = Connect();
    if (!conn.valid() || !Send(conn.get(), "", {}) || Reply(conn.get()) != 1) {
      return UniqueFd();
    }
    return conn;
  }

  std::string dir_;
  std::string path_;
};

TEST_F(FdSocketTest, StoresABatchAndYieldsItsDescriptors) {
  FdStore store(16, 16);
  FdSocket fds(path_, &store);
  ASSERT_TRUE(fds.Start().ok());
  struct stat st;
  ASSERT_EQ(stat(path_.c_str(), &st), 0);
  EXPECT_TRUE(S_ISSOCK(st.st_mode));
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  std::vector<UniqueFd> files;
  for (int i = 0; i < 2; ++i) {
    files.emplace_back(memfd_create("optimd-fd-socket-test", MFD_CLOEXEC));
    ASSERT_TRUE(files.back().valid());
  }
  UniqueFd conn = Connect();
  ASSERT_TRUE(conn.valid());
  ASSERT_TRUE(
      Send(conn.get(), Payload(Ids(2), 2), {files[0].get(), files[1].get()}));
  ASSERT_EQ(Reply(conn.get()), 0);
  EXPECT_EQ(store.size(), 2u);
  for (int i = 0; i < 2; ++i) {
    absl::StatusOr<UniqueFd> taken = store.Dup(Id(i));
    ASSERT_TRUE(taken.ok()) << taken.status();
    struct stat a, b;
    ASSERT_EQ(fstat(taken->get(), &a), 0);
    ASSERT_EQ(fstat(files[i].get(), &b), 0);
    EXPECT_EQ(a.st_ino, b.st_ino);
    const std::string text = absl::StrCat("file ", i);
    ASSERT_EQ(pwrite(taken->get(), text.data(), text.size(), 0),
              static_cast<ssize_t>(text.size()));
    std::string back(text.size(), '\0');
    ASSERT_EQ(pread(files[i].get(), &back[0], back.size(), 0),
              static_cast<ssize_t>(back.size()));
    EXPECT_EQ(back, text);
  }
  EXPECT_EQ(store.size(), 2u);  // held while the connection lasts
}

// Every malformed message is answered 1, keeps nothing, and leaves no
// descriptor open in the daemon; the connection serves on.
TEST_F(FdSocketTest, RefusesMalformedMessagesWithoutKeepingAny) {
  FdStore store(256, 256);
  FdSocket fds(path_, &store);
  ASSERT_TRUE(fds.Start().ok());
  UniqueFd conn = Accepted();  // counted below
  ASSERT_TRUE(conn.valid());
  std::vector<UniqueFd> files;
  std::vector<int> raw;
  for (int i = 0; i < 70; ++i) {
    files.emplace_back(memfd_create("optimd-fd-socket-test", MFD_CLOEXEC));
    raw.push_back(files.back().get());
  }
  auto first = [&raw](size_t n) {
    return std::vector<int>(raw.begin(), raw.begin() + n);
  };
  const std::string truncated_id = Payload(Ids(2), 2).substr(0, 8 + 20);
  const struct {
    const char* what;
    std::string payload;
    std::vector<int> fds;
  } cases[] = {
      {"bad magic", Payload(Ids(1), 1, "OFD2"), first(1)},
      {"count zero", Payload({}, 0), first(1)},
      {"count past the ids", Payload(Ids(1), 2), first(2)},
      {"ids past the count", Payload(Ids(3), 2), first(2)},
      {"part of an id", truncated_id, first(2)},
      {"fewer descriptors", Payload(Ids(3), 3), first(2)},
      {"more descriptors", Payload(Ids(2), 2), first(3)},
      {"no descriptors", Payload(Ids(2), 2), {}},
      {"descriptors, no payload", "", first(4)},
      {"header only", "OFD1", first(1)},
      {"garbage", std::string(300, '\xa5'), first(5)},
      {"65 ids", Payload(Ids(65), 65), first(65)},
      {"65 descriptors for 64 ids", Payload(Ids(64), 64), first(65)},
      {"an id twice", Payload({Id(7), Id(7)}, 2), first(2)},
      {"longer than any batch", std::string(5000, 'x'), first(1)},
  };
  const int before = OpenDescriptors();
  for (const auto& c : cases) {
    ASSERT_TRUE(Send(conn.get(), c.payload, c.fds)) << c.what;
    EXPECT_EQ(Reply(conn.get()), 1) << c.what;
    EXPECT_EQ(store.size(), 0u) << c.what;
    EXPECT_EQ(OpenDescriptors(), before) << c.what;
  }
  ASSERT_TRUE(Send(conn.get(), Payload(Ids(1), 1), first(1)));
  EXPECT_EQ(Reply(conn.get()), 0);
  EXPECT_EQ(store.size(), 1u);
}

// Credentials where descriptors belong: refused, nothing kept.
TEST_F(FdSocketTest, RefusesCredentialsInsteadOfDescriptors) {
  FdStore store(16, 16);
  FdSocket fds(path_, &store);
  ASSERT_TRUE(fds.Start().ok());
  UniqueFd conn = Connect();
  ASSERT_TRUE(conn.valid());
  const std::string payload = Payload(Ids(1), 1);
  iovec iov = {const_cast<char*>(payload.data()), payload.size()};
  union {
    cmsghdr align;
    char bytes[CMSG_SPACE(sizeof(ucred))];
  } control{};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control.bytes;
  msg.msg_controllen = sizeof(control.bytes);
  cmsghdr* c = CMSG_FIRSTHDR(&msg);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_CREDENTIALS;
  c->cmsg_len = CMSG_LEN(sizeof(ucred));
  const ucred cred = {getpid(), getuid(), getgid()};
  std::memcpy(CMSG_DATA(c), &cred, sizeof(cred));
  ASSERT_EQ(sendmsg(conn.get(), &msg, MSG_NOSIGNAL),
            static_cast<ssize_t>(payload.size()));
  EXPECT_EQ(Reply(conn.get()), 1);
  EXPECT_EQ(store.size(), 0u);
}

// A socket or an anonymous inode (io_uring, epoll, eventfd) is refused:
// the connection's own other end, kept, would keep the connection from
// ever ending, and with it the descriptors it brought. A character device
// (CUDA exports memory as a /dev/nvidiactl descriptor) and other files are
// kept.
TEST_F(FdSocketTest, RefusesSocketsAndAnonymousInodes) {
  FdStore store(16, 16);
  FdSocket fds(path_, &store);
  ASSERT_TRUE(fds.Start().ok());
  UniqueFd conn = Accepted();  // counted below
  ASSERT_TRUE(conn.valid());
  int pair[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair), 0);
  UniqueFd pair_end(pair[0]), other_end(pair[1]);
  UniqueFd event(eventfd(0, EFD_CLOEXEC));
  ASSERT_TRUE(event.valid());
  const int before = OpenDescriptors();
  const struct {
    const char* what;
    int fd;
  } refused[] = {
      {"this connection's own end", conn.get()},
      {"a socket", pair_end.get()},
      {"an eventfd", event.get()},
  };
  for (const auto& r : refused) {
    ASSERT_TRUE(Send(conn.get(), Payload(Ids(1), 1), {r.fd})) << r.what;
    EXPECT_EQ(Reply(conn.get()), 1) << r.what;
    EXPECT_EQ(store.size(), 0u) << r.what;
    EXPECT_EQ(OpenDescriptors(), before) << r.what;
  }
  {
    // One refused descriptor refuses the whole batch.
    Pipe p = MakePipe();
    ASSERT_TRUE(
        Send(conn.get(), Payload(Ids(2), 2), {p.write.get(), pair_end.get()}));
    p.write.reset();
    EXPECT_EQ(Reply(conn.get()), 1);
    EXPECT_TRUE(WriteEndClosed(p));
  }
  UniqueFd null_device(open("/dev/null", O_RDWR | O_CLOEXEC));
  UniqueFd directory(open(dir_.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  ASSERT_TRUE(null_device.valid() && directory.valid());
  ASSERT_TRUE(Send(conn.get(), Payload(Ids(2), 2),
                   {null_device.get(), directory.get()}));
  EXPECT_EQ(Reply(conn.get()), 0);
  EXPECT_EQ(store.size(), 2u);
  // The connection ends with its peer, and its descriptors with it: of
  // those counted, both ends of the connection are gone.
  null_device.reset();
  directory.reset();
  conn.reset();
  EXPECT_TRUE(Eventually([&] { return store.size() == 0; }));
  EXPECT_TRUE(Eventually([&] { return OpenDescriptors() == before - 2; }))
      << OpenDescriptors() << " open, " << before << " before";
}

// A message the daemon has no descriptors left for (its open-files limit)
// is answered 2, as a full store is, and leaves none of them open; the
// connection serves on once descriptors come free.
TEST_F(FdSocketTest, OutOfDescriptorsIsAnsweredTwo) {
  FdStore store(256, 256);
  FdSocket fds(path_, &store);
  ASSERT_TRUE(fds.Start().ok());
  UniqueFd conn = Accepted();
  ASSERT_TRUE(conn.valid());
  UniqueFd memfd(memfd_create("optimd-fd-socket-test", MFD_CLOEXEC));
  ASSERT_TRUE(memfd.valid());
  const std::vector<int> batch(FdSocket::kMaxBatch, memfd.get());
  const int before = OpenDescriptors();
  rlimit saved{};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &saved), 0);
  // Room for a few descriptors, not for a batch (this process's
  // descriptors lie below the limit, so `before - 1` of them count).
  const int room = 8;
  rlimit low = saved;
  low.rlim_cur = std::max(HighestDescriptor() + 1, before - 1) + room;
  ASSERT_LT(low.rlim_cur - (before - 1), FdSocket::kMaxBatch);
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &low), 0);
  const bool sent =
      Send(conn.get(), Payload(Ids(FdSocket::kMaxBatch), FdSocket::kMaxBatch),
           batch);
  const int reply = Reply(conn.get());
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &saved), 0);
  ASSERT_TRUE(sent);
  EXPECT_EQ(reply, 2);
  EXPECT_EQ(store.size(), 0u);
  EXPECT_EQ(OpenDescriptors(), before);
  ASSERT_TRUE(Send(conn.get(),
                   Payload(Ids(FdSocket::kMaxBatch), FdSocket::kMaxBatch),
                   batch));
  EXPECT_EQ(Reply(conn.get()), 0);
  EXPECT_EQ(store.size(), FdSocket::kMaxBatch);
}

// Past the store's bounds: 2, nothing of the batch kept.
TEST_F(FdSocketTest, StoreFullIsAnsweredTwo) {
  FdStore store(3, 2);
  FdSocket fds(path_, &store);
  ASSERT_TRUE(fds.Start().ok());
  UniqueFd conn = Connect();
  ASSERT_TRUE(conn.valid());
  Pipe p[3] = {MakePipe(), MakePipe(), MakePipe()};
  ASSERT_TRUE(Send(conn.get(), Payload(Ids(3), 3),
                   {p[0].write.get(), p[1].write.get(), p[2].write.get()}));
  for (Pipe& each : p) each.write.reset();
  EXPECT_EQ(Reply(conn.get()), 2);
  EXPECT_EQ(store.size(), 0u);
  for (const Pipe& each : p) EXPECT_TRUE(WriteEndClosed(each));
}

// A connection's descriptors are closed when it ends; a duplicate made
// before is its holder's.
TEST_F(FdSocketTest, ClosingTheConnectionDropsItsDescriptors) {
  FdStore store(16, 16);
  FdSocket fds(path_, &store);
  ASSERT_TRUE(fds.Start().ok());
  UniqueFd conn = Connect();
  ASSERT_TRUE(conn.valid());
  Pipe taken = MakePipe(), left = MakePipe();
  ASSERT_TRUE(Send(conn.get(), Payload(Ids(2), 2),
                   {taken.write.get(), left.write.get()}));
  taken.write.reset();
  left.write.reset();
  ASSERT_EQ(Reply(conn.get()), 0);
  absl::StatusOr<UniqueFd> mine = store.Dup(Id(0));
  ASSERT_TRUE(mine.ok());
  EXPECT_FALSE(WriteEndClosed(left));
  conn.reset();
  EXPECT_TRUE(Eventually([&] { return store.size() == 0; }));
  EXPECT_TRUE(Eventually([&] { return WriteEndClosed(left); }));
  // A duplicate made before is its holder's.
  EXPECT_FALSE(WriteEndClosed(taken));
}

// A client gone right after sending (without reading the answer) leaves
// nothing behind; the socket serves on.
TEST_F(FdSocketTest, ClientGoneMidwayLeavesNothing) {
  FdStore store(64, 16);
  FdSocket fds(path_, &store);
  ASSERT_TRUE(fds.Start().ok());
  Pipe p = MakePipe();
  const int before = OpenDescriptors();
  for (int i = 0; i < 20; ++i) {
    UniqueFd conn = Connect();
    ASSERT_TRUE(conn.valid());
    ASSERT_TRUE(Send(conn.get(), Payload(Ids(1, i), 1), {p.write.get()}));
  }
  p.write.reset();
  EXPECT_TRUE(Eventually([&] { return WriteEndClosed(p); }));
  EXPECT_EQ(store.size(), 0u);
  EXPECT_TRUE(Accepted().valid());
  // The daemon's ends of the connections are closed too.
  EXPECT_TRUE(Eventually([&] { return OpenDescriptors() == before - 1; }));
}

// Past its limit of connections, a connection is closed at once; a slot
// freed serves a new one.
TEST_F(FdSocketTest, ClosesConnectionsPastTheLimit) {
  constexpr size_t kLimit = 8;
  FdStore store(16, 16);
  FdSocket fds(path_, &store, kLimit);
  ASSERT_TRUE(fds.Start().ok());
  std::vector<UniqueFd> open;
  for (size_t i = 0; i < kLimit; ++i) {
    open.push_back(Connect());
    ASSERT_TRUE(Send(open.back().get(), "", {}));
    ASSERT_EQ(Reply(open.back().get()), 1) << "connection " << i;
  }
  UniqueFd extra = Connect();
  ASSERT_TRUE(extra.valid());  // queued, then closed by the daemon
  Send(extra.get(), "", {});
  EXPECT_EQ(Reply(extra.get()), -1);
  open.pop_back();
  EXPECT_TRUE(Eventually([&] {
    UniqueFd again = Connect();
    return Send(again.get(), "", {}) && Reply(again.get()) == 1;
  }));
}

// A client that never reads its answers is dropped once they fill its
// socket, instead of holding the daemon's thread.
TEST_F(FdSocketTest, DropsAClientThatDoesNotRead) {
  FdStore store(16, 16);
  FdSocket fds(path_, &store);
  ASSERT_TRUE(fds.Start().ok());
  UniqueFd deaf = Connect();
  ASSERT_TRUE(deaf.valid());
  ASSERT_EQ(fcntl(deaf.get(), F_SETFL, O_NONBLOCK), 0);
  bool dropped = false;
  const absl::Time deadline = absl::Now() + kPatience;
  while (!dropped && absl::Now() < deadline) {
    if (send(deaf.get(), "", 0, MSG_NOSIGNAL) < 0) {
      dropped = errno == EPIPE || errno == ECONNRESET;
      if (errno == EAGAIN) absl::SleepFor(absl::Milliseconds(1));
    }
  }
  EXPECT_TRUE(dropped);
  EXPECT_TRUE(Accepted().valid());
}

// Stop closes the connections (and their descriptors) and removes the
// socket file and its lock file.
TEST_F(FdSocketTest, StopRemovesTheSocketFile) {
  FdStore store(16, 16);
  FdSocket fds(path_, &store);
  ASSERT_TRUE(fds.Start().ok());
  EXPECT_TRUE(Exists(path_));
  EXPECT_TRUE(Exists(path_ + ".lock"));
  UniqueFd conn = Connect();
  Pipe p = MakePipe();
  ASSERT_TRUE(Send(conn.get(), Payload(Ids(1), 1), {p.write.get()}));
  p.write.reset();
  ASSERT_EQ(Reply(conn.get()), 0);
  fds.Stop();
  EXPECT_FALSE(Exists(path_));
  EXPECT_FALSE(Exists(path_ + ".lock"));
  EXPECT_EQ(store.size(), 0u);
  EXPECT_TRUE(WriteEndClosed(p));
  EXPECT_EQ(Reply(conn.get()), -1);  // the connection ended
  EXPECT_FALSE(Connect().valid());
  fds.Stop();  // idempotent
}

// A second socket on a live path fails and leaves the first serving.
TEST_F(FdSocketTest, SecondSocketOnALivePathFails) {
  FdStore store(16, 16);
  FdSocket first(path_, &store);
  ASSERT_TRUE(first.Start().ok());
  {
    FdSocket second(path_, &store);
    const absl::Status s = second.Start();
    EXPECT_EQ(s.code(), absl::StatusCode::kAlreadyExists);
    EXPECT_NE(s.message().find(path_), absl::string_view::npos) << s;
    EXPECT_NE(s.message().find("another daemon"), absl::string_view::npos) << s;
  }
  EXPECT_TRUE(Exists(path_));
  EXPECT_TRUE(Exists(path_ + ".lock"));
  EXPECT_TRUE(Accepted().valid());
}

// A socket file nobody listens on (a dead daemon's) is replaced; one with
// a live listener that holds no lock is not; a file that is no socket is
// left alone.
TEST_F(FdSocketTest, ReplacesOnlyAStaleSocketFile) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path_.c_str(), sizeof(addr.sun_path) - 1);
  FdStore store(16, 16);
  {
    UniqueFd live(socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
    ASSERT_EQ(
        bind(live.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    ASSERT_EQ(listen(live.get(), 4), 0);
    FdSocket fds(path_, &store);
    EXPECT_EQ(fds.Start().code(), absl::StatusCode::kAlreadyExists);
    EXPECT_TRUE(Exists(path_));
    EXPECT_FALSE(Exists(path_ + ".lock"));
  }  // the listener is gone; its file stays, stale
  ASSERT_TRUE(Exists(path_));
  {
    FdSocket fds(path_, &store);
    ASSERT_TRUE(fds.Start().ok());
    EXPECT_TRUE(Accepted().valid());
  }
  ASSERT_EQ(close(open(path_.c_str(), O_CREAT | O_WRONLY | O_CLOEXEC, 0600)),
            0);
  FdSocket fds(path_, &store);
  EXPECT_EQ(fds.Start().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(Exists(path_));
}

}  // namespace
}  // namespace optimd
