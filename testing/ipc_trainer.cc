#include "testing/ipc_trainer.h"

#include <cuda_runtime.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"

namespace optimd {
namespace {

enum Op : uint32_t { kAlloc = 1, kUpload = 2, kDownload = 3, kExit = 4 };

struct Request {
  uint32_t op;
  int32_t id;
  uint64_t offset;
  uint64_t bytes;
  uint64_t staging_offset;
};

struct Reply {
  int32_t status;  // cudaError_t
  int32_t id;
  char handle[64];
};

bool ReadFull(int fd, void* p, size_t n) {
  auto* c = static_cast<char*>(p);
  while (n > 0) {
    const ssize_t r = read(fd, c, n);
    if (r <= 0) return false;
    c += r;
    n -= r;
  }
  return true;
}

bool WriteFull(int fd, const void* p, size_t n) {
  const auto* c = static_cast<const char*>(p);
  while (n > 0) {
    const ssize_t r = write(fd, c, n);
    if (r <= 0) return false;
    c += r;
    n -= r;
  }
  return true;
}

[[noreturn]] void ChildLoop(int fd, int device, uint8_t* staging) {
  std::vector<void*> allocations;
  cudaSetDevice(device);
  Request req;
  while (ReadFull(fd, &req, sizeof(req))) {
    Reply rep{};
    switch (req.op) {
      case kAlloc: {
        void* p = nullptr;
        rep.status = cudaMalloc(&p, req.bytes);
        if (rep.status == cudaSuccess) {
          // The fill byte travels in `offset`.
          rep.status =
              cudaMemset(p, static_cast<int>(req.offset & 0xff), req.bytes);
          if (rep.status != cudaSuccess) break;
          cudaIpcMemHandle_t h;
          rep.status = cudaIpcGetMemHandle(&h, p);
          std::memcpy(rep.handle, &h, sizeof(h));
          rep.id = static_cast<int32_t>(allocations.size());
          allocations.push_back(p);
        }
        break;
      }
      case kUpload:
        rep.status = cudaMemcpy(
            static_cast<uint8_t*>(allocations[req.id]) + req.offset,
            staging + req.staging_offset, req.bytes, cudaMemcpyHostToDevice);
        break;
      case kDownload:
        rep.status =
            cudaMemcpy(staging + req.staging_offset,
                       static_cast<uint8_t*>(allocations[req.id]) + req.offset,
                       req.bytes, cudaMemcpyDeviceToHost);
        break;
      case kExit:
        WriteFull(fd, &rep, sizeof(rep));
        _exit(0);
    }
    if (rep.status != cudaSuccess) {
      std::fprintf(stderr,
                   "ipc_trainer: op %u id %d offset %llu bytes %llu staging "
                   "%llu: %s\n",
                   req.op, req.id, (unsigned long long)req.offset,
                   (unsigned long long)req.bytes,
                   (unsigned long long)req.staging_offset,
                   cudaGetErrorName(static_cast<cudaError_t>(rep.status)));
    }
    if (!WriteFull(fd, &rep, sizeof(rep))) break;
  }
  _exit(0);
}

}  // namespace

absl::StatusOr<std::unique_ptr<IpcTrainer>> IpcTrainer::Start(
    int device, uint64_t staging_bytes) {
  std::unique_ptr<IpcTrainer> t(new IpcTrainer());
  auto staging = SharedMemoryRegion::Create(staging_bytes);
  if (!staging.ok()) return staging.status();
  t->staging_ = *std::move(staging);
  int fds[2];
  if (socketpair(AF_UNIX, SOCK_STREAM, 0, fds) != 0) {
    return absl::InternalError("socketpair failed");
  }
  const pid_t pid = fork();
  if (pid < 0) return absl::InternalError("fork failed");
  if (pid == 0) {
    close(fds[0]);
    ChildLoop(fds[1], device, t->staging_->data());
  }
  close(fds[1]);
  t->pid_ = pid;
  t->fd_ = fds[0];
  return t;
}

IpcTrainer::~IpcTrainer() {
  if (fd_ >= 0) {
    Request req{kExit, 0, 0, 0, 0};
    Reply rep;
    WriteFull(fd_, &req, sizeof(req));
    ReadFull(fd_, &rep, sizeof(rep));
    close(fd_);
  }
  if (pid_ > 0) waitpid(pid_, nullptr, 0);
}

absl::Status IpcTrainer::Call(const void* request, size_t n, void* reply,
                              size_t m) {
  if (!WriteFull(fd_, request, n) || !ReadFull(fd_, reply, m)) {
    return absl::InternalError("the trainer process is gone");
  }
  const auto* rep = static_cast<const Reply*>(reply);
  if (rep->status != 0) {
    return absl::InternalError(
        absl::StrCat("trainer CUDA error ",
                     cudaGetErrorName(static_cast<cudaError_t>(rep->status))));
  }
  return absl::OkStatus();
}

absl::StatusOr<IpcTrainer::Allocation> IpcTrainer::Alloc(uint64_t bytes,
                                                         uint8_t fill) {
  Request req{kAlloc, 0, fill, bytes, 0};
  Reply rep;
  absl::Status s = Call(&req, sizeof(req), &rep, sizeof(rep));
  if (!s.ok()) return s;
  Allocation a;
  a.id = rep.id;
  a.ipc_handle.assign(rep.handle, 64);
  return a;
}

absl::Status IpcTrainer::Upload(int id, uint64_t offset, uint64_t bytes,
                                uint64_t staging_offset) {
  Request req{kUpload, id, offset, bytes, staging_offset};
  Reply rep;
  return Call(&req, sizeof(req), &rep, sizeof(rep));
}

absl::Status IpcTrainer::Download(int id, uint64_t offset, uint64_t bytes,
                                  uint64_t staging_offset) {
  Request req{kDownload, id, offset, bytes, staging_offset};
  Reply rep;
  return Call(&req, sizeof(req), &rep, sizeof(rep));
}

}  // namespace optimd
