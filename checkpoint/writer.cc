#include "checkpoint/writer.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <ctime>

#include "absl/strings/str_cat.h"
#include "checkpoint/file_io.h"
#include "checkpoint/temporaries.h"
#include "common/crc32c.h"
#include "common/fault_guard.h"
#include "common/status_macros.h"
#include "common/unique_fd.h"

namespace optimd {
namespace {

using checkpoint_header::CheckHeaderSize;
using checkpoint_header::Entries;
using checkpoint_header::Entry;
using checkpoint_header::HeaderJson;
using checkpoint_header::MetaJson;
using checkpoint_header::RunStarts;
using checkpoint_header::UsePacked;
using nlohmann::json;

double Seconds() {
  return std::chrono::duration<double>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

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

// FAILED_PRECONDITION when a directory holds the checkpoint's name: the
// final rename would fail only after the whole file was written.
absl::Status CheckNameIsFree(const std::string& path) {
  struct stat st;
  if (lstat(path.c_str(), &st) != 0) {
    return errno == ENOENT ? absl::OkStatus() : ErrnoStatus(errno, path);
  }
  if (S_ISDIR(st.st_mode)) {
    return absl::FailedPreconditionError(
        absl::StrCat(path,
                     " is a directory, so no checkpoint can be saved under "
                     "its name: remove it or save to another directory"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<CheckpointResult> WriteCheckpointFile(
    const std::string& path, const json& meta, std::vector<Entry> entries,
    Backend* backend, const CheckpointOptions& options,
    SaveProgress* progress) {
  const double t0 = Seconds();
  OPTIMD_RETURN_IF_ERROR(CheckNameIsFree(path));
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
  UniqueFd fd(open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666));
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

absl::StatusOr<CheckpointResult> SaveCheckpoint(
    const std::string& path, const std::vector<Group*>& groups,
    Backend* backend, const CheckpointOptions& options,
    SaveProgress* progress) {
  std::vector<Entry> entries = Entries(groups);
  const bool packed =
      UsePacked(entries, groups, options.packed_above_header_bytes);
  Arrange(entries, packed);
  return WriteCheckpointFile(path, MetaJson(groups, packed, options.job_id),
                             std::move(entries), backend, options, progress);
}

}  // namespace optimd
