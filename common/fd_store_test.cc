#include "common/fd_store.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "common/unique_fd.h"
#include "gtest/gtest.h"
#include "testing/watched_pipe.h"

namespace optimd {
namespace {

// A 16-byte id made of `n`.
std::string Id(int n) {
  std::string id(FdStore::kIdBytes, 'i');
  id[0] = static_cast<char>(n);
  id[1] = static_cast<char>(n >> 8);
  return id;
}

// A duplicate is the very file that was put: what is written through one
// reads back through the other; the store keeps its own.
TEST(FdStoreTest, DupYieldsTheSameOpenFile) {
  UniqueFd memfd(memfd_create("optimd-fd-store-test", MFD_CLOEXEC));
  ASSERT_TRUE(memfd.valid());
  UniqueFd mine(dup(memfd.get()));
  ASSERT_TRUE(mine.valid());
  FdStore store(8, 8);
  std::vector<UniqueFd> fds;
  fds.push_back(std::move(memfd));
  ASSERT_TRUE(store.Put(1, {Id(1)}, std::move(fds)).ok());
  EXPECT_EQ(store.size(), 1u);
  absl::StatusOr<UniqueFd> taken = store.Dup(Id(1));
  ASSERT_TRUE(taken.ok()) << taken.status();
  EXPECT_EQ(store.size(), 1u);
  EXPECT_TRUE(store.Held(Id(1)).ok());
  struct stat a, b;
  ASSERT_EQ(fstat(taken->get(), &a), 0);
  ASSERT_EQ(fstat(mine.get(), &b), 0);
  EXPECT_EQ(a.st_dev, b.st_dev);
  EXPECT_EQ(a.st_ino, b.st_ino);
  ASSERT_EQ(pwrite(taken->get(), "optimd", 6, 0), 6);
  char back[6] = {};
  ASSERT_EQ(pread(mine.get(), back, sizeof(back), 0), 6);
  EXPECT_EQ(std::string(back, 6), "optimd");
}

// Duplicates leave the store's own open; an id never put is NotFound.
TEST(FdStoreTest, DupKeepsTheStoresDescriptor) {
  FdStore store(8, 8);
  std::vector<Pipe> pipes = MakePipes(1);
  ASSERT_TRUE(store.Put(1, {Id(1)}, WriteEnds(pipes)).ok());
  ASSERT_TRUE(store.Dup(Id(1)).ok());  // closed at once
  ASSERT_TRUE(store.Dup(Id(1)).ok());
  EXPECT_FALSE(WriteEndClosed(pipes[0]));
  EXPECT_EQ(store.Dup(Id(2)).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(store.Held(Id(2)).code(), absl::StatusCode::kNotFound);
}

// A batch with one id twice is refused whole, and each of its descriptors
// closed.
TEST(FdStoreTest, IdTwiceInABatchClosesEveryDescriptor) {
  FdStore store(8, 8);
  std::vector<Pipe> pipes = MakePipes(3);
  const absl::Status s = store.Put(1, {Id(1), Id(2), Id(1)}, WriteEnds(pipes));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(store.size(), 0u);
  for (const Pipe& p : pipes) EXPECT_TRUE(WriteEndClosed(p));
  EXPECT_EQ(store.Dup(Id(2)).status().code(), absl::StatusCode::kNotFound);
}

// An id already held refuses the whole new batch; the one held stays.
TEST(FdStoreTest, IdAlreadyHeldRefusesTheBatch) {
  FdStore store(8, 8);
  std::vector<Pipe> held = MakePipes(1);
  ASSERT_TRUE(store.Put(1, {Id(1)}, WriteEnds(held)).ok());
  std::vector<Pipe> pipes = MakePipes(2);
  const absl::Status s = store.Put(2, {Id(2), Id(1)}, WriteEnds(pipes));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  for (const Pipe& p : pipes) EXPECT_TRUE(WriteEndClosed(p));
  EXPECT_FALSE(WriteEndClosed(held[0]));
  EXPECT_EQ(store.size(), 1u);
  EXPECT_EQ(store.Dup(Id(2)).status().code(), absl::StatusCode::kNotFound);
}

TEST(FdStoreTest, MalformedBatchesCloseEveryDescriptor) {
  FdStore store(8, 8);
  std::vector<Pipe> short_id = MakePipes(1);
  EXPECT_EQ(store.Put(1, {"short"}, WriteEnds(short_id)).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(WriteEndClosed(short_id[0]));
  std::vector<Pipe> two = MakePipes(2);
  EXPECT_EQ(store.Put(1, {Id(1)}, WriteEnds(two)).code(),
            absl::StatusCode::kInvalidArgument);
  for (const Pipe& p : two) EXPECT_TRUE(WriteEndClosed(p));
  EXPECT_EQ(store.size(), 0u);
  // An empty batch keeps nothing and is no error.
  EXPECT_TRUE(store.Put(1, {}, {}).ok());
  EXPECT_EQ(store.size(), 0u);
}

TEST(FdStoreTest, PerOwnerBound) {
  FdStore store(16, 2);
  std::vector<Pipe> first = MakePipes(2);
  ASSERT_TRUE(store.Put(1, {Id(1), Id(2)}, WriteEnds(first)).ok());
  std::vector<Pipe> more = MakePipes(1);
  EXPECT_EQ(store.Put(1, {Id(3)}, WriteEnds(more)).code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(WriteEndClosed(more[0]));
  // Another owner has a bound of its own.
  std::vector<Pipe> other = MakePipes(2);
  EXPECT_TRUE(store.Put(2, {Id(4), Id(5)}, WriteEnds(other)).ok());
  // A duplicate makes no room: the store keeps the descriptor.
  ASSERT_TRUE(store.Dup(Id(1)).ok());
  std::vector<Pipe> again = MakePipes(1);
  EXPECT_EQ(store.Put(1, {Id(3)}, WriteEnds(again)).code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(store.size(), 4u);
}

TEST(FdStoreTest, TotalBound) {
  FdStore store(3, 2);
  std::vector<Pipe> first = MakePipes(2);
  ASSERT_TRUE(store.Put(1, {Id(1), Id(2)}, WriteEnds(first)).ok());
  std::vector<Pipe> two = MakePipes(2);
  EXPECT_EQ(store.Put(2, {Id(3), Id(4)}, WriteEnds(two)).code(),
            absl::StatusCode::kResourceExhausted);
  for (const Pipe& p : two) EXPECT_TRUE(WriteEndClosed(p));
  std::vector<Pipe> one = MakePipes(1);
  EXPECT_TRUE(store.Put(2, {Id(3)}, WriteEnds(one)).ok());
  EXPECT_EQ(store.size(), 3u);
}

TEST(FdStoreTest, DropOwnerClosesOnlyThatOwnersDescriptors) {
  FdStore store(16, 4);
  std::vector<Pipe> gone = MakePipes(2), kept = MakePipes(1);
  ASSERT_TRUE(store.Put(1, {Id(1), Id(2)}, WriteEnds(gone)).ok());
  ASSERT_TRUE(store.Put(2, {Id(3)}, WriteEnds(kept)).ok());
  store.DropOwner(1);
  for (const Pipe& p : gone) EXPECT_TRUE(WriteEndClosed(p));
  EXPECT_FALSE(WriteEndClosed(kept[0]));
  EXPECT_EQ(store.size(), 1u);
  EXPECT_EQ(store.Dup(Id(1)).status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(store.Dup(Id(3)).ok());
  // The owner's count went with it: a full batch fits again.
  std::vector<Pipe> again = MakePipes(4);
  EXPECT_TRUE(
      store.Put(1, {Id(1), Id(2), Id(4), Id(5)}, WriteEnds(again)).ok());
}

// Owners putting, duplicating and dropping from threads of their own (for
// ThreadSanitizer).
TEST(FdStoreTest, OwnersOnThreadsOfTheirOwn) {
  FdStore store(64, 8);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&store, t] {
      for (int i = 0; i < 200; ++i) {
        std::vector<Pipe> pipes = MakePipes(1);
        const std::string id = Id(t * 1000 + i);
        EXPECT_TRUE(store.Put(t, {id}, WriteEnds(pipes)).ok());
        if (i % 2 == 0) EXPECT_TRUE(store.Dup(id).ok());
        EXPECT_TRUE(store.Held(id).ok());
        store.DropOwner(t);
        EXPECT_TRUE(WriteEndClosed(pipes[0]));
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(store.size(), 0u);
}

}  // namespace
}  // namespace optimd
