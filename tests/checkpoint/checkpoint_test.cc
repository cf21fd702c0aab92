#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "backends/cpu/cpu_backend.h"
#include "checkpoint/paths.h"
#include "checkpoint/session_checkpoint.h"
#include "checkpoint/temporaries.h"
#include "client/shm_tensor.h"
#include "common/crc32c.h"
#include "core/session.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "testing/file_read_gate.h"

namespace optimd {
namespace {

std::string TempDir() {
  char dir[] = "/tmp/optimd-ckpt-test-XXXXXX";
  EXPECT_NE(mkdtemp(dir), nullptr);
  return dir;
}

// A temporary directory removed with everything in it at the end of a test.
class ScratchDir {
 public:
  ScratchDir() : path_(TempDir()) {}
  ~ScratchDir() { std::filesystem::remove_all(path_); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)),
                     std::istreambuf_iterator<char>());
}

void WriteFile(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

// A session with one group "g" of one fp32 tensor "w" of 100 elements over
// shared memory, stepped once.
class OneTensorSession {
 public:
  // `aliases`: the tensor's other names (a tied weight's).
  // `place`: a shard's (whole shape, offset), TensorSpec::global_shape and
  // global_offset; none for a whole tensor.
  // `moments`: the group's moment dtype.
  explicit OneTensorSession(
      std::vector<std::string> aliases = {},
      std::pair<std::vector<uint64_t>, std::vector<uint64_t>> place = {},
      DType moments = DType::kFloat32)
      : backend_(CpuBackend::Options{1, 1024}), budget_(0) {
    session_ = std::make_unique<Session>(SessionIdentity{"hdr", 0, 1, -1},
                                         &backend_, &budget_,
                                         *backend_.OpenSession(-1, "", &done_));
    params_ = *SharedMemoryRegion::Create(4096);
    grads_ = *SharedMemoryRegion::Create(4096);
    for (int i = 0; i < 100; ++i) {
      params_->as<float>()[i] = 0.01f * i;
      grads_->as<float>()[i] = 1.0f - 0.02f * i;
    }
    GroupSpec spec;
    spec.id = "g";
    spec.hyper.lr = 1e-3;
    spec.moment_dtype = moments;
    TensorSpec t;
    t.name = "w";
    t.numel = 100;
    t.param_dtype_set = t.grad_dtype_set = true;
    t.param.kind = t.grad.kind = BufferHandle::Kind::kSharedMemory;
    t.param.segment_name = params_->name();
    t.grad.segment_name = grads_->name();
    t.param.size = t.grad.size = 400;
    t.aliases = std::move(aliases);
    t.global_shape = std::move(place.first);
    t.global_offset = std::move(place.second);
    spec.tensors = {t};
    EXPECT_TRUE(session_->RegisterGroup(spec).ok());
    EXPECT_TRUE(session_->Step({}).ok());
  }
  Session& session() { return *session_; }
  // Parameters, moments, step counter and hyperparameters, as bytes.
  std::string Fingerprint() {
    auto st = session_->ReadState({});
    EXPECT_TRUE(st.ok()) << st.status();
    std::string out(reinterpret_cast<const char*>(params_->as<float>()), 400);
    for (const GroupState& g : *st) {
      out += std::to_string(g.step) + "/" + std::to_string(g.hyper.lr);
      for (const StateBlob& b : g.tensors) out += b.kind + b.data;
    }
    return out;
  }

 private:
  CpuBackend backend_;
  StateBudget budget_;
  std::string done_;
  std::unique_ptr<Session> session_;
  std::unique_ptr<SharedMemoryRegion> params_, grads_;
};

// A session of `count` tensors of 2 elements each over shared memory, named
// `prefix` + index. With `mixed`, the layouts vary: fp32, bf16 with an fp32
// master, frozen, zero-element, float64 (one element, float64 moments by
// default), and a second group with amsgrad and bf16 moments.
class ManyTensorSession {
 public:
  ManyTensorSession(int count, const std::string& prefix, bool mixed)
      : backend_(CpuBackend::Options{2, 1 << 16}), budget_(0) {
    session_ = std::make_unique<Session>(SessionIdentity{"many", 0, 1, -1},
                                         &backend_, &budget_,
                                         *backend_.OpenSession(-1, "", &done_));
    params_ = *SharedMemoryRegion::Create(uint64_t(count) * 8 + 64);
    grads_ = *SharedMemoryRegion::Create(uint64_t(count) * 8 + 64);
    for (int i = 0; i < 2 * count; ++i) {
      grads_->as<float>()[i] = 0.001f * (i % 997) - 0.3f;
    }
    GroupSpec a, b;
    a.id = "a";
    b.id = "b";
    b.hyper.amsgrad = true;
    b.moment_dtype = DType::kBFloat16;
    a.moment_dtype_default = true;
    for (int i = 0; i < count; ++i) {
      TensorSpec t;
      t.name = prefix + std::to_string(i);
      t.numel = 2;
      t.param_dtype_set = t.grad_dtype_set = true;
      const int kind = mixed ? i % 6 : 0;
      if (kind == 1) t.param_dtype = t.grad_dtype = DType::kBFloat16;
      if (kind == 5) {
        t.param_dtype = t.grad_dtype = DType::kFloat64;
        t.numel = 1;
      }
      t.frozen = kind == 2;
      if (kind == 3) t.numel = 0;
      if (i % 3 == 0 && t.numel == 2) t.shape = {1, 2};
      if (i % 3 == 0 && t.numel == 1) t.shape = {1, 1};
      const uint64_t bytes = t.numel * DTypeSize(t.param_dtype);
      if (bytes > 0) {
        t.param.kind = t.grad.kind = BufferHandle::Kind::kSharedMemory;
        t.param.segment_name = params_->name();
        t.grad.segment_name = grads_->name();
        t.param.offset = t.grad.offset = uint64_t(i) * 8;
        t.param.size = t.grad.size = bytes;
        if (t.frozen) t.grad = BufferHandle();
      }
      (kind == 4 ? b : a).tensors.push_back(t);
    }
    for (int i = 0; i < 2 * count; ++i) params_->as<float>()[i] = 0.5f;
    EXPECT_TRUE(session_->RegisterGroup(a).ok());
    if (!b.tensors.empty()) {
      EXPECT_TRUE(session_->RegisterGroup(b).ok());
    }
    bytes_ = uint64_t(count) * 8;
  }
  Session& session() { return *session_; }
  std::string Params() const {
    return std::string(reinterpret_cast<const char*>(params_->data()), bytes_);
  }

 private:
  CpuBackend backend_;
  StateBudget budget_;
  std::string done_;
  std::unique_ptr<Session> session_;
  std::unique_ptr<SharedMemoryRegion> params_, grads_;
  uint64_t bytes_ = 0;
};

// Saves at step 1, steps, loads, steps again: the parameters must be those
// of the save after the load and bit-identical to the uninterrupted run's
// after the next step. Returns the checkpoint's header length and format.
void CheckResumeThroughCheckpoint(ManyTensorSession& s, uint64_t* header,
                                  int* version) {
  ScratchDir dir;
  ASSERT_TRUE(s.session().Step({}).ok());
  auto saved = SaveSession(s.session(), dir.path(), CheckpointOptions());
  ASSERT_TRUE(saved.ok()) << saved.status();
  std::printf("save %.2f s\n", saved->seconds);
  const std::string at_save = s.Params();
  ASSERT_TRUE(s.session().Step({}).ok());
  const std::string after = s.Params();
  ASSERT_NE(after, at_save);
  auto loaded = LoadSession(s.session(), dir.path(), CheckpointOptions());
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  std::printf("load %.2f s\n", loaded->seconds);
  EXPECT_TRUE(s.Params() == at_save);
  ASSERT_TRUE(s.session().Step({}).ok());
  EXPECT_TRUE(s.Params() == after);
  const std::string file = ReadFile(saved->path);
  uint64_t hl = 0;
  for (int i = 0; i < 8; ++i) hl |= uint64_t{uint8_t(file[i])} << (8 * i);
  *header = hl;
  auto h = nlohmann::json::parse(file.substr(8, hl));
  *version = nlohmann::json::parse(
      h["__metadata__"]["optimd"].get<std::string>())["format_version"];
}

// A checkpoint file's header, split for editing.
struct HeaderParts {
  nlohmann::json header;  // the safetensors header
  nlohmann::json meta;    // __metadata__.optimd, parsed
  std::string data;       // the data section
};

// Options that save in the packed format (format 2) or, whatever the
// header's size, per tensor (format 1).
CheckpointOptions InFormat(bool packed) {
  CheckpointOptions options;
  options.packed_above_header_bytes = packed ? 0 : ~uint64_t{0};
  return options;
}

HeaderParts SplitCheckpoint(const std::string& file) {
  uint64_t hl = 0;
  for (int i = 0; i < 8; ++i) hl |= uint64_t{uint8_t(file[i])} << (8 * i);
  HeaderParts p;
  p.header = nlohmann::json::parse(file.substr(8, hl));
  p.meta = nlohmann::json::parse(
      p.header["__metadata__"]["optimd"].get<std::string>());
  p.data = file.substr(8 + hl);
  return p;
}

// Reassembles a file; the metadata checksum is recomputed unless
// `keep_crc`, so that a test reaches the field checks behind it.
std::string JoinCheckpoint(HeaderParts p, bool keep_crc = false) {
  const std::string meta = p.meta.dump();
  p.header["__metadata__"]["optimd"] = meta;
  if (!keep_crc) {
    char crc[9];
    std::snprintf(crc, sizeof(crc), "%08x",
                  Crc32cExtend(0, meta.data(), meta.size()));
    p.header["__metadata__"]["optimd_crc32c"] = crc;
  }
  std::string h = p.header.dump();
  while ((8 + h.size()) % 8 != 0) h.push_back(' ');
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = char(uint64_t(h.size()) >> (8 * i));
  return out + h + p.data;
}

TEST(CheckpointTest, FileNamesAreSafe) {
  EXPECT_EQ(CheckpointFileName(3), "rank-3.safetensors");
  EXPECT_EQ(LegacyCheckpointFileName("job-1", 3), "job-1.rank-3.safetensors");
  EXPECT_EQ(LegacyCheckpointFileName("../../etc/x y", 0),
            "job.._.._etc_x_y.rank-0.safetensors");
  EXPECT_EQ(LegacyCheckpointFileName("", 1), "job.rank-1.safetensors");
}

TEST(CheckpointTest, DirectoriesAreCheckedAndConfined) {
  ScratchDir scratch;
  const std::string root = scratch.path();
  ASSERT_EQ(mkdir((root + "/inside").c_str(), 0700), 0);
  CheckpointOptions open;
  // The file system would stop at the NUL and write into root.
  EXPECT_EQ(ResolveCheckpointDir(root + std::string("\0/etc", 5), open)
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ResolveCheckpointDir("relative", open).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ResolveCheckpointDir(root + "/missing", open).status().code(),
            absl::StatusCode::kNotFound);
  std::ofstream(root + "/file") << "x";
  EXPECT_EQ(ResolveCheckpointDir(root + "/file", open).status().code(),
            absl::StatusCode::kFailedPrecondition);
  CheckpointOptions confined;
  confined.state_dir = root + "/inside";
  EXPECT_TRUE(ResolveCheckpointDir(root + "/inside", confined).ok());
  EXPECT_EQ(ResolveCheckpointDir(root, confined).status().code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(ResolveCheckpointDir(root + "/inside/..", confined).status().code(),
            absl::StatusCode::kPermissionDenied);
  // A symbolic link out of the state directory is resolved, then refused.
  ASSERT_EQ(symlink(root.c_str(), (root + "/inside/escape").c_str()), 0);
  EXPECT_EQ(
      ResolveCheckpointDir(root + "/inside/escape", confined).status().code(),
      absl::StatusCode::kPermissionDenied);
}

TEST(CheckpointTest, SnapshotBytesEqualTheSavedFile) {
  OneTensorSession one;
  Session& s = one.session();
  ScratchDir scratch;
  const std::string dir = scratch.path();
  auto saved = SaveSession(s, dir, CheckpointOptions());
  ASSERT_TRUE(saved.ok()) << saved.status();
  const std::string file = ReadFile(saved->path);
  auto snapshot = SnapshotSession(s);
  ASSERT_TRUE(snapshot.ok());
  ASSERT_EQ((*snapshot)->FileSize(), file.size());
  std::string streamed(file.size(), '\0');
  (*snapshot)->ReadFile(0, 10, reinterpret_cast<uint8_t*>(streamed.data()));
  (*snapshot)->ReadFile(10, file.size() - 10,
                        reinterpret_cast<uint8_t*>(streamed.data() + 10));
  EXPECT_EQ(streamed, file);
}

// Saves that were killed leave "<file>.tmp-<pid>-<n>"; the next save to the
// same file removes those of dead processes (and only those).
TEST(CheckpointTest, StaleTemporariesAreRemovedAtTheNextSave) {
  OneTensorSession s;
  ScratchDir dir;
  const std::string final_name = CheckpointFileName(0);
  const std::string base = dir.path() + "/" + final_name;
  // pid 999999999 is past any pid_max: that process is gone.
  const std::string stale = base + ".tmp-999999999-7";
  const std::vector<std::string> kept = {
      base + ".tmp-1-7",                                   // init is alive
      base + ".tmp-999999999-x",                           // not our pattern
      base + ".tmp-999999999-8.bak",                       // not our pattern
      dir.path() + "/rank-1.safetensors.tmp-999999999-7",  // other file
      dir.path() + "/notes.txt"};
  // Written while the save runs (newer than its start): left alone.
  const std::string fresh = base + ".tmp-999999998-7";
  const time_t now = time(nullptr);
  auto write_at = [](const std::string& f, time_t t) {
    WriteFile(f, "partial");
    const timespec times[2] = {{t, 0}, {t, 0}};
    ASSERT_EQ(utimensat(AT_FDCWD, f.c_str(), times, 0), 0) << f;
  };
  write_at(stale, now - 3600);
  for (const auto& f : kept) write_at(f, now - 3600);
  write_at(fresh, now + 3600);
  EXPECT_EQ(RemoveStaleTemporaries(dir.path(), final_name, now - 7200), 0);
  auto saved = SaveSession(s.session(), dir.path(), CheckpointOptions());
  ASSERT_TRUE(saved.ok()) << saved.status();
  EXPECT_NE(access(stale.c_str(), F_OK), 0);
  for (const auto& f : kept) EXPECT_EQ(access(f.c_str(), F_OK), 0) << f;
  EXPECT_EQ(access(fresh.c_str(), F_OK), 0);
  EXPECT_EQ(access(saved->path.c_str(), F_OK), 0);
}

// At the daemon's start, checkpoint temporaries whose writer is gone are
// removed throughout the tree of a directory it owns, down to
// kTemporarySearchDepth levels and never through a symbolic link; nothing
// else is.
TEST(CheckpointTest, StaleTemporariesUnderATreeAreRemovedAtStart) {
  ScratchDir root;
  ScratchDir outside;
  std::string deepest = root.path();
  for (int level = 1; level <= kTemporarySearchDepth + 1; ++level) {
    deepest += absl::StrCat("/d", level);
    ASSERT_EQ(mkdir(deepest.c_str(), 0700), 0) << deepest;
  }
  const std::string reached = deepest.substr(0, deepest.rfind('/'));
  ASSERT_EQ(symlink(outside.path().c_str(), (root.path() + "/link").c_str()),
            0);
  // pid 999999999 is past any pid_max: that writer is gone.
  const std::vector<std::string> stale = {
      root.path() + "/rank-0.safetensors.tmp-999999999-1",
      reached + "/rank-0.safetensors.tmp-999999999-2",
      root.path() + "/job.rank-2.safetensors.tmp-999999999-3",  // legacy name
      // This process's pid: an earlier process's, since nothing is being
      // saved at start.
      root.path() + absl::StrCat("/rank-5.safetensors.tmp-", getpid(), "-4")};
  const std::vector<std::string> kept = {
      deepest + "/rank-0.safetensors.tmp-999999999-5",         // too deep
      outside.path() + "/rank-0.safetensors.tmp-999999999-6",  // via link
      root.path() + "/rank-1.safetensors.tmp-1-7",             // init is alive
      root.path() + "/rank-0.safetensors",                     // a checkpoint
      root.path() + "/notes.txt.tmp-999999999-8",           // not a checkpoint
      root.path() + "/rank-0.safetensors.tmp-999999999-x",  // not the pattern
      root.path() + "/rank-0.safetensors.tmp--9"};          // not the pattern
  for (const auto& f : stale) WriteFile(f, "partial");
  for (const auto& f : kept) WriteFile(f, "keep");
  // A directory named like a temporary is not removed either.
  const std::string dir_named =
      root.path() + "/rank-9.safetensors.tmp-999999999-10";
  ASSERT_EQ(mkdir(dir_named.c_str(), 0700), 0);
  EXPECT_EQ(RemoveStaleTemporariesUnder(root.path(), kTemporarySearchDepth),
            static_cast<int>(stale.size()));
  for (const auto& f : stale) EXPECT_NE(access(f.c_str(), F_OK), 0) << f;
  for (const auto& f : kept) EXPECT_EQ(access(f.c_str(), F_OK), 0) << f;
  EXPECT_EQ(access(dir_named.c_str(), F_OK), 0);
}

// A header past the safetensors limit used to be written (replacing the
// previous checkpoint) and then refused by LoadState. The save is refused
// before anything is written; so are streams and background saves.
TEST(CheckpointTest, HeaderPastTheLimitIsRefusedBeforeWriting) {
  OneTensorSession s;
  ScratchDir dir;
  auto first = SaveSession(s.session(), dir.path(), CheckpointOptions());
  ASSERT_TRUE(first.ok()) << first.status();
  const std::string good = ReadFile(first->path);
  // 110,000 zero-element tensors (no buffers) with 1000-byte names: even
  // packed, about 1 KB of header each, 112 MB in all.
  GroupSpec big;
  big.id = "big";
  for (int i = 0; i < 110000; ++i) {
    TensorSpec t;
    t.name = std::to_string(i) + std::string(1000, 'n');
    t.param_dtype_set = t.grad_dtype_set = true;
    big.tensors.push_back(t);
  }
  ASSERT_TRUE(s.session().RegisterGroup(big).ok());
  auto saved = SaveSession(s.session(), dir.path(), CheckpointOptions());
  EXPECT_EQ(saved.status().code(), absl::StatusCode::kResourceExhausted)
      << saved.status();
  EXPECT_TRUE(ReadFile(first->path) == good);
  saved = SaveSession(s.session(), dir.path(), CheckpointOptions(),
                      /*background=*/true);
  EXPECT_EQ(saved.status().code(), absl::StatusCode::kResourceExhausted)
      << saved.status();
  EXPECT_EQ(SnapshotSession(s.session()).status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(ReadFile(first->path) == good);
  // Nothing else was left in the directory.
  int files = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir.path())) {
    (void)e;
    ++files;
  }
  EXPECT_EQ(files, 1);
}

// Sessions whose per-tensor header would pass the limit are saved packed
// (format 2: one safetensors tensor per kind and dtype of a group), every
// layout round-tripping bit-exact; 1,000,000 tensors fit in the 100 MiB
// header limit (per-tensor headers stopped at about 112,000).
TEST(CheckpointTest, PackedFormatHoldsEveryLayoutBitExact) {
  ManyTensorSession s(8000, std::string(1000, 'n'), /*mixed=*/true);
  uint64_t header = 0;
  int version = 0;
  CheckResumeThroughCheckpoint(s, &header, &version);
  EXPECT_EQ(version, 2);
  // Small sessions keep the per-tensor format (`<name>.exp_avg` keys).
  ManyTensorSession small(50, "layer.", /*mixed=*/true);
  CheckResumeThroughCheckpoint(small, &header, &version);
  EXPECT_EQ(version, 1);
}

// Packed files keep the shapes of tensors of more than one dimension (a
// fifth element of their entry), checked to hold numel on load.
TEST(CheckpointTest, PackedFormatKeepsShapes) {
  ManyTensorSession s(12, "t", /*mixed=*/false);
  ScratchDir dir;
  CheckpointOptions packed;
  packed.packed_above_header_bytes = 0;
  auto saved = SaveSession(s.session(), dir.path(), packed);
  ASSERT_TRUE(saved.ok()) << saved.status();
  HeaderParts parts = SplitCheckpoint(ReadFile(saved->path));
  ASSERT_EQ(parts.meta["format_version"], 2);
  const nlohmann::json& tensors = parts.meta["groups"][0]["tensors"];
  EXPECT_EQ(tensors[0].size(), 5u);
  EXPECT_EQ(tensors[0][4], nlohmann::json::array({1, 2}));
  EXPECT_EQ(tensors[1].size(), 4u);  // 1-D: no shape
  ASSERT_TRUE(LoadSession(s.session(), dir.path(), CheckpointOptions()).ok());
  parts.meta["groups"][0]["tensors"][0][4] = nlohmann::json::array({3, 3});
  WriteFile(saved->path, JoinCheckpoint(parts));
  const absl::Status bad =
      LoadSession(s.session(), dir.path(), CheckpointOptions()).status();
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.message().find("shape holding numel"), std::string::npos)
      << bad;
}

// The packed format's checksums cover each packed tensor whole: a damaged
// byte is found (DATA_LOSS) before any state changes.
TEST(CheckpointTest, PackedFormatDetectsCorruptData) {
  ManyTensorSession s(8000, std::string(1000, 'c'), /*mixed=*/true);
  ScratchDir dir;
  ASSERT_TRUE(s.session().Step({}).ok());
  auto saved = SaveSession(s.session(), dir.path(), CheckpointOptions());
  ASSERT_TRUE(saved.ok()) << saved.status();
  std::string file = ReadFile(saved->path);
  file[file.size() - 3] ^= 0x40;
  WriteFile(saved->path, file);
  // The file is verified before anything changes: the session goes on.
  const std::string before = s.Params();
  auto loaded = LoadSession(s.session(), dir.path(), CheckpointOptions());
  EXPECT_EQ(loaded.status().code(), absl::StatusCode::kDataLoss)
      << loaded.status();
  EXPECT_NE(loaded.status().message().find("nothing was loaded"),
            std::string::npos);
  EXPECT_TRUE(s.Params() == before);
  EXPECT_TRUE(s.session().Step({}).ok());
}

TEST(CheckpointTest, AMillionTensorsFitTheHeaderLimit) {
  const auto t0 = std::chrono::steady_clock::now();
  ManyTensorSession s(1000000, "model.layers.mlp.weight.", /*mixed=*/false);
  std::printf(
      "registration %.2f s\n",
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
          .count());
  uint64_t header = 0;
  int version = 0;
  CheckResumeThroughCheckpoint(s, &header, &version);
  EXPECT_EQ(version, 2);
  std::printf("1,000,000 tensors: header %llu bytes\n",
              static_cast<unsigned long long>(header));
  EXPECT_LE(header, kMaxCheckpointHeaderBytes);
}

// Under --state_dir a symbolic link at the checkpoint's name is refused
// (it could lead out of the directory), and an error never quotes the
// file's bytes.
TEST(CheckpointTest, SymlinkedCheckpointUnderStateDirIsRefused) {
  OneTensorSession s;
  ScratchDir root;
  const std::string inside = root.path() + "/inside";
  ASSERT_EQ(mkdir(inside.c_str(), 0700), 0);
  const std::string secret = root.path() + "/secret";
  WriteFile(secret, "SECRETS!and more");
  const std::string name = inside + "/" + CheckpointFileName(0);
  ASSERT_EQ(symlink(secret.c_str(), name.c_str()), 0);
  CheckpointOptions confined;
  confined.state_dir = inside;
  auto loaded = LoadSession(s.session(), inside, confined);
  EXPECT_EQ(loaded.status().code(), absl::StatusCode::kPermissionDenied)
      << loaded.status();
  // Without confinement the file is read, and refused without echoing it.
  loaded = LoadSession(s.session(), inside, CheckpointOptions());
  EXPECT_EQ(loaded.status().code(), absl::StatusCode::kInvalidArgument)
      << loaded.status();
  const uint64_t first8 = 0x2153544552434553;  // "SECRETS!" little-endian
  EXPECT_EQ(std::string(loaded.status().message()).find(std::to_string(first8)),
            std::string::npos)
      << loaded.status();
}

// A named edit of a checkpoint's header.
using HeaderEdit = std::pair<std::string, std::function<void(HeaderParts&)>>;

// The first group of a split checkpoint's metadata, and its
// hyperparameters.
nlohmann::json& FirstGroup(HeaderParts& p) { return p.meta["groups"][0]; }
nlohmann::json& FirstGroupHyper(HeaderParts& p) {
  return FirstGroup(p)["hyperparameters"];
}

// Edits of one header field each that the loader must refuse: wrong type,
// out of range, missing, or nested past the limit.
std::vector<HeaderEdit> MalformedHeaderEdits() {
  using nlohmann::json;
  return {
      {"step as a string", [](HeaderParts& p) { FirstGroup(p)["step"] = "1"; }},
      {"negative step", [](HeaderParts& p) { FirstGroup(p)["step"] = -1; }},
      {"fractional step", [](HeaderParts& p) { FirstGroup(p)["step"] = 1.5; }},
      {"huge step", [](HeaderParts& p) { FirstGroup(p)["step"] = 1e300; }},
      {"step past the limit",
       [](HeaderParts& p) { FirstGroup(p)["step"] = uint64_t{1} << 60; }},
      {"no step", [](HeaderParts& p) { FirstGroup(p).erase("step"); }},
      {"lr as a string",
       [](HeaderParts& p) { FirstGroupHyper(p)["lr"] = "0.1"; }},
      {"lr past fp32",
       [](HeaderParts& p) { FirstGroupHyper(p)["lr"] = -1e39; }},
      {"no lr", [](HeaderParts& p) { FirstGroupHyper(p).erase("lr"); }},
      {"beta1 of 1.5",
       [](HeaderParts& p) { FirstGroupHyper(p)["beta1"] = 1.5; }},
      {"negative eps", [](HeaderParts& p) { FirstGroupHyper(p)["eps"] = -1; }},
      {"amsgrad as a number",
       [](HeaderParts& p) { FirstGroupHyper(p)["amsgrad"] = 1; }},
      {"hyperparameters a number",
       [](HeaderParts& p) { FirstGroup(p)["hyperparameters"] = 3; }},
      {"no hyperparameters",
       [](HeaderParts& p) { FirstGroup(p).erase("hyperparameters"); }},
      {"groups an object",
       [](HeaderParts& p) { p.meta["groups"] = json::object(); }},
      {"group a string", [](HeaderParts& p) { p.meta["groups"][0] = "g"; }},
      {"id a number", [](HeaderParts& p) { FirstGroup(p)["id"] = 7; }},
      {"tensor null",
       [](HeaderParts& p) { FirstGroup(p)["tensors"][0] = nullptr; }},
      {"numel a string",
       [](HeaderParts& p) { FirstGroup(p)["tensors"][0]["numel"] = "100"; }},
      {"format version a string",
       [](HeaderParts& p) { p.meta["format_version"] = "1"; }},
      {"crc32c an array",
       [](HeaderParts& p) { p.meta["crc32c"] = json::array(); }},
      {"crc32c not hex",
       [](HeaderParts& p) { p.meta["crc32c"]["w"] = "zzzzzzzz"; }},
      {"negative data offset",
       [](HeaderParts& p) { p.header["w"]["data_offsets"][0] = -1; }},
      {"data offsets past 2^64",
       [](HeaderParts& p) {
         p.header["w"]["data_offsets"] = {~uint64_t{0} - 10, ~uint64_t{0} + 0};
       }},
      {"nested shape",
       [](HeaderParts& p) { p.header["w"]["shape"] = {{100}}; }},
      {"dtype a number", [](HeaderParts& p) { p.header["w"]["dtype"] = 5; }},
      {"missed_steps a number",
       [](HeaderParts& p) { FirstGroup(p)["missed_steps"] = 3; }},
      {"missed_steps of a tensor past the group's",
       [](HeaderParts& p) {
         FirstGroup(p)["missed_steps"] = {{5, 1}};
       }},
      {"missed_steps above the step",
       [](HeaderParts& p) {
         FirstGroup(p)["missed_steps"] = {{0, 1u << 30}};
       }},
      {"deep nesting",
       [](HeaderParts& p) {
         json deep = 1;
         for (int i = 0; i < 100; ++i) deep = json::array({deep});
         FirstGroup(p)["extra"] = deep;
       }},
  };
}

// Every header field is checked for presence, type and range before any
// state changes: a wrong-typed step or lr used to abort the daemon.
TEST(CheckpointTest, MalformedHeaderFieldsAreRefusedAndChangeNothing) {
  OneTensorSession s;
  ScratchDir dir;
  auto saved = SaveSession(s.session(), dir.path(), CheckpointOptions());
  ASSERT_TRUE(saved.ok()) << saved.status();
  const std::string good = ReadFile(saved->path);
  ASSERT_TRUE(s.session().Step({}).ok());  // the state moves past the file
  const std::string before = s.Fingerprint();
  for (const auto& [what, edit] : MalformedHeaderEdits()) {
    SCOPED_TRACE(what);
    HeaderParts p = SplitCheckpoint(good);
    edit(p);
    WriteFile(saved->path, JoinCheckpoint(p));
    auto loaded = LoadSession(s.session(), dir.path(), CheckpointOptions());
    ASSERT_FALSE(loaded.ok());
    EXPECT_TRUE(loaded.status().code() == absl::StatusCode::kInvalidArgument ||
                loaded.status().code() == absl::StatusCode::kDataLoss)
        << loaded.status();
    EXPECT_EQ(s.Fingerprint(), before);
  }
  // The session still steps and loads a good file.
  WriteFile(saved->path, good);
  EXPECT_TRUE(LoadSession(s.session(), dir.path(), CheckpointOptions()).ok());
  EXPECT_TRUE(s.session().Step({}).ok());
}

// Block8 moment codes that no encoder writes (an exp_avg magnitude past
// 0x78, whose 0x7f and 0xff are NaN as e4m3fn codes, or an exp_avg_sq code
// past 0xf8) are refused with the tensor and element named, in both
// formats, and nothing changes; the largest valid codes load.
TEST(CheckpointTest, Block8CodesNoEncoderWritesAreRefused) {
  for (const bool packed : {false, true}) {
    SCOPED_TRACE(packed ? "packed" : "per tensor");
    OneTensorSession s({}, {}, DType::kBlock8);
    ScratchDir dir;
    auto saved = SaveSession(s.session(), dir.path(), InFormat(packed));
    ASSERT_TRUE(saved.ok()) << saved.status();
    const std::string good = ReadFile(saved->path);
    ASSERT_TRUE(s.session().Step({}).ok());
    const std::string before = s.Fingerprint();
    struct Case {
      const char* slot;
      uint8_t code;
      bool valid;
    };
    for (const Case& c :
         {Case{"exp_avg", 0x7f, false}, Case{"exp_avg", 0xff, false},
          Case{"exp_avg", 0x79, false}, Case{"exp_avg_sq", 0xf9, false},
          Case{"exp_avg", 0xf8, true}, Case{"exp_avg_sq", 0xf8, true}}) {
      SCOPED_TRACE(absl::StrCat(c.slot, " ", c.code));
      HeaderParts p = SplitCheckpoint(good);
      const std::string key = packed ? absl::StrCat("g0.", c.slot, ".U8")
                                     : absl::StrCat("w.", c.slot);
      ASSERT_TRUE(p.header.contains(key)) << p.header.dump();
      const uint64_t begin = p.header[key]["data_offsets"][0].get<uint64_t>();
      const uint64_t end = p.header[key]["data_offsets"][1].get<uint64_t>();
      p.data[begin + 7] = char(c.code);
      p.meta["crc32c"][key] = absl::StrCat(
          absl::Hex(Crc32cExtend(0, p.data.data() + begin, end - begin),
                    absl::kZeroPad8));
      WriteFile(saved->path, JoinCheckpoint(p));
      auto loaded = LoadSession(s.session(), dir.path(), CheckpointOptions());
      if (c.valid) {
        EXPECT_TRUE(loaded.ok()) << loaded.status();
        continue;
      }
      EXPECT_EQ(loaded.status().code(), absl::StatusCode::kInvalidArgument)
          << loaded.status();
      EXPECT_NE(loaded.status().message().find(
                    absl::StrCat("tensor 'w.", c.slot, "'")),
                std::string::npos)
          << loaded.status();
      EXPECT_NE(loaded.status().message().find("at element 7"),
                std::string::npos)
          << loaded.status();
      EXPECT_EQ(s.Fingerprint(), before);
    }
  }
}

// A tied weight's aliases are written into its group's metadata in both
// formats (only where there are any), read back and checked by the loader;
// files without them (all older files) load into a session with aliases.
TEST(CheckpointTest, AliasesRoundTripInBothFormats) {
  const std::vector<std::string> aliases = {"lm_head.weight", "dec.weight"};
  for (const bool packed : {false, true}) {
    SCOPED_TRACE(packed ? "packed" : "per tensor");
    OneTensorSession s(aliases);
    ScratchDir dir;
    auto saved = SaveSession(s.session(), dir.path(), InFormat(packed));
    ASSERT_TRUE(saved.ok()) << saved.status();
    const std::string good = ReadFile(saved->path);
    HeaderParts p = SplitCheckpoint(good);
    EXPECT_EQ(p.meta["format_version"], packed ? 2 : 1);
    EXPECT_EQ(p.meta["groups"][0]["aliases"],
              nlohmann::json::array({nlohmann::json::array({0, aliases})}));
    const std::string before = s.Fingerprint();
    ASSERT_TRUE(s.session().Step({}).ok());
    ASSERT_TRUE(LoadSession(s.session(), dir.path(), CheckpointOptions()).ok());
    EXPECT_EQ(s.Fingerprint(), before);
    // Without the key, as files written before aliases existed.
    p.meta["groups"][0].erase("aliases");
    WriteFile(saved->path, JoinCheckpoint(p));
    EXPECT_TRUE(LoadSession(s.session(), dir.path(), CheckpointOptions()).ok());
  }
  // A session without aliases writes no key.
  OneTensorSession plain;
  ScratchDir dir;
  auto saved = SaveSession(plain.session(), dir.path(), CheckpointOptions());
  ASSERT_TRUE(saved.ok()) << saved.status();
  EXPECT_FALSE(SplitCheckpoint(ReadFile(saved->path))
                   .meta["groups"][0]
                   .contains("aliases"));
}

// The aliases count in the estimate that chooses the packed format: a
// session whose names are short but whose aliases are long is packed.
TEST(CheckpointTest, AliasesCountTowardsThePackedFormat) {
  CheckpointOptions options;
  options.packed_above_header_bytes = 16 << 10;
  // Sixteen aliases of 1000 bytes: about 16 KB of header.
  std::vector<std::string> long_names;
  for (char c = 'a'; c < 'q'; ++c) long_names.push_back(std::string(1000, c));
  for (const bool long_aliases : {false, true}) {
    OneTensorSession s(long_aliases ? long_names
                                    : std::vector<std::string>{"tied"});
    ScratchDir dir;
    auto saved = SaveSession(s.session(), dir.path(), options);
    ASSERT_TRUE(saved.ok()) << saved.status();
    EXPECT_EQ(SplitCheckpoint(ReadFile(saved->path)).meta["format_version"],
              long_aliases ? 2 : 1);
  }
}

// Every malformed "aliases" key is INVALID_ARGUMENT naming the field, and
// changes nothing.
TEST(CheckpointTest, MalformedAliasesAreRefusedAndChangeNothing) {
  using nlohmann::json;
  OneTensorSession s({"tied"});
  ScratchDir dir;
  auto saved = SaveSession(s.session(), dir.path(), CheckpointOptions());
  ASSERT_TRUE(saved.ok()) << saved.status();
  const std::string good = ReadFile(saved->path);
  ASSERT_TRUE(s.session().Step({}).ok());
  const std::string before = s.Fingerprint();
  const std::vector<std::pair<std::string, json>> edits = {
      {"a number", 3},
      {"an object", json::object()},
      {"a pair of three", json::array({json::array({0, {"a"}, 1})})},
      {"an index past the tensors", json::array({json::array({1, {"a"}})})},
      {"a negative index", json::array({json::array({-1, {"a"}})})},
      {"an index twice",
       json::array({json::array({0, {"a"}}), json::array({0, {"b"}})})},
      {"no names", json::array({json::array({0, json::array()})})},
      {"names a string", json::array({json::array({0, "a"})})},
      {"a name a number", json::array({json::array({0, {7}})})},
      {"an empty name", json::array({json::array({0, {""}})})},
      {"a name too long",
       json::array({json::array({0, {std::string(kMaxNameBytes + 1, 'x')}})})},
      {"too many names",
       json::array({json::array(
           {0, std::vector<std::string>(kMaxAliasesPerTensor + 1, "x")})})},
      {"a tensor's name", json::array({json::array({0, {"w"}})})},
      {"a name twice", json::array({json::array({0, {"a", "a"}})})},
  };
  for (const auto& [what, aliases] : edits) {
    SCOPED_TRACE(what);
    HeaderParts p = SplitCheckpoint(good);
    p.meta["groups"][0]["aliases"] = aliases;
    WriteFile(saved->path, JoinCheckpoint(p));
    auto loaded = LoadSession(s.session(), dir.path(), CheckpointOptions());
    EXPECT_EQ(loaded.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(loaded.status().message().find("'aliases'"), std::string::npos)
        << loaded.status();
    EXPECT_EQ(s.Fingerprint(), before);
  }
}

// A shard's place in its whole tensor is written into its group's metadata
// in both formats ("shards": [index, whole shape, offset], only where there
// are shards), and files with or without the key load.
TEST(CheckpointTest, ShardPlacesRoundTripInBothFormats) {
  using nlohmann::json;
  for (const bool packed : {false, true}) {
    SCOPED_TRACE(packed ? "packed" : "per tensor");
    OneTensorSession s({}, {{300}, {100}});
    ScratchDir dir;
    auto saved = SaveSession(s.session(), dir.path(), InFormat(packed));
    ASSERT_TRUE(saved.ok()) << saved.status();
    HeaderParts p = SplitCheckpoint(ReadFile(saved->path));
    EXPECT_EQ(p.meta["groups"][0]["shards"],
              json::array({json::array({0, {300}, {100}})}));
    const std::string before = s.Fingerprint();
    ASSERT_TRUE(s.session().Step({}).ok());
    ASSERT_TRUE(LoadSession(s.session(), dir.path(), CheckpointOptions()).ok());
    EXPECT_EQ(s.Fingerprint(), before);
    p.meta["groups"][0].erase("shards");
    WriteFile(saved->path, JoinCheckpoint(p));
    EXPECT_TRUE(LoadSession(s.session(), dir.path(), CheckpointOptions()).ok());
  }
  OneTensorSession whole;
  ScratchDir dir;
  auto saved = SaveSession(whole.session(), dir.path(), CheckpointOptions());
  ASSERT_TRUE(saved.ok()) << saved.status();
  EXPECT_FALSE(SplitCheckpoint(ReadFile(saved->path))
                   .meta["groups"][0]
                   .contains("shards"));
}

// Every malformed "shards" key is INVALID_ARGUMENT naming the field, and
// changes nothing.
TEST(CheckpointTest, MalformedShardPlacesAreRefusedAndChangeNothing) {
  using nlohmann::json;
  OneTensorSession s({}, {{200}, {0}});
  ScratchDir dir;
  auto saved = SaveSession(s.session(), dir.path(), CheckpointOptions());
  ASSERT_TRUE(saved.ok()) << saved.status();
  const std::string good = ReadFile(saved->path);
  ASSERT_TRUE(s.session().Step({}).ok());
  const std::string before = s.Fingerprint();
  const std::vector<std::pair<std::string, json>> edits = {
      {"a number", 3},
      {"a pair", json::array({json::array({0, {200}})})},
      {"an index past the tensors", json::array({json::array({1, {9}, {0}})})},
      {"an index twice",
       json::array({json::array({0, {9}, {0}}), json::array({0, {9}, {0}})})},
      {"no dimensions", json::array({json::array({0, json::array(), {}})})},
      {"an offset of other rank", json::array({json::array({0, {9}, {0, 0}})})},
      {"a negative size", json::array({json::array({0, {-9}, {0}})})},
      {"too many dimensions",
       json::array({json::array(
           {0, std::vector<int>(65, 1), std::vector<int>(65, 0)})})},
  };
  for (const auto& [what, shards] : edits) {
    SCOPED_TRACE(what);
    HeaderParts p = SplitCheckpoint(good);
    p.meta["groups"][0]["shards"] = shards;
    WriteFile(saved->path, JoinCheckpoint(p));
    auto loaded = LoadSession(s.session(), dir.path(), CheckpointOptions());
    EXPECT_EQ(loaded.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(loaded.status().message().find("'shards'"), std::string::npos)
        << loaded.status();
    EXPECT_EQ(s.Fingerprint(), before);
  }
}

// A damaged learning rate or step counter is valid JSON in range; the
// metadata checksum catches it.
TEST(CheckpointTest, DamagedMetadataIsDataLoss) {
  OneTensorSession s;
  ScratchDir dir;
  auto saved = SaveSession(s.session(), dir.path(), CheckpointOptions());
  ASSERT_TRUE(saved.ok()) << saved.status();
  const std::string good = ReadFile(saved->path);
  const std::string before = s.Fingerprint();
  HeaderParts p = SplitCheckpoint(good);
  p.meta["groups"][0]["hyperparameters"]["lr"] = 1.001;
  WriteFile(saved->path, JoinCheckpoint(p, /*keep_crc=*/true));
  auto loaded = LoadSession(s.session(), dir.path(), CheckpointOptions());
  EXPECT_EQ(loaded.status().code(), absl::StatusCode::kDataLoss)
      << loaded.status();
  EXPECT_EQ(s.Fingerprint(), before);
  // A file without the metadata checksum (written before it existed) loads.
  p = SplitCheckpoint(good);
  p.header["__metadata__"].erase("optimd_crc32c");
  WriteFile(saved->path, JoinCheckpoint(p, /*keep_crc=*/true));
  EXPECT_TRUE(LoadSession(s.session(), dir.path(), CheckpointOptions()).ok());
}

// A named change that another process makes to a file at `path`.
using FileChange =
    std::pair<std::string, std::function<void(const std::string& path)>>;

// Changes to a checkpoint whose bytes are `file`: written in place with the
// same bytes, grown, only its times set, or replaced at its name by
// `corrupt`.
std::vector<FileChange> ChangesDuringALoad(const std::string& file,
                                           const std::string& corrupt) {
  return {
      {"rewritten in place",
       [file](const std::string& path) {
         std::fstream f(path, std::ios::binary | std::ios::in | std::ios::out);
         f.seekp(0);
         f.write(file.data(), file.size());
       }},
      {"grown",
       [](const std::string& path) {
         std::ofstream(path, std::ios::binary | std::ios::app) << "x";
       }},
      {"times set",
       [](const std::string& path) {
         const timespec now[2] = {{0, UTIME_NOW}, {0, UTIME_NOW}};
         ASSERT_EQ(utimensat(AT_FDCWD, path.c_str(), now, 0), 0);
       }},
      {"replaced at its name",
       [corrupt](const std::string& path) {
         WriteFile(path + ".new", corrupt);
         ASSERT_EQ(std::rename((path + ".new").c_str(), path.c_str()), 0);
       }},
  };
}

// File times tick with the kernel's coarse clock (at most 10 ms): they are
// set far back and a change comes 50 ms later (this returns after 50 ms),
// so that it always shows (in mtime, or in ctime).
void SetTimesFarBack(const std::string& path) {
  const timespec old[2] = {{1000000000, 0}, {1000000000, 0}};
  ASSERT_EQ(utimensat(AT_FDCWD, path.c_str(), old, 0), 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
}

// Loads `session` from `dir` on a thread of its own while `gate` holds the
// load's first read of the file; `change` runs while it is held (if a read
// came), then the gate opens and the load ends into `loaded`. Gives the
// hold's status: DEADLINE_EXCEEDED when no read came within 60 s.
absl::Status LoadWithItsFirstReadHeld(
    FileReadGate& gate, Session& session, const std::string& dir,
    const std::function<void()>& change,
    absl::StatusOr<CheckpointResult>* loaded) {
  std::thread load(
      [&] { *loaded = LoadSession(session, dir, CheckpointOptions()); });
  const absl::Status held = gate.HoldNextRead(getpid(), absl::Seconds(60));
  if (held.ok()) change();
  gate.Open();
  load.join();
  return held;
}

// `loaded` is the refusal of a file changed during its load.
void ExpectAbortedAsChanged(const absl::Status& loaded) {
  EXPECT_EQ(loaded.code(), absl::StatusCode::kAborted) << loaded;
  EXPECT_NE(loaded.message().find("changed while its checksums were verified"),
            std::string::npos)
      << loaded;
  EXPECT_NE(loaded.message().find("nothing was loaded"), std::string::npos);
}

// A file that another process changes while a load reads it (written in
// place with the same bytes, grown, only its times set, or replaced at its
// name, which changes the opened file's ctime as its link goes) is ABORTED
// with nothing changed: the load's first read of the file is held
// (FileReadGate) while the test changes it, so the change falls between
// the load's open and its check, after the verifying pass, that the file is
// still what it opened. The session steps on, and loads the file once it
// is left alone.
TEST(CheckpointTest, FileChangedDuringItsLoadIsAbortedAndChangesNothing) {
  OneTensorSession s;
  ScratchDir dir;
  auto saved = SaveSession(s.session(), dir.path(), CheckpointOptions());
  ASSERT_TRUE(saved.ok()) << saved.status();
  const std::string file = ReadFile(saved->path);
  std::string corrupt = file;
  corrupt[corrupt.size() - 1] ^= 0x40;
  // Step on, so that a load would change the state back.
  ASSERT_TRUE(s.session().Step({}).ok());
  for (const FileChange& change : ChangesDuringALoad(file, corrupt)) {
    SCOPED_TRACE(change.first);
    WriteFile(saved->path, file);
    ASSERT_NO_FATAL_FAILURE(SetTimesFarBack(saved->path));
    const std::string before = s.Fingerprint();
    auto gate = FileReadGate::Create(saved->path);
    if (gate.status().code() == absl::StatusCode::kFailedPrecondition) {
      GTEST_SKIP() << "cannot hold the load's reads here: " << gate.status();
    }
    ASSERT_TRUE(gate.ok()) << gate.status();
    absl::StatusOr<CheckpointResult> loaded;
    const absl::Status held = LoadWithItsFirstReadHeld(
        **gate, s.session(), dir.path(), [&] { change.second(saved->path); },
        &loaded);
    ASSERT_TRUE(held.ok()) << held;
    ExpectAbortedAsChanged(loaded.status());
    EXPECT_EQ(s.Fingerprint(), before);
    // Not left needing a load: it steps.
    ASSERT_TRUE(s.session().Step({}).ok());
  }
  // Loaded again as the refusal says: what the last change left at the
  // name is corrupt, DATA_LOSS with nothing changed; the good file, left
  // alone, loads the saved state.
  const std::string before = s.Fingerprint();
  auto loaded = LoadSession(s.session(), dir.path(), CheckpointOptions());
  EXPECT_EQ(loaded.status().code(), absl::StatusCode::kDataLoss)
      << loaded.status();
  EXPECT_EQ(s.Fingerprint(), before);
  WriteFile(saved->path, file);
  loaded = LoadSession(s.session(), dir.path(), CheckpointOptions());
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  OneTensorSession twin;  // the state at the save
  EXPECT_EQ(s.Fingerprint(), twin.Fingerprint());
}

}  // namespace
}  // namespace optimd
