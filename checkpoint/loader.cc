#include "checkpoint/loader.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <future>

#include "absl/strings/str_cat.h"
#include "checkpoint/file_io.h"
#include "checkpoint/header.h"
#include "common/crc32c.h"
#include "common/fault_guard.h"
#include "common/status_macros.h"
#include "common/unique_fd.h"
#include "core/block8.h"
#include "core/layout.h"

namespace optimd {

using checkpoint_header::Entries;
using checkpoint_header::Entry;
using checkpoint_header::GroupHeader;
using checkpoint_header::ParseHeader;
using checkpoint_header::RunEnds;
using checkpoint_header::RunStarts;

namespace {

double Seconds() {
  return std::chrono::duration<double>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// INVALID_ARGUMENT when a piece of block8 codes (`done` bytes into entry
// e) holds a code no encoder writes (Block8CodeIsValid): a file SaveState
// did not write, refused whole.
absl::Status CheckBlock8Codes(const Entry& e, const uint8_t* codes, uint64_t n,
                              uint64_t done, const std::string& path) {
  if (e.block8_slot < 0) return absl::OkStatus();
  const bool is_signed = Block8SlotIsSigned(e.block8_slot);
  for (uint64_t i = 0; i < n; ++i) {
    if (Block8CodeIsValid(is_signed, codes[i])) continue;
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor '", e.name, "' of ", path, " holds 8-bit moment code 0x",
        absl::Hex(codes[i]), " at element ", done + i,
        ", which no encoder writes (", is_signed ? "exp_avg" : "exp_avg_sq",
        " codes have magnitudes up to 0x", is_signed ? "78" : "f8",
        "): the file was not written by SaveState; nothing was loaded"));
  }
  return absl::OkStatus();
}

// Reads every file tensor's bytes once and checks its checksum and its
// block8 codes, changing nothing, so that a corrupt file is refused before
// any state changes.
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
      OPTIMD_RETURN_IF_ERROR(CheckBlock8Codes(e, buffer.data(), n, done, path));
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
                                         UniqueFd* fd) {
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
  UniqueFd fd;
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
