#include "core/checkpoint.h"

#include <dirent.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <future>
#include <random>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/crc32c.h"
#include "common/fault_guard.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"

namespace optimd {
namespace {

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

const char* SafetensorsDType(DType d) {
  switch (d) {
    case DType::kFloat32:
      return "F32";
    case DType::kBFloat16:
      return "BF16";
    case DType::kFloat16:
      return "F16";
  }
  return "?";
}

// One piece of state (one tensor's parameter, master or moment) and where
// it lies in the file. Pieces with the same `key`, consecutive in the
// file, form one safetensors tensor: each piece alone in the per-tensor
// format (key "<name>.exp_avg"), all pieces of one kind and dtype of a
// group together in the packed format (key "g<group>.<kind>.<dtype>").
struct Entry {
  std::string name;   // "<tensor><suffix>", in messages and version 1 keys
  std::string dtype;  // safetensors dtype
  uint64_t numel = 0;
  uint64_t bytes = 0;
  uint8_t* data = nullptr;  // backend memory
  uint64_t offset = 0;      // within the data section
  // The crc32c of the file tensor's bytes up to the end of this piece: the
  // whole file tensor's at its last piece.
  uint32_t crc = 0;
  uint32_t group = 0;
  const char* kind = "";        // param, master, remainder, exp_avg, ...
  std::string key;              // the safetensors tensor the piece belongs to
  std::vector<uint64_t> shape;  // the tensor's; empty: [numel]
};

// Every piece of the groups, in tensor order, without offsets or keys.
std::vector<Entry> Entries(const std::vector<Group*>& groups) {
  std::vector<Entry> out;
  for (uint32_t gi = 0; gi < groups.size(); ++gi) {
    for (const TensorEntry& t : groups[gi]->tensors) {
      const Layout& l = t.layout;
      const uint64_t n = t.numel;
      auto add = [&](const char* kind, absl::string_view suffix,
                     const char* dtype, uint64_t bytes, uint8_t* data) {
        Entry e;
        e.name = absl::StrCat(t.name, suffix);
        e.dtype = dtype;
        e.numel = n;
        e.bytes = bytes;
        e.data = data;
        e.group = gi;
        e.kind = kind;
        e.shape = t.shape;
        out.push_back(std::move(e));
      };
      add("param", "", SafetensorsDType(l.param_dtype),
          n * DTypeSize(l.param_dtype), t.param.data);
      if (l.master == MasterKind::kFp32) {
        add("master", ".master", "F32", n * 4, t.master.data());
      } else if (l.master == MasterKind::kRemainder) {
        add("remainder", ".remainder", "I16", n * 2, t.master.data());
      }
      if (t.frozen) continue;
      const uint64_t mb = n * DTypeSize(l.moment_dtype);
      const char* md = SafetensorsDType(l.moment_dtype);
      for (int slot = 0; slot < l.state_slots; ++slot) {
        // Slot names are string literals (core/optimizer.cc), so data() is
        // a terminated string that lives as long as the program.
        const absl::string_view kind = StateSlotName(l.optimizer, slot);
        add(kind.data(), absl::StrCat(".", kind), md, mb, t.state[slot].data());
      }
    }
  }
  return out;
}

// Orders the pieces as the file holds them and sets their keys and
// offsets: tensor order with one key per piece, or (packed) grouped by
// group, kind and dtype, tensor order within each.
void Arrange(std::vector<Entry>& entries, bool packed) {
  for (Entry& e : entries) {
    e.key =
        packed ? absl::StrCat("g", e.group, ".", e.kind, ".", e.dtype) : e.name;
  }
  if (packed) {
    std::stable_sort(
        entries.begin(), entries.end(), [](const Entry& a, const Entry& b) {
          return a.group != b.group ? a.group < b.group : a.key < b.key;
        });
  }
  uint64_t offset = 0;
  for (Entry& e : entries) {
    e.offset = offset;
    offset += e.bytes;
  }
}

// True when piece `i` starts (ends) its file tensor.
bool RunStarts(const std::vector<Entry>& e, size_t i) {
  return i == 0 || e[i - 1].key != e[i].key;
}
bool RunEnds(const std::vector<Entry>& e, size_t i) {
  return i + 1 == e.size() || e[i + 1].key != e[i].key;
}

// Whether a save uses the packed format: when the per-tensor header could
// come near the header limit. The estimate errs high (a per-tensor entry
// costs its key twice, once with its crc, plus about 100 bytes; a tensor
// about 250 bytes of metadata besides its name), so a per-tensor header it
// lets through always fits.
bool UsePacked(const std::vector<Entry>& entries,
               const std::vector<Group*>& groups, uint64_t threshold) {
  uint64_t estimate = 0;
  for (const Entry& e : entries) estimate += 2 * e.name.size() + 130;
  for (const Group* g : groups) {
    for (const TensorEntry& t : g->tensors) estimate += t.name.size() + 260;
  }
  return estimate > threshold;
}

json HyperJson(const OptimizerHyper& h) {
  return json{{"optimizer", std::string(OptimizerName(h.kind))},
              {"lr", h.lr},
              {"beta1", h.beta1},
              {"beta2", h.beta2},
              {"eps", h.eps},
              {"weight_decay", h.weight_decay},
              {"adamw", h.adamw},
              {"bias_correction", h.bias_correction},
              {"maximize", h.maximize},
              {"amsgrad", h.amsgrad},
              {"momentum", h.momentum},
              {"dampening", h.dampening},
              {"nesterov", h.nesterov}};
}

json LayoutJson(const Layout& l) {
  return json{{"param_dtype", std::string(DTypeName(l.param_dtype))},
              {"grad_dtype", std::string(DTypeName(l.grad_dtype))},
              {"moment_dtype", std::string(DTypeName(l.moment_dtype))},
              {"master", std::string(MasterKindName(l.master))},
              {"optimizer", std::string(OptimizerName(l.optimizer))},
              {"state_slots", l.state_slots},
              {"amsgrad", l.amsgrad}};
}

std::string CrcHex(uint32_t crc) {
  char buf[9];
  std::snprintf(buf, sizeof(buf), "%08x", crc);
  return buf;
}

// One tensor's metadata in the packed format: [name, numel, index into
// "layouts", flags (1: frozen, 2: keep_fp32)], and its shape as a fifth
// element when it has more than one dimension.
json PackedTensorJson(const TensorEntry& t, json& layouts) {
  const json layout = LayoutJson(t.layout);
  size_t index = 0;
  while (index < layouts.size() && layouts[index] != layout) ++index;
  if (index == layouts.size()) layouts.push_back(layout);
  json out = json::array(
      {t.name, t.numel, index, (t.frozen ? 1 : 0) | (t.keep_fp32 ? 2 : 0)});
  if (t.shape.size() > 1) out.push_back(t.shape);
  return out;
}

// A packed tensor's optional shape: at most 64 non-negative integers whose
// product is `numel`.
bool IsShapeOf(const json& shape, uint64_t numel) {
  if (!shape.is_array() || shape.size() > 64) return false;
  uint64_t product = 1;
  for (const json& d : shape) {
    if (!d.is_number_unsigned() ||
        __builtin_mul_overflow(product, d.get<uint64_t>(), &product)) {
      return false;
    }
  }
  return product == numel;
}

// The checkpoint's metadata, without the crc32c values: version 1 (a
// tensor's metadata as an object) or, packed, version 2 (as an array, its
// layout an index into one table).
json MetaJson(const std::vector<Group*>& groups, bool packed,
              const std::string& job_id) {
  json meta;
  meta["format_version"] = packed ? 2 : 1;
  meta["job_id"] = job_id;
  json layouts = json::array();
  json jgroups = json::array();
  for (const Group* g : groups) {
    json jg;
    jg["id"] = g->id;
    jg["step"] = g->step;
    jg["hyperparameters"] = HyperJson(g->hyper);
    json jt = json::array();
    for (const TensorEntry& t : g->tensors) {
      if (packed) {
        jt.push_back(PackedTensorJson(t, layouts));
        continue;
      }
      jt.push_back(json{{"name", t.name},
                        {"numel", t.numel},
                        {"frozen", t.frozen},
                        {"keep_fp32", t.keep_fp32},
                        {"layout", LayoutJson(t.layout)}});
    }
    jg["tensors"] = jt;
    // Tensors that missed steps without a gradient: [index, missed] pairs,
    // only where nonzero (most groups have none).
    json missed = json::array();
    for (size_t i = 0; i < g->tensors.size(); ++i) {
      if (g->tensors[i].missed_steps > 0) {
        missed.push_back(json::array({i, g->tensors[i].missed_steps}));
      }
    }
    if (!missed.empty()) jg["missed_steps"] = missed;
    jgroups.push_back(jg);
  }
  meta["groups"] = jgroups;
  if (packed) meta["layouts"] = layouts;
  return meta;
}

// The full header JSON (crc values are fixed-width, so the length does not
// depend on them): one safetensors tensor per run of pieces with one key.
std::string HeaderJson(json meta, const std::vector<Entry>& entries) {
  json crcs = json::object();
  json tensors = json::object();
  uint64_t begin = 0, numel = 0;
  for (size_t i = 0; i < entries.size(); ++i) {
    const Entry& e = entries[i];
    if (RunStarts(entries, i)) {
      begin = e.offset;
      numel = 0;
    }
    numel += e.numel;
    if (!RunEnds(entries, i)) continue;
    crcs[e.key] = CrcHex(e.crc);
    // A piece alone in its file tensor (the per-tensor format) has its
    // tensor's shape; a packed run is 1-D.
    const bool alone = RunStarts(entries, i) && !e.shape.empty();
    tensors[e.key] =
        json{{"dtype", e.dtype},
             {"shape", alone ? json(e.shape) : json::array({numel})},
             {"data_offsets", json::array({begin, e.offset + e.bytes})}};
  }
  meta["crc32c"] = std::move(crcs);
  // The metadata's own checksum: a damaged step counter or learning rate
  // would otherwise load silently (the data checksums do not cover it).
  const std::string meta_text = meta.dump();
  tensors["__metadata__"] =
      json{{"optimd", meta_text},
           {"optimd_crc32c",
            CrcHex(Crc32cExtend(0, meta_text.data(), meta_text.size()))}};
  std::string s = tensors.dump();
  // Pad so that the data section starts 8-byte aligned.
  while ((8 + s.size()) % 8 != 0) s.push_back(' ');
  return s;
}

// A header past the limit would make a file that LoadState (and the
// safetensors library) refuses: refused before anything is written.
absl::Status CheckHeaderSize(const std::string& header) {
  if (header.size() <= kMaxCheckpointHeaderBytes) return absl::OkStatus();
  return absl::ResourceExhaustedError(
      absl::StrCat("the checkpoint header would be ", header.size(),
                   " bytes, more than the ", kMaxCheckpointHeaderBytes,
                   " safetensors readers accept; nothing was written and the "
                   "previous checkpoint is intact. Use shorter tensor names "
                   "or fewer tensors per session"));
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

// ---- Reading an untrusted header ----
// A checkpoint can come from anywhere (a file, a client's stream): every
// header field is checked for presence, type and range before it is used,
// and every problem is a Status naming the field, never an exception.

// Deeper nesting is refused before parsing, so that no recursive walk over
// a parsed value (comparison, printing, destruction) can exhaust the stack.
constexpr int kMaxJsonDepth = 16;

absl::Status Malformed(const std::string& path, const std::string& what) {
  return absl::InvalidArgumentError(
      absl::StrCat(path, " has a malformed optimd header: ", what,
                   "; the file is damaged or was not written by optimd"));
}

absl::Status CheckJsonDepth(absl::string_view text, const std::string& path) {
  int depth = 0;
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') {
        ++i;
      } else if (c == '"') {
        in_string = false;
      }
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > kMaxJsonDepth) {
        return Malformed(path, absl::StrCat("JSON nested deeper than ",
                                            kMaxJsonDepth, " levels"));
      }
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return absl::OkStatus();
}

// Parses untrusted JSON text without throwing.
absl::StatusOr<json> ParseJson(absl::string_view text, const std::string& path,
                               const std::string& what) {
  OPTIMD_RETURN_IF_ERROR(CheckJsonDepth(text, path));
  json j = json::parse(text.begin(), text.end(), nullptr,
                       /*allow_exceptions=*/false);
  if (j.is_discarded()) return Malformed(path, what + " is not valid JSON");
  return j;
}

// Typed access to the members of one JSON object of a header.
class Fields {
 public:
  // INVALID_ARGUMENT unless `j` is an object.
  static absl::StatusOr<Fields> Of(const json& j, std::string where,
                                   const std::string& path) {
    if (!j.is_object()) return Malformed(path, where + " is not an object");
    return Fields(j, std::move(where), path);
  }

  const std::string& where() const { return where_; }

  absl::StatusOr<const json*> Get(const char* key) const {
    auto it = obj_.find(key);
    if (it == obj_.end()) return Bad(key, "missing");
    return &*it;
  }
  absl::StatusOr<uint64_t> Uint(const char* key) const {
    OPTIMD_ASSIGN_OR_RETURN(const json* v, Get(key));
    if (v->is_number_unsigned()) return v->get<uint64_t>();
    if (v->is_number_integer() && v->get<int64_t>() >= 0) {
      return static_cast<uint64_t>(v->get<int64_t>());
    }
    return Bad(key, "not a non-negative integer");
  }
  absl::StatusOr<double> Number(const char* key) const {
    OPTIMD_ASSIGN_OR_RETURN(const json* v, Get(key));
    if (!v->is_number()) return Bad(key, "not a number");
    return v->get<double>();
  }
  absl::StatusOr<bool> Bool(const char* key) const {
    OPTIMD_ASSIGN_OR_RETURN(const json* v, Get(key));
    if (!v->is_boolean()) return Bad(key, "not true or false");
    return v->get<bool>();
  }
  absl::StatusOr<std::string> String(const char* key) const {
    OPTIMD_ASSIGN_OR_RETURN(const json* v, Get(key));
    if (!v->is_string()) return Bad(key, "not a string");
    return v->get<std::string>();
  }
  absl::StatusOr<const json*> Array(const char* key) const {
    OPTIMD_ASSIGN_OR_RETURN(const json* v, Get(key));
    if (!v->is_array()) return Bad(key, "not an array");
    return v;
  }
  // An array of exactly `n` non-negative integers.
  absl::StatusOr<std::vector<uint64_t>> Uints(const char* key, size_t n) const {
    OPTIMD_ASSIGN_OR_RETURN(const json* v, Array(key));
    std::vector<uint64_t> out;
    for (const json& x : *v) {
      if (!x.is_number_unsigned()) break;
      out.push_back(x.get<uint64_t>());
    }
    if (out.size() != n || v->size() != n) {
      return Bad(key, absl::StrCat("not ", n, " non-negative integers"));
    }
    return out;
  }
  // The product of a shape: an array of at most 64 non-negative integers
  // (a tensor's shape; its product must not overflow).
  absl::StatusOr<uint64_t> ShapeNumel(const char* key) const {
    OPTIMD_ASSIGN_OR_RETURN(const json* v, Array(key));
    uint64_t product = 1;
    bool bad = v->size() > 64;
    for (const json& d : *v) {
      bad = bad || !d.is_number_unsigned() ||
            __builtin_mul_overflow(product, d.get<uint64_t>(), &product);
    }
    if (bad) return Bad(key, "not a shape (at most 64 dimensions)");
    return product;
  }
  absl::Status Bad(const char* key, const std::string& problem) const {
    return Malformed(path_,
                     absl::StrCat(where_, " field '", key, "' is ", problem));
  }

 private:
  Fields(const json& obj, std::string where, const std::string& path)
      : obj_(obj), where_(std::move(where)), path_(path) {}
  const json& obj_;
  std::string where_;
  std::string path_;
};

// A crc32c written as 8 lowercase hex digits.
absl::StatusOr<uint32_t> ParseCrcHex(const std::string& s) {
  uint32_t v = 0;
  for (char c : s) {
    int d = c >= '0' && c <= '9'   ? c - '0'
            : c >= 'a' && c <= 'f' ? c - 'a' + 10
                                   : -1;
    if (d < 0) return absl::InvalidArgumentError("not hex");
    v = v << 4 | static_cast<uint32_t>(d);
  }
  if (s.size() != 8) return absl::InvalidArgumentError("not 8 digits");
  return v;
}

// A group's step counter and hyperparameters as its header says, checked.
struct GroupHeader {
  uint64_t step = 0;
  OptimizerHyper hyper;
  // Per tensor of the group, its missed steps (TensorEntry::missed_steps).
  std::vector<uint64_t> missed;
};

// The optional "missed_steps" of a group: [tensor index, missed] pairs, each
// index once and below `tensors`, each count at most the group's step.
absl::StatusOr<std::vector<uint64_t>> ParseMissedSteps(const json& jg,
                                                       const Fields& f,
                                                       uint64_t step,
                                                       size_t tensors) {
  std::vector<uint64_t> missed(tensors, 0);
  if (!jg.contains("missed_steps")) return missed;
  OPTIMD_ASSIGN_OR_RETURN(const json* pairs, f.Array("missed_steps"));
  for (const json& p : *pairs) {
    if (!p.is_array() || p.size() != 2 || !p[0].is_number_unsigned() ||
        !p[1].is_number_unsigned() || p[0].get<uint64_t>() >= tensors ||
        p[1].get<uint64_t>() == 0 || p[1].get<uint64_t>() > step ||
        missed[p[0].get<size_t>()] != 0) {
      return f.Bad(
          "missed_steps",
          absl::StrCat("not a list of distinct [tensor index < ", tensors,
                       ", 1 <= missed <= step ", step, "] pairs"));
    }
    missed[p[0].get<size_t>()] = p[1].get<uint64_t>();
  }
  return missed;
}

absl::StatusOr<OptimizerHyper> ParseHyper(const Fields& g,
                                          const std::string& path) {
  OPTIMD_ASSIGN_OR_RETURN(const json* jh, g.Get("hyperparameters"));
  OPTIMD_ASSIGN_OR_RETURN(
      Fields h, Fields::Of(*jh, g.where() + " hyperparameters", path));
  OptimizerHyper out;
  OPTIMD_ASSIGN_OR_RETURN(out.lr, h.Number("lr"));
  OPTIMD_ASSIGN_OR_RETURN(out.beta1, h.Number("beta1"));
  OPTIMD_ASSIGN_OR_RETURN(out.beta2, h.Number("beta2"));
  OPTIMD_ASSIGN_OR_RETURN(out.eps, h.Number("eps"));
  OPTIMD_ASSIGN_OR_RETURN(out.weight_decay, h.Number("weight_decay"));
  OPTIMD_ASSIGN_OR_RETURN(out.adamw, h.Bool("adamw"));
  OPTIMD_ASSIGN_OR_RETURN(out.bias_correction, h.Bool("bias_correction"));
  OPTIMD_ASSIGN_OR_RETURN(out.maximize, h.Bool("maximize"));
  OPTIMD_ASSIGN_OR_RETURN(out.amsgrad, h.Bool("amsgrad"));
  // Files written before optimizers other than AdamW have none of these.
  if (jh->contains("optimizer")) {
    OPTIMD_ASSIGN_OR_RETURN(std::string name, h.String("optimizer"));
    auto kind = OptimizerFromName(name);
    if (!kind.ok()) return h.Bad("optimizer", "not a known optimizer");
    out.kind = *kind;
    OPTIMD_ASSIGN_OR_RETURN(out.momentum, h.Number("momentum"));
    OPTIMD_ASSIGN_OR_RETURN(out.dampening, h.Number("dampening"));
    OPTIMD_ASSIGN_OR_RETURN(out.nesterov, h.Bool("nesterov"));
  }
  absl::Status s = CheckHyperparameters(out, g.where());
  if (!s.ok()) return Malformed(path, std::string(s.message()));
  return out;
}

// Whether a header's layout is `l`. Files written before optimizers other
// than AdamW name neither the optimizer nor the slot count: such a layout
// is an AdamW one.
bool LayoutMatches(const json& file, const Layout& l) {
  json mine = LayoutJson(l);
  if (file.is_object() && !file.contains("optimizer") &&
      l.optimizer == OptimizerKind::kAdamW) {
    mine.erase("optimizer");
    mine.erase("state_slots");
  }
  return file == mine;
}

// One tensor's metadata as a header gives it.
struct TensorHeader {
  std::string name;
  uint64_t numel = 0;
  bool frozen = false;
  const json* layout = nullptr;
};

// Version 1: {"name", "numel", "frozen", "keep_fp32", "layout"}.
absl::StatusOr<TensorHeader> ParseTensor(const json& j,
                                         const std::string& where,
                                         const std::string& path) {
  OPTIMD_ASSIGN_OR_RETURN(Fields f, Fields::Of(j, where, path));
  TensorHeader t;
  OPTIMD_ASSIGN_OR_RETURN(t.name, f.String("name"));
  OPTIMD_ASSIGN_OR_RETURN(t.numel, f.Uint("numel"));
  OPTIMD_ASSIGN_OR_RETURN(t.frozen, f.Bool("frozen"));
  OPTIMD_ASSIGN_OR_RETURN(t.layout, f.Get("layout"));
  return t;
}

// Version 2 (packed): [name, numel, layout index, flags(, shape)].
absl::StatusOr<TensorHeader> ParsePackedTensor(const json& j,
                                               const json& layouts,
                                               const std::string& where,
                                               const std::string& path) {
  if (!j.is_array() || (j.size() != 4 && j.size() != 5) || !j[0].is_string() ||
      !j[1].is_number_unsigned() || !j[2].is_number_unsigned() ||
      !j[3].is_number_unsigned() || j[2].get<uint64_t>() >= layouts.size() ||
      j[3].get<uint64_t>() > 3 ||
      (j.size() == 5 && !IsShapeOf(j[4], j[1].get<uint64_t>()))) {
    return Malformed(path, where + " is not [name, numel, layout index < " +
                               std::to_string(layouts.size()) +
                               ", flags(, shape holding numel)]");
  }
  TensorHeader t;
  t.name = j[0].get<std::string>();
  t.numel = j[1].get<uint64_t>();
  t.frozen = (j[3].get<uint64_t>() & 1) != 0;
  t.layout = &layouts[j[2].get<size_t>()];
  return t;
}

// Checks one group of the header against the registered group `g`.
// `layouts`: the packed format's layout table; null for version 1.
absl::StatusOr<GroupHeader> ParseGroup(const json& jg, const Group& g,
                                       size_t index, const json* layouts,
                                       const std::string& path) {
  OPTIMD_ASSIGN_OR_RETURN(Fields f,
                          Fields::Of(jg, absl::StrCat("group ", index), path));
  OPTIMD_ASSIGN_OR_RETURN(std::string id, f.String("id"));
  if (id != g.id) {
    return absl::FailedPreconditionError(
        absl::StrCat("group ", index, " is '", id.substr(0, kMaxNameBytes),
                     "' in ", path, " but '", g.id, "' in the session"));
  }
  GroupHeader out;
  OPTIMD_ASSIGN_OR_RETURN(out.step, f.Uint("step"));
  if (out.step > kMaxStepCounter) {
    return f.Bad(
        "step", absl::StrCat(out.step, ", past the largest ", kMaxStepCounter));
  }
  OPTIMD_ASSIGN_OR_RETURN(out.hyper, ParseHyper(f, path));
  OPTIMD_ASSIGN_OR_RETURN(const json* jt, f.Array("tensors"));
  if (jt->size() != g.tensors.size()) {
    return absl::FailedPreconditionError(
        absl::StrCat("group '", g.id, "' has ", jt->size(), " tensors in ",
                     path, " but ", g.tensors.size(), " registered"));
  }
  OPTIMD_ASSIGN_OR_RETURN(out.missed,
                          ParseMissedSteps(jg, f, out.step, g.tensors.size()));
  for (size_t ti = 0; ti < g.tensors.size(); ++ti) {
    const TensorEntry& t = g.tensors[ti];
    const std::string where =
        absl::StrCat("tensor ", ti, " of group '", g.id, "'");
    OPTIMD_ASSIGN_OR_RETURN(
        TensorHeader th,
        layouts == nullptr
            ? ParseTensor((*jt)[ti], where, path)
            : ParsePackedTensor((*jt)[ti], *layouts, where, path));
    if (th.name != t.name || th.numel != t.numel || th.frozen != t.frozen ||
        !LayoutMatches(*th.layout, t.layout)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "tensor '", t.name, "' (group '", g.id, "') does not match ", path,
          ": the file has '", th.name.substr(0, kMaxNameBytes), "' with ",
          th.numel, " elements, layout ", th.layout->dump(), "; registered: ",
          t.numel, " elements, layout ", LayoutJson(t.layout).dump()));
    }
  }
  return out;
}

// Checks the safetensors tensor of the run of pieces [first, end) (one
// key) and sets the pieces' offsets and the run's crc (on its last piece).
absl::Status ParseRun(const json& h, const json& crcs,
                      std::vector<Entry>& entries, size_t first, size_t end,
                      uint64_t data_bytes, const std::string& path) {
  const std::string& key = entries[first].key;
  uint64_t numel = 0, bytes = 0;
  for (size_t i = first; i < end; ++i) {
    numel += entries[i].numel;
    bytes += entries[i].bytes;
  }
  auto it = h.find(key);
  if (it == h.end()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, " has no tensor '", key, "'"));
  }
  OPTIMD_ASSIGN_OR_RETURN(
      Fields f, Fields::Of(*it, absl::StrCat("tensor '", key, "'"), path));
  OPTIMD_ASSIGN_OR_RETURN(std::string dtype, f.String("dtype"));
  OPTIMD_ASSIGN_OR_RETURN(uint64_t shape_numel, f.ShapeNumel("shape"));
  OPTIMD_ASSIGN_OR_RETURN(std::vector<uint64_t> offsets,
                          f.Uints("data_offsets", 2));
  if (dtype != entries[first].dtype || shape_numel != numel ||
      offsets[1] < offsets[0] || offsets[1] - offsets[0] != bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor '", key, "' in ", path, " is ", it->dump(), "; expected dtype ",
        entries[first].dtype, " shape [", numel, "] (", bytes, " bytes)"));
  }
  if (offsets[1] > data_bytes) {
    return absl::DataLossError(absl::StrCat(path, " is truncated: tensor '",
                                            key, "' ends at data byte ",
                                            offsets[1], " of ", data_bytes));
  }
  uint64_t offset = offsets[0];
  for (size_t i = first; i < end; ++i) {
    entries[i].offset = offset;
    entries[i].crc = 0;
    offset += entries[i].bytes;
  }
  auto c = crcs.find(key);
  if (c == crcs.end() || !c->is_string()) {
    return Malformed(path,
                     absl::StrCat("no crc32c string for tensor '", key, "'"));
  }
  auto crc = ParseCrcHex(c->get<std::string>());
  if (!crc.ok()) {
    return Malformed(path, absl::StrCat("the crc32c of tensor '", key, "' is ",
                                        crc.status().message()));
  }
  entries[end - 1].crc = *crc;
  return absl::OkStatus();
}

// Parses and checks a whole header against the registered groups, setting
// the entries' offsets and checksums. Changes no state.
absl::StatusOr<std::vector<GroupHeader>> ParseHeader(
    const std::string& header, const std::vector<Group*>& groups,
    std::vector<Entry>& entries, uint64_t data_bytes, const std::string& path) {
  OPTIMD_ASSIGN_OR_RETURN(json h, ParseJson(header, path, "the header"));
  auto not_ours = [&](const std::string& why) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, " is not an optimd checkpoint (", why, ")"));
  };
  if (!h.is_object()) return not_ours("the header is not a JSON object");
  auto md = h.find("__metadata__");
  if (md == h.end() || !md->is_object()) return not_ours("no __metadata__");
  auto text = md->find("optimd");
  if (text == md->end() || !text->is_string()) {
    return not_ours("no __metadata__.optimd string");
  }
  const std::string& meta_text = text->get_ref<const std::string&>();
  OPTIMD_ASSIGN_OR_RETURN(json meta, ParseJson(meta_text, path, "metadata"));
  OPTIMD_ASSIGN_OR_RETURN(Fields m, Fields::Of(meta, "the metadata", path));
  OPTIMD_ASSIGN_OR_RETURN(uint64_t version, m.Uint("format_version"));
  if (version > kCheckpointFormatVersion || version == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, " has checkpoint format version ", version,
        "; this daemon reads versions 1 to ", kCheckpointFormatVersion,
        " (written by a newer optimd?)"));
  }
  // The version first: a newer format may checksum differently.
  if (auto mc = md->find("optimd_crc32c"); mc != md->end()) {
    auto want = mc->is_string() ? ParseCrcHex(mc->get<std::string>())
                                : absl::InvalidArgumentError("not a string");
    if (!want.ok() ||
        *want !=
            Crc32cExtend(0, reinterpret_cast<const uint8_t*>(meta_text.data()),
                         meta_text.size())) {
      return absl::DataLossError(
          absl::StrCat("the metadata of ", path,
                       " does not match its crc32c: the header is corrupt"));
    }
  }
  OPTIMD_ASSIGN_OR_RETURN(const json* jgroups, m.Array("groups"));
  if (jgroups->size() != groups.size()) {
    return absl::FailedPreconditionError(absl::StrCat(
        path, " holds ", jgroups->size(), " groups; the session has ",
        groups.size(), " registered"));
  }
  const bool packed = version == 2;
  const json* layouts = nullptr;
  if (packed) {
    OPTIMD_ASSIGN_OR_RETURN(layouts, m.Array("layouts"));
  }
  std::vector<GroupHeader> out;
  for (size_t gi = 0; gi < groups.size(); ++gi) {
    OPTIMD_ASSIGN_OR_RETURN(
        GroupHeader g,
        ParseGroup((*jgroups)[gi], *groups[gi], gi, layouts, path));
    out.push_back(g);
  }
  OPTIMD_ASSIGN_OR_RETURN(const json* crcs, m.Get("crc32c"));
  if (!crcs->is_object()) return m.Bad("crc32c", "not an object");
  Arrange(entries, packed);
  for (size_t first = 0; first < entries.size();) {
    size_t end = first + 1;
    while (!RunEnds(entries, end - 1)) ++end;
    OPTIMD_RETURN_IF_ERROR(
        ParseRun(h, *crcs, entries, first, end, data_bytes, path));
    first = end;
  }
  return out;
}

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

// The pid in the name of a temporary file of ours, "<final>.tmp-<pid>-<n>",
// or -1 when `name` is not one for `final_name`.
long TemporaryOwner(const std::string& name, const std::string& final_name) {
  const std::string prefix = final_name + ".tmp-";
  if (!absl::StartsWith(name, prefix)) return -1;
  const std::string rest = name.substr(prefix.size());
  const size_t dash = rest.find('-');
  if (dash == 0 || dash == std::string::npos || dash > 9 ||
      dash + 1 == rest.size()) {
    return -1;
  }
  for (size_t i = 0; i < rest.size(); ++i) {
    if (i != dash && (rest[i] < '0' || rest[i] > '9')) return -1;
  }
  return std::stol(rest.substr(0, dash));
}

}  // namespace

int RemoveStaleTemporaries(const std::string& dir,
                           const std::string& final_name, time_t before) {
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) return 0;
  int removed = 0;
  while (const dirent* e = readdir(d)) {
    const long pid = TemporaryOwner(e->d_name, final_name);
    if (pid <= 0) continue;
    // Another live process's save (a pid of ours is never mid-save on
    // this name: a session saves one file at a time).
    if (pid != getpid() &&
        (kill(static_cast<pid_t>(pid), 0) == 0 || errno == EPERM)) {
      continue;
    }
    struct stat st;
    if (fstatat(dirfd(d), e->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0 ||
        !S_ISREG(st.st_mode) || st.st_mtime >= before) {
      continue;
    }
    if (unlinkat(dirfd(d), e->d_name, 0) == 0) ++removed;
  }
  closedir(d);
  return removed;
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
  const std::string tmp =
      absl::StrCat(path, ".tmp-", getpid(), "-", std::random_device{}());
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
    Backend* backend, const CheckpointOptions& options) {
  std::vector<Entry> entries = Entries(groups);
  const bool packed =
      UsePacked(entries, groups, options.packed_above_header_bytes);
  Arrange(entries, packed);
  return WriteCheckpoint(path, MetaJson(groups, packed, options.job_id),
                         std::move(entries), backend, options, nullptr);
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

// Opens a checkpoint for a load into *fd; returns its size.
absl::StatusOr<uint64_t> OpenForLoad(const std::string& path,
                                     const CheckpointOptions& options, Fd* fd) {
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
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size < 8) {
    return absl::DataLossError(absl::StrCat(
        path, " is ", size, " bytes: too short for a safetensors file"));
  }
  return size;
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
          ": the file is corrupt. The session's state is now partly "
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
  OPTIMD_ASSIGN_OR_RETURN(const uint64_t size, OpenForLoad(path, options, &fd));
  OPTIMD_ASSIGN_OR_RETURN(const std::string header,
                          ReadHeaderText(fd.get(), size, path));
  const uint64_t data_start = 8 + header.size();
  std::vector<Entry> entries = Entries(groups);
  OPTIMD_ASSIGN_OR_RETURN(
      std::vector<GroupHeader> headers,
      ParseHeader(header, groups, entries, size - data_start, path));
  if (size <= options.verify_first_max_bytes) {
    OPTIMD_RETURN_IF_ERROR(
        VerifyChecksums(fd.get(), entries, data_start, path));
  }
  // Everything matches: stream the data in.
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
