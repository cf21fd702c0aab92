#include "tests/checkpoint/checkpoint_fuzz.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <memory>

#include "absl/strings/str_cat.h"
#include "backends/cpu/cpu_backend.h"
#include "checkpoint/session_checkpoint.h"
#include "common/status_macros.h"
#include "core/session.h"

namespace optimd {
namespace {

// A shared-memory segment of this process, unlinked at once (the daemon's
// side maps it by name while it exists: the session maps it at
// registration, before the unlink).
struct Segment {
  std::string name;
  uint8_t* data = nullptr;
};

Segment MakeSegment(const std::string& tag, size_t bytes) {
  Segment s;
  s.name = absl::StrCat("/optimd-fuzz-", getpid(), "-", tag);
  const int fd = shm_open(s.name.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  if (fd < 0 || ftruncate(fd, bytes) != 0) std::abort();
  s.data = static_cast<uint8_t*>(
      mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
  close(fd);
  return s;
}

TensorSpec Tensor(const std::string& name, uint64_t numel, DType dtype,
                  const Segment& params, const Segment& grads,
                  uint64_t offset) {
  TensorSpec t;
  t.name = name;
  t.numel = numel;
  t.param_dtype = t.grad_dtype = dtype;
  t.param_dtype_set = t.grad_dtype_set = true;
  if (numel == 0) return t;
  t.param.kind = t.grad.kind = BufferHandle::Kind::kSharedMemory;
  t.param.segment_name = params.name;
  t.grad.segment_name = grads.name;
  t.param.offset = t.grad.offset = offset;
  t.param.size = t.grad.size = numel * DTypeSize(dtype);
  return t;
}

// The session every input is loaded into: group "a" (fp32 with two
// aliases, bf16 with an fp32 master, frozen, zero-element tensors) and
// group "b" (amsgrad, bf16 moments), stepped once. Its checkpoint file is a
// memfd.
class FuzzSession {
 public:
  static FuzzSession& Get() {
    static FuzzSession* s = new FuzzSession();
    return *s;
  }
  Session& session() { return *session_; }
  const std::string& path() const { return path_; }
  int fd() const { return fd_; }

 private:
  FuzzSession() : backend_(CpuBackend::Options{1, 1024}), budget_(0) {
    std::string done;
    session_ = std::make_unique<Session>(SessionIdentity{"fuzz", 0, 1, -1},
                                         &backend_, &budget_,
                                         *backend_.OpenSession(-1, "", &done));
    const Segment params = MakeSegment("p", 4096);
    const Segment grads = MakeSegment("g", 4096);
    for (int i = 0; i < 64; ++i) {
      reinterpret_cast<float*>(grads.data)[i] = 0.01f * i - 0.3f;
    }
    GroupSpec a, b;
    a.id = "a";
    a.tensors = {Tensor("w", 4, DType::kFloat32, params, grads, 0),
                 Tensor("h", 4, DType::kBFloat16, params, grads, 64),
                 Tensor("f", 4, DType::kFloat32, params, grads, 128),
                 Tensor("z", 0, DType::kFloat32, params, grads, 0)};
    a.tensors[0].aliases = {"head.w", "dec.w"};
    a.tensors[2].frozen = true;
    a.tensors[2].grad = BufferHandle();
    b.id = "b";
    b.hyper.amsgrad = true;
    b.moment_dtype = DType::kBFloat16;
    b.tensors = {Tensor("u", 4, DType::kFloat32, params, grads, 192)};
    if (!session_->RegisterGroup(a).ok() || !session_->RegisterGroup(b).ok() ||
        !session_->Step({}).ok()) {
      std::abort();
    }
    shm_unlink(params.name.c_str());
    shm_unlink(grads.name.c_str());
    fd_ = memfd_create("optimd-fuzz-checkpoint", MFD_CLOEXEC);
    path_ = absl::StrCat("/proc/self/fd/", fd_);
  }

  CpuBackend backend_;
  StateBudget budget_;
  std::unique_ptr<Session> session_;
  int fd_ = -1;
  std::string path_;
};

}  // namespace

absl::Status LoadFuzzCheckpoint(const uint8_t* data, size_t size) {
  FuzzSession& f = FuzzSession::Get();
  if (ftruncate(f.fd(), 0) != 0 ||
      pwrite(f.fd(), data, size, 0) != static_cast<ssize_t>(size)) {
    return absl::InternalError("cannot write the fuzz input");
  }
  return LoadSessionFile(f.session(), f.path(), CheckpointOptions()).status();
}

absl::Status WriteFuzzSeeds(const std::string& dir) {
  FuzzSession& f = FuzzSession::Get();
  for (int version : {1, 2}) {
    const std::string sub = absl::StrCat(dir, "/v", version);
    if (mkdir(sub.c_str(), 0700) != 0 && errno != EEXIST) {
      return absl::InternalError(absl::StrCat("cannot create ", sub));
    }
    CheckpointOptions options;
    options.packed_above_header_bytes = version == 2 ? 0 : ~uint64_t{0};
    OPTIMD_ASSIGN_OR_RETURN(CheckpointResult r,
                            SaveSession(f.session(), sub, options));
    const std::string seed = absl::StrCat(dir, "/valid-v", version);
    if (rename(r.path.c_str(), seed.c_str()) != 0 || rmdir(sub.c_str()) != 0) {
      return absl::InternalError(absl::StrCat("cannot move ", r.path));
    }
  }
  return absl::OkStatus();
}

}  // namespace optimd

// libFuzzer's entry point (tools/fuzz.sh).
extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  (void)optimd::LoadFuzzCheckpoint(data, size);
  return 0;
}
