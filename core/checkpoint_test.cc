#include "core/checkpoint.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>

#include "client/shm_tensor.h"
#include "core/cpu_backend.h"
#include "core/session.h"
#include "gtest/gtest.h"

namespace optimd {
namespace {

std::string TempDir() {
  char dir[] = "/tmp/optimd-ckpt-test-XXXXXX";
  EXPECT_NE(mkdtemp(dir), nullptr);
  return dir;
}

TEST(CheckpointTest, FileNamesAreSafe) {
  EXPECT_EQ(CheckpointFileName("job-1", 3), "job-1.rank-3.safetensors");
  EXPECT_EQ(CheckpointFileName("../../etc/x y", 0),
            "job.._.._etc_x_y.rank-0.safetensors");
  EXPECT_EQ(CheckpointFileName("", 1), "job.rank-1.safetensors");
}

TEST(CheckpointTest, DirectoriesAreCheckedAndConfined) {
  const std::string root = TempDir();
  ASSERT_EQ(mkdir((root + "/inside").c_str(), 0700), 0);
  CheckpointOptions open;
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
  CpuBackend backend(CpuBackend::Options{1, 1024});
  StateBudget budget(0);
  std::string done;
  Session s(SessionIdentity{"snap", 0, 1, -1}, &backend, &budget,
            *backend.OpenSession(-1, "", &done));
  auto params = *SharedMemoryRegion::Create(4096);
  auto grads = *SharedMemoryRegion::Create(4096);
  for (int i = 0; i < 100; ++i) {
    params->as<float>()[i] = 0.01f * i;
    grads->as<float>()[i] = 1.0f - 0.02f * i;
  }
  GroupSpec spec;
  spec.id = "g";
  TensorSpec t;
  t.name = "w";
  t.numel = 100;
  t.param_dtype_set = t.grad_dtype_set = true;
  t.param.kind = t.grad.kind = BufferHandle::Kind::kSharedMemory;
  t.param.segment_name = params->name();
  t.grad.segment_name = grads->name();
  t.param.size = t.grad.size = 400;
  spec.tensors = {t};
  ASSERT_TRUE(s.RegisterGroup(spec).ok());
  ASSERT_TRUE(s.Step({}).ok());
  const std::string dir = TempDir();
  auto saved = s.SaveState(dir, CheckpointOptions());
  ASSERT_TRUE(saved.ok()) << saved.status();
  std::ifstream in(saved->path, std::ios::binary);
  std::string file((std::istreambuf_iterator<char>(in)),
                   std::istreambuf_iterator<char>());
  auto snapshot = s.Snapshot();
  ASSERT_TRUE(snapshot.ok());
  ASSERT_EQ((*snapshot)->FileSize(), file.size());
  std::string streamed(file.size(), '\0');
  (*snapshot)->ReadFile(0, 10, reinterpret_cast<uint8_t*>(streamed.data()));
  (*snapshot)->ReadFile(10, file.size() - 10,
                        reinterpret_cast<uint8_t*>(streamed.data() + 10));
  EXPECT_EQ(streamed, file);
}

}  // namespace
}  // namespace optimd
