#include "core/checkpoint.h"

#include <fcntl.h>
#include <limits.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <future>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/crc32c.h"
#include "common/fault_guard.h"
#include "common/status_macros.h"
#include "core/checkpoint_header.h"
#include "core/checkpoint_temporaries.h"
#include "nlohmann/json.hpp"

namespace optimd {
namespace {

using checkpoint_header::Arrange;
using checkpoint_header::CheckHeaderSize;
using checkpoint_header::Entries;
using checkpoint_header::Entry;
using checkpoint_header::GroupHeader;
using checkpoint_header::HeaderJson;
using checkpoint_header::MetaJson;
using checkpoint_header::ParseHeader;
using checkpoint_header::RunEnds;
using checkpoint_header::RunStarts;
using checkpoint_header::UsePacked;
using nlohmann::json;

double Seconds() {
  return std::chrono::duration<double>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

absl::Status ErrnoStatus(int err, const std::string& what) {
  const std::string msg = absl::StrCat(what, ": ", std::strerror(err));
  switch (err) {
    case ENOENT:
    case ENOTDIR:
      return absl::NotFoundError(msg);
    case EACCES:
    case EPERM:
    case EROFS:
      return absl::PermissionDeniedError(msg);
    case ENOSPC:
    case EDQUOT:
      return absl::ResourceExhaustedError(msg);
    default:
      return absl::InternalError(msg);
  }
}

// RAII file descriptor.
class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() {
    if (fd_ >= 0) close(fd_);
  }
  int get() const { return fd_; }
  void reset(int fd) {
    if (fd_ >= 0) close(fd_);
    fd_ = fd;
  }

 private:
  int fd_;
};

absl::Status WriteAll(int fd, const void* data, uint64_t n, uint64_t offset,
                      const std::string& path) {
  const auto* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w = pwrite(fd, p, std::min<uint64_t>(n, 1 << 30), offset);
    if (w < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus(errno, absl::StrCat("writing ", path));
    }
    p += w;
    n -= w;
    offset += w;
  }
  return absl::OkStatus();
}

absl::Status ReadAll(int fd, void* data, uint64_t n, uint64_t offset,
                     const std::string& path) {
  auto* p = static_cast<char*>(data);
  while (n > 0) {
    const ssize_t r = pread(fd, p, std::min<uint64_t>(n, 1 << 30), offset);
    if (r < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus(errno, absl::StrCat("reading ", path));
    }
    if (r == 0) {
      return absl::DataLossError(absl::StrCat(path, " is truncated"));
    }
    p += r;
    n -= r;
    offset += r;
  }
  return absl::OkStatus();
}

// Gathers writes into large pwritev calls (storage is much faster with
// writes of tens of megabytes than with one call per tensor).
class BatchWriter {
 public:
  BatchWriter(int fd, const std::string& path) : fd_(fd), path_(path) {}

  // Queues [data, data + n) for the file at `offset` (which must follow the
  // previous queued byte). The memory must stay valid until Flush.
  absl::Status Append(const uint8_t* data, uint64_t n, uint64_t offset) {
    if (n == 0) return absl::OkStatus();
    if (iov_.empty()) start_ = offset;
    iov_.push_back({const_cast<uint8_t*>(data), n});
    queued_ += n;
    if (queued_ >= kBatchBytes || iov_.size() >= kMaxIov) return Flush();
    return absl::OkStatus();
  }

  // Starts writing the queued bytes on a thread of its own (after the
  // previous batch finished) so that checksums of the next batch overlap
  // with the disk. The queued memory must stay valid until the next Flush
  // or Wait returns.
  absl::Status Flush() {
    OPTIMD_RETURN_IF_ERROR(Wait());
    if (iov_.empty()) return absl::OkStatus();
    inflight_iov_.swap(iov_);
    iov_.clear();
    const uint64_t offset = start_;
    start_ += queued_;
    queued_ = 0;
    inflight_ = std::async(std::launch::async, [this, offset] {
      return WriteIov(&inflight_iov_, offset);
    });
    return absl::OkStatus();
  }

  // Waits for the batch in flight.
  absl::Status Wait() {
    if (!inflight_.valid()) return absl::OkStatus();
    return inflight_.get();
  }

  ~BatchWriter() { (void)Wait(); }

 private:
  absl::Status WriteIov(std::vector<iovec>* iov, uint64_t offset) {
    size_t first = 0;
    while (first < iov->size()) {
      const int count =
          static_cast<int>(std::min<size_t>(iov->size() - first, kMaxIov));
      const ssize_t w = pwritev(fd_, iov->data() + first, count, offset);
      if (w < 0) {
        if (errno == EINTR) continue;
        return ErrnoStatus(errno, absl::StrCat("writing ", path_));
      }
      offset += w;
      uint64_t left = static_cast<uint64_t>(w);
      while (left > 0 && first < iov->size()) {
        iovec& v = (*iov)[first];
        if (left >= v.iov_len) {
          left -= v.iov_len;
          ++first;
        } else {
          v.iov_base = static_cast<uint8_t*>(v.iov_base) + left;
          v.iov_len -= left;
          left = 0;
        }
      }
    }
    return absl::OkStatus();
  }

  static constexpr uint64_t kBatchBytes = uint64_t{64} << 20;
  static constexpr size_t kMaxIov = 512;
  const int fd_;
  const std::string path_;
  std::vector<iovec> iov_;
  std::vector<iovec> inflight_iov_;
  std::future<absl::Status> inflight_;
  uint64_t queued_ = 0;
  uint64_t start_ = 0;
};

// Feeds state bytes to a BatchWriter, through the staging buffer (or
// directly when the memory is host memory), computing their crc32c.
class Streamer {
 public:
  // `backend` null: the entries are host memory (a snapshot).
  Streamer(Backend* backend, uint64_t staging_bytes)
      : backend_(backend),
        direct_(backend == nullptr || backend->HostAddressable()),
        staging_bytes_(staging_bytes),
        half_(staging_bytes / 2) {}

  uint64_t peak_staging() const { return staging_.size(); }

  // Queues an entry's bytes on `writer` (directly from host memory, or
  // through the staging buffer, flushing it when full), extending *crc
  // over them.
  absl::Status Save(BatchWriter* writer, const Entry& e, uint64_t file_offset,
                    uint32_t* crc) {
    uint32_t c = *crc;
    for (uint64_t done = 0; done < e.bytes;) {
      const uint8_t* src = e.data + done;
      uint64_t n = e.bytes - done;
      if (!direct_) {
        // Two halves: one is written while the other fills.
        Grow(2 * half_);
        OPTIMD_RETURN_IF_ERROR(status_);
        if (staging_used_ == half_) {
          OPTIMD_RETURN_IF_ERROR(writer->Flush());  // waits for the other
          staging_used_ = 0;
          half_index_ ^= 1;
        }
        n = std::min(n, half_ - staging_used_);
        uint8_t* dst = staging_.data() + half_index_ * half_ + staging_used_;
        OPTIMD_RETURN_IF_ERROR(backend_->CopyToHost(src, dst, n));
        staging_used_ += n;
        src = dst;
      }
      OPTIMD_RETURN_IF_ERROR(GuardMemoryFaults(
          [&] { c = Crc32cExtend(c, src, n); }, "checkpoint save"));
      OPTIMD_RETURN_IF_ERROR(writer->Append(src, n, file_offset + done));
      done += n;
    }
    *crc = c;
    return absl::OkStatus();
  }

 private:
  // The staging buffer comes from the backend: pinned host memory on the
  // CUDA backend, so device copies run at full speed.
  void Grow(uint64_t n) {
    if (staging_.size() >= n || !status_.ok()) return;
    auto s = backend_->AllocateHostStaging(std::max(n, staging_bytes_));
    if (s.ok()) {
      staging_ = *std::move(s);
    } else {
      status_ = s.status();
    }
  }

  Backend* const backend_;
  const bool direct_;
  const uint64_t staging_bytes_;
  StateStorage staging_;
  absl::Status status_;
  uint64_t staging_used_ = 0;
  const uint64_t half_;
  int half_index_ = 0;
};

// Reads every file tensor's bytes once and checks its checksum, changing
// nothing, so that a corrupt file is refused before any state changes.
absl::Status VerifyChecksums(int fd, const std::vector<Entry>& entries,
                             uint64_t data_start, const std::string& path) {
  constexpr uint64_t kChunk = uint64_t{4} << 20;
  std::vector<uint8_t> buffer;
  uint32_t crc = 0;
  for (size_t i = 0; i < entries.size(); ++i) {
    const Entry& e = entries[i];
    if (RunStarts(entries, i)) crc = 0;
    for (uint64_t done = 0; done < e.bytes;) {
      const uint64_t n = std::min(e.bytes - done, kChunk);
      if (buffer.size() < n) buffer.resize(n);
      OPTIMD_RETURN_IF_ERROR(
          ReadAll(fd, buffer.data(), n, data_start + e.offset + done, path));
      crc = Crc32cExtend(crc, buffer.data(), n);
      done += n;
    }
    if (RunEnds(entries, i) && crc != e.crc) {
      return absl::DataLossError(
          absl::StrCat("checksum mismatch in tensor '", e.key, "' of ", path,
                       ": the file is corrupt; nothing was loaded"));
    }
  }
  return absl::OkStatus();
}

absl::Status FsyncDir(const std::string& dir) {
  Fd d(open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (d.get() < 0) return ErrnoStatus(errno, absl::StrCat("opening ", dir));
  if (fsync(d.get()) != 0) {
    return ErrnoStatus(errno, absl::StrCat("syncing ", dir));
  }
  return absl::OkStatus();
}

}  // namespace

std::string CheckpointFileName(uint32_t rank) {
  return absl::StrCat("rank-", rank, ".safetensors");
}

std::string FileNameOf(absl::string_view s) {
  std::string name;
  for (char c : s) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
                    (c >= '0' && c <= '9') || c == '.' || c == '_' || c == '-';
    name.push_back(ok ? c : '_');
  }
  if (name.empty() || name[0] == '.') name = "job" + name;
  return name;
}

std::string LegacyCheckpointFileName(const std::string& job_id, uint32_t rank) {
  return absl::StrCat(FileNameOf(job_id), ".rank-", rank, ".safetensors");
}

absl::StatusOr<std::string> ResolveCheckpointDir(
    const std::string& directory, const CheckpointOptions& options) {
  if (directory.empty() || directory[0] != '/') {
    return absl::InvalidArgumentError(
        absl::StrCat("checkpoint directory '", directory,
                     "' must be an absolute path on the daemon's machine"));
  }
  char resolved[PATH_MAX];
  if (realpath(directory.c_str(), resolved) == nullptr) {
    return ErrnoStatus(errno, absl::StrCat("checkpoint directory ", directory));
  }
  struct stat st;
  if (stat(resolved, &st) != 0 || !S_ISDIR(st.st_mode)) {
    return absl::FailedPreconditionError(
        absl::StrCat(directory, " is not a directory"));
  }
  std::string dir = resolved;
  if (!options.state_dir.empty()) {
    char root[PATH_MAX];
    if (realpath(options.state_dir.c_str(), root) == nullptr) {
      return absl::FailedPreconditionError(absl::StrCat(
          "the daemon's --state_dir ", options.state_dir, " does not exist"));
    }
    const std::string r = root;
    if (dir != r && !absl::StartsWith(dir, r + "/")) {
      return absl::PermissionDeniedError(
          absl::StrCat(directory, " is outside the daemon's --state_dir ", r,
                       "; checkpoints may only be written there"));
    }
  }
  return dir;
}

namespace {

// Writes `entries` (data in `backend` memory) atomically to `path`.
absl::StatusOr<CheckpointResult> WriteCheckpoint(
    const std::string& path, const json& meta, std::vector<Entry> entries,
    Backend* backend, const CheckpointOptions& options,
    SaveProgress* progress) {
  const double t0 = Seconds();
  const std::string header = HeaderJson(meta, entries);
  OPTIMD_RETURN_IF_ERROR(CheckHeaderSize(header));
  const uint64_t data_start = 8 + header.size();
  const uint64_t total =
      data_start +
      (entries.empty() ? 0 : entries.back().offset + entries.back().bytes);
  if (progress != nullptr) progress->total_bytes.store(total);
  const std::string dir = path.substr(0, path.rfind('/'));
  // Temporaries of saves that were killed (a daemon killed mid-write) would
  // otherwise stay forever.
  RemoveStaleTemporaries(dir, path.substr(dir.size() + 1), time(nullptr));
  const std::string tmp = CheckpointTemporaryPath(path);
  // 0666: the daemon's umask decides who may read checkpoints.
  Fd fd(open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666));
  if (fd.get() < 0) {
    return ErrnoStatus(errno,
                       absl::StrCat("cannot create a checkpoint in ", dir));
  }
  auto fail = [&](absl::Status s) {
    unlink(tmp.c_str());
    return s;
  };
  Streamer streamer(backend, options.staging_bytes);
  BatchWriter writer(fd.get(), tmp);
  for (size_t i = 0; i < entries.size(); ++i) {
    Entry& e = entries[i];
    e.crc = RunStarts(entries, i) ? 0 : entries[i - 1].crc;
    absl::Status s = streamer.Save(&writer, e, data_start + e.offset, &e.crc);
    if (!s.ok()) return fail(s);
    if (progress != nullptr) progress->bytes_written.fetch_add(e.bytes);
  }
  if (absl::Status s = writer.Flush(); !s.ok()) return fail(s);
  if (absl::Status s = writer.Wait(); !s.ok()) return fail(s);
  const std::string final_header = HeaderJson(meta, entries);
  if (final_header.size() != header.size()) {
    return fail(absl::InternalError("checkpoint header changed size"));
  }
  uint8_t len[8];
  uint64_t hl = final_header.size();
  for (int i = 0; i < 8; ++i) len[i] = static_cast<uint8_t>(hl >> (8 * i));
  absl::Status s = WriteAll(fd.get(), len, 8, 0, tmp);
  if (s.ok()) s = WriteAll(fd.get(), final_header.data(), hl, 8, tmp);
  if (s.ok() && fsync(fd.get()) != 0) {
    s = ErrnoStatus(errno, absl::StrCat("syncing ", tmp));
  }
  if (!s.ok()) return fail(s);
  if (rename(tmp.c_str(), path.c_str()) != 0) {
    return fail(ErrnoStatus(errno, absl::StrCat("renaming to ", path)));
  }
  OPTIMD_RETURN_IF_ERROR(FsyncDir(dir));
  if (progress != nullptr) progress->bytes_written.store(total);
  CheckpointResult r;
  r.path = path;
  r.bytes = total;
  r.peak_staging_bytes = streamer.peak_staging();
  r.seconds = Seconds() - t0;
  return r;
}

}  // namespace

absl::StatusOr<CheckpointResult> SaveCheckpoint(
    const std::string& path, const std::vector<Group*>& groups,
    Backend* backend, const CheckpointOptions& options,
    SaveProgress* progress) {
  std::vector<Entry> entries = Entries(groups);
  const bool packed =
      UsePacked(entries, groups, options.packed_above_header_bytes);
  Arrange(entries, packed);
  return WriteCheckpoint(path, MetaJson(groups, packed, options.job_id),
                         std::move(entries), backend, options, progress);
}

struct CheckpointSnapshot::Data {
  json meta;
  std::vector<Entry> entries;
  StateStorage buffer;
  std::string prefix;  // 8-byte length + header, once checksummed
};

uint64_t CheckpointSnapshot::FileSize() {
  Data& d = *data_;
  if (d.prefix.empty()) {
    for (size_t i = 0; i < d.entries.size(); ++i) {
      Entry& e = d.entries[i];
      e.crc = Crc32cExtend(RunStarts(d.entries, i) ? 0 : d.entries[i - 1].crc,
                           e.data, e.bytes);
    }
    const std::string header = HeaderJson(d.meta, d.entries);
    const uint64_t hl = header.size();
    d.prefix.resize(8);
    for (int i = 0; i < 8; ++i) d.prefix[i] = static_cast<char>(hl >> (8 * i));
    d.prefix += header;
  }
  uint64_t data = 0;
  for (const Entry& e : d.entries) data = std::max(data, e.offset + e.bytes);
  return d.prefix.size() + data;
}

void CheckpointSnapshot::ReadFile(uint64_t offset, uint64_t n, uint8_t* out) {
  Data& d = *data_;
  FileSize();
  while (n > 0) {
    if (offset < d.prefix.size()) {
      const uint64_t k = std::min<uint64_t>(n, d.prefix.size() - offset);
      std::memcpy(out, d.prefix.data() + offset, k);
      out += k;
      offset += k;
      n -= k;
      continue;
    }
    // The data section is the snapshot buffer, in entry order.
    const uint64_t k = n;
    std::memcpy(out, d.buffer.data() + (offset - d.prefix.size()), k);
    return;
  }
}

CheckpointSnapshot::CheckpointSnapshot() : data_(new Data()) {}
CheckpointSnapshot::~CheckpointSnapshot() {
  data_.reset();
  if (on_destroy_) on_destroy_();
}

uint64_t CheckpointSnapshot::bytes() const { return data_->buffer.size(); }

absl::StatusOr<std::unique_ptr<CheckpointSnapshot>> TakeSnapshot(
    const std::vector<Group*>& groups, Backend* backend,
    const CheckpointOptions& options) {
  auto snap = std::unique_ptr<CheckpointSnapshot>(new CheckpointSnapshot());
  CheckpointSnapshot::Data& d = *snap->data_;
  d.entries = Entries(groups);
  const bool packed =
      UsePacked(d.entries, groups, options.packed_above_header_bytes);
  Arrange(d.entries, packed);
  d.meta = MetaJson(groups, packed, options.job_id);
  // Checked here, before any copy, so that a stream or a background save
  // never starts a file that could not be loaded.
  OPTIMD_RETURN_IF_ERROR(CheckHeaderSize(HeaderJson(d.meta, d.entries)));
  uint64_t total = 0;
  for (const Entry& e : d.entries) total = std::max(total, e.offset + e.bytes);
  OPTIMD_ASSIGN_OR_RETURN(
      d.buffer, backend->AllocateHostStaging(std::max<uint64_t>(total, 1)));
  for (Entry& e : d.entries) {
    if (e.bytes > 0) {
      OPTIMD_RETURN_IF_ERROR(
          backend->CopyToHost(e.data, d.buffer.data() + e.offset, e.bytes));
    }
    e.data = d.buffer.data() + e.offset;
  }
  return snap;
}

absl::StatusOr<CheckpointResult> WriteSnapshot(
    const std::string& path, const CheckpointSnapshot& snapshot,
    const CheckpointOptions& options, SaveProgress* progress) {
  return WriteCheckpoint(path, snapshot.data_->meta, snapshot.data_->entries,
                         /*backend=*/nullptr, options, progress);
}

namespace {

// What identifies a checkpoint file's bytes between the two passes of a
// load: the same object (device, inode) of the same size, not written to
// (mtime) and not otherwise changed (ctime) since it was opened.
struct FileIdentity {
  dev_t dev = 0;
  ino_t ino = 0;
  uint64_t size = 0;
  timespec mtime{};
  timespec ctime{};
};

FileIdentity IdentityOf(const struct stat& st) {
  return {st.st_dev, st.st_ino, static_cast<uint64_t>(st.st_size), st.st_mtim,
          st.st_ctim};
}

bool SameTime(const timespec& a, const timespec& b) {
  return a.tv_sec == b.tv_sec && a.tv_nsec == b.tv_nsec;
}

// ABORTED when the open file is no longer what `opened` describes: another
// process wrote to it (or truncated it) while it was being verified, so the
// verification says nothing about what the load would read.
absl::Status CheckUnchanged(int fd, const FileIdentity& opened,
                            const std::string& path) {
  struct stat st;
  if (fstat(fd, &st) != 0) return ErrnoStatus(errno, path);
  const FileIdentity now = IdentityOf(st);
  if (now.dev != opened.dev || now.ino != opened.ino ||
      now.size != opened.size || !SameTime(now.mtime, opened.mtime) ||
      !SameTime(now.ctime, opened.ctime)) {
    return absl::AbortedError(absl::StrCat(
        path, " changed while its checksums were verified (another process ",
        "is writing it); nothing was loaded: load it again once it is ",
        "complete"));
  }
  return absl::OkStatus();
}

// Opens a checkpoint for a load into *fd; returns what identifies it.
absl::StatusOr<FileIdentity> OpenForLoad(const std::string& path,
                                         const CheckpointOptions& options,
                                         Fd* fd) {
  // O_NONBLOCK: opening a FIFO placed at the path must not wait for a
  // writer (it would hold the device worker and every session on it); the
  // flag changes nothing for a regular file.
  // O_NOFOLLOW under --state_dir: the directory was resolved and confined,
  // and a symbolic link at the file's name must not lead out of it.
  const int confined = options.state_dir.empty() ? 0 : O_NOFOLLOW;
  fd->reset(open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | confined));
  if (fd->get() < 0 && errno == ELOOP && confined != 0) {
    return absl::PermissionDeniedError(absl::StrCat(
        path, " is a symbolic link; with the daemon's --state_dir a ",
        "checkpoint must be a regular file within it"));
  }
  if (fd->get() < 0) {
    return ErrnoStatus(errno, absl::StrCat("cannot open checkpoint ", path));
  }
  struct stat st;
  if (fstat(fd->get(), &st) != 0) return ErrnoStatus(errno, path);
  if (!S_ISREG(st.st_mode)) {
    return absl::FailedPreconditionError(
        absl::StrCat(path,
                     " is not a regular file (a directory, FIFO or device); a "
                     "checkpoint is a file written by SaveState"));
  }
  const FileIdentity id = IdentityOf(st);
  if (id.size < 8) {
    return absl::DataLossError(absl::StrCat(
        path, " is ", id.size, " bytes: too short for a safetensors file"));
  }
  return id;
}

// The safetensors header's JSON text (after its 8-byte length).
absl::StatusOr<std::string> ReadHeaderText(int fd, uint64_t size,
                                           const std::string& path) {
  uint8_t len[8];
  OPTIMD_RETURN_IF_ERROR(ReadAll(fd, len, 8, 0, path));
  uint64_t hl = 0;
  for (int i = 0; i < 8; ++i) hl |= uint64_t{len[i]} << (8 * i);
  if (hl > kMaxCheckpointHeaderBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, " is not a safetensors file (its header length field is past ",
        "the 100 MiB limit)"));
  }
  if (8 + hl > size) {
    return absl::DataLossError(absl::StrCat(path, " is truncated (header)"));
  }
  std::string header(hl, '\0');
  OPTIMD_RETURN_IF_ERROR(ReadAll(fd, header.data(), hl, 8, path));
  return header;
}

// A piece of an entry's bytes, read and checked at once.
struct Piece {
  size_t entry;
  uint64_t done;  // bytes of the entry before this piece
  uint64_t n;
};

// Pieces of at most `half` bytes; zero-byte entries get an empty piece:
// their file tensor's checksum is checked like any other.
std::vector<Piece> PlanPieces(const std::vector<Entry>& entries,
                              uint64_t half) {
  std::vector<Piece> pieces;
  for (size_t i = 0; i < entries.size(); ++i) {
    if (entries[i].bytes == 0) pieces.push_back({i, 0, 0});
    for (uint64_t done = 0; done < entries[i].bytes;) {
      const uint64_t n = std::min(entries[i].bytes - done, half);
      pieces.push_back({i, done, n});
      done += n;
    }
  }
  return pieces;
}

// Streams the checked file's data into the state: the next piece is read
// (on a thread of its own when large) while the current one is checksummed
// and, on the CUDA backend, copied to the device from the other half of a
// pinned staging buffer. *partially_written: the state was touched.
absl::Status StreamData(int fd, const std::vector<Entry>& entries,
                        uint64_t data_start, Backend* backend,
                        const CheckpointOptions& options,
                        const std::string& path, bool* partially_written,
                        uint64_t* peak_staging) {
  const bool direct = backend->HostAddressable();
  // Pieces: half the staging buffer, or 128 MiB reads straight into host
  // state (no staging memory then).
  const uint64_t half = direct
                            ? (uint64_t{128} << 20)
                            : std::max<uint64_t>(options.staging_bytes / 2, 1);
  StateStorage staging;
  if (!direct) {
    OPTIMD_ASSIGN_OR_RETURN(staging, backend->AllocateHostStaging(2 * half));
  }
  const std::vector<Piece> pieces = PlanPieces(entries, half);
  auto target = [&](size_t k) -> uint8_t* {
    const Piece& p = pieces[k];
    return direct ? entries[p.entry].data + p.done
                  : staging.data() + (k % 2) * half;
  };
  auto read_piece = [&](size_t k) {
    const Piece& p = pieces[k];
    return ReadAll(fd, target(k), p.n,
                   data_start + entries[p.entry].offset + p.done, path);
  };
  // A thread per read pays off for large pieces only: with many small
  // tensors (a million of them) thread starts would dominate, so small
  // pieces are read inline.
  constexpr uint64_t kAsyncReadBytes = uint64_t{1} << 20;
  auto start_read = [&](size_t k) {
    return std::async(pieces[k].n >= kAsyncReadBytes ? std::launch::async
                                                     : std::launch::deferred,
                      read_piece, k);
  };
  *partially_written = !pieces.empty();
  *peak_staging = staging.size();
  std::future<absl::Status> next;
  if (!pieces.empty()) next = start_read(0);
  // Whatever fails, the read in flight ends before its buffer goes.
  auto fail = [&](absl::Status s) {
    if (next.valid()) next.wait();
    return s;
  };
  uint32_t crc = 0;
  for (size_t k = 0; k < pieces.size(); ++k) {
    OPTIMD_RETURN_IF_ERROR(next.get());
    if (k + 1 < pieces.size()) next = start_read(k + 1);
    const Piece& p = pieces[k];
    const Entry& e = entries[p.entry];
    if (p.done == 0 && RunStarts(entries, p.entry)) crc = 0;
    absl::Status guarded = GuardMemoryFaults(
        [&] { crc = Crc32cExtend(crc, target(k), p.n); }, "checkpoint load");
    if (!guarded.ok()) return fail(guarded);
    if (!direct && p.n > 0) {
      absl::Status s = backend->CopyFromHost(target(k), e.data + p.done, p.n);
      if (!s.ok()) return fail(s);
    }
    if (p.done + p.n == e.bytes && RunEnds(entries, p.entry) && crc != e.crc) {
      return fail(absl::DataLossError(absl::StrCat(
          "checksum mismatch in tensor '", e.key, "' of ", path,
          ": the file changed after its checksums were verified (another "
          "process wrote into it). The session's state is now partly "
          "loaded; steps are refused until a load succeeds")));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<CheckpointResult> LoadCheckpoint(
    const std::string& path, const std::vector<Group*>& groups,
    Backend* backend, const CheckpointOptions& options,
    bool* partially_written) {
  *partially_written = false;
  const double t0 = Seconds();
  Fd fd(-1);
  OPTIMD_ASSIGN_OR_RETURN(const FileIdentity opened,
                          OpenForLoad(path, options, &fd));
  const uint64_t size = opened.size;
  OPTIMD_ASSIGN_OR_RETURN(const std::string header,
                          ReadHeaderText(fd.get(), size, path));
  const uint64_t data_start = 8 + header.size();
  std::vector<Entry> entries = Entries(groups);
  OPTIMD_ASSIGN_OR_RETURN(
      std::vector<GroupHeader> headers,
      ParseHeader(header, groups, entries, size - data_start, path));
  // First pass, whatever the file's size: every checksum, changing nothing
  // (a corrupt file is refused whole and the session keeps its state). It
  // reads in pieces, so memory stays bounded.
  OPTIMD_RETURN_IF_ERROR(VerifyChecksums(fd.get(), entries, data_start, path));
  if (options.after_verifying_pass) options.after_verifying_pass(path);
  OPTIMD_RETURN_IF_ERROR(CheckUnchanged(fd.get(), opened, path));
  // Second pass: stream the data in, checking the checksums again (only a
  // write into the file during this pass can fail them now).
  uint64_t peak_staging = 0;
  OPTIMD_RETURN_IF_ERROR(StreamData(fd.get(), entries, data_start, backend,
                                    options, path, partially_written,
                                    &peak_staging));
  // Step counters and learning rates (the registered hyperparameters
  // otherwise stay as they are).
  for (size_t gi = 0; gi < groups.size(); ++gi) {
    groups[gi]->hyper.lr = headers[gi].hyper.lr;
    for (size_t ti = 0; ti < groups[gi]->tensors.size(); ++ti) {
      groups[gi]->tensors[ti].missed_steps = headers[gi].missed[ti];
    }
    OPTIMD_RETURN_IF_ERROR(
        backend->SetGroupStep(*groups[gi], headers[gi].step));
  }
  *partially_written = false;
  CheckpointResult r;
  r.path = path;
  r.bytes = size;
  r.peak_staging_bytes = peak_staging;
  r.seconds = Seconds() - t0;
  return r;
}

}  // namespace optimd
