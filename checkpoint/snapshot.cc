#include "checkpoint/snapshot.h"

#include <algorithm>
#include <cstring>

#include "checkpoint/header.h"
#include "checkpoint/writer.h"
#include "common/crc32c.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"

namespace optimd {

using checkpoint_header::Arrange;
using checkpoint_header::CheckHeaderSize;
using checkpoint_header::Entries;
using checkpoint_header::Entry;
using checkpoint_header::HeaderJson;
using checkpoint_header::MetaJson;
using checkpoint_header::RunStarts;
using checkpoint_header::UsePacked;
using nlohmann::json;

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
  reservation_.reset();
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
  return WriteCheckpointFile(path, snapshot.data_->meta,
                             snapshot.data_->entries,
                             /*backend=*/nullptr, options, progress);
}

}  // namespace optimd
