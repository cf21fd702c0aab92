#include "server/request_scan.h"

#include <google/protobuf/dynamic_message.h>
#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/message.h>
#include <google/protobuf/wire_format_lite.h>
#include <grpcpp/support/proto_buffer_reader.h>

#include <cstdint>
#include <map>
#include <string>

#include "absl/strings/str_cat.h"
#include "core/group.h"
#include "core/session_checks.h"

namespace optimd {

namespace {

using google::protobuf::Descriptor;
using google::protobuf::FieldDescriptor;
using google::protobuf::internal::WireFormatLite;
using google::protobuf::io::CodedInputStream;

// State buffers one tensor may have in a SetState (exp_avg, exp_avg_sq,
// max_exp_avg_sq, momentum_buffer, master and the layouts' own), with room.
constexpr uint64_t kMaxStateKindsPerTensor = 8;

// The cost model of a parsed message (protobuf 3.21, an arena or the heap),
// rounded up: a std::string object, its heap buffer beyond the inline 15
// bytes plus the allocator's header, and the arena's cleanup entry.
constexpr uint64_t kStringObjectBytes = 32 + 16;
constexpr uint64_t kHeapHeaderBytes = 16;
// A repeated field's slot for one entry (pointer or scalar), doubled for
// the growth of its array.
constexpr uint64_t kRepeatedSlotBytes = 16;
// An unknown field: its UnknownField record (doubled for growth) and, for
// a length-delimited one, the string protobuf allocates for it.
constexpr uint64_t kUnknownFieldBytes = 32;
// A request converts into core structs (GroupSpec, BufferUpdate, ...)
// with a copy of its strings and bytes, and objects of several times the
// parsed objects' size (padded records, maps of names, vectors of their
// own): the converted objects are counted as this many times the parsed
// ones, which bounds what the daemon measures (bench/RESULTS.md).
constexpr uint64_t kConvertedPerObjectByte = 3;

// sizeof the generated message of `type`, as protobuf reports it.
uint64_t MessageObjectBytes(const Descriptor& type) {
  const google::protobuf::Message* prototype =
      google::protobuf::MessageFactory::generated_factory()->GetPrototype(
          &type);
  return (prototype == nullptr ? 256 : prototype->SpaceUsedLong()) +
         kHeapHeaderBytes;
}

struct ScanTotals {
  // Objects (messages, string objects, repeated slots, unknown field
  // records) and payload (the bytes of strings and bytes fields).
  uint64_t object_bytes = 0;
  uint64_t payload_bytes = 0;
  uint64_t unknown_fields = 0;
  std::map<const FieldDescriptor*, uint64_t> entries;
};

class Scanner {
 public:
  // `in` reads the `size` bytes of a message.
  Scanner(CodedInputStream* in, uint64_t size) : in_(in), size_(size) {}

  // Scans fields of `type` until the current limit (or the end). False
  // when the bytes are malformed.
  bool Message(const Descriptor& type);
  const ScanTotals& totals() const { return totals_; }
  // The first string field found not UTF-8, or null.
  const FieldDescriptor* bad_utf8() const { return bad_utf8_; }

 private:
  bool Field(const Descriptor& type, uint32_t tag);
  bool ReadTag(uint32_t* tag);
  bool ReadLength(uint32_t* length);
  bool SkipValue(uint32_t tag);
  bool LengthDelimited(const FieldDescriptor& field);
  bool Packed(const FieldDescriptor& field, uint32_t length);
  bool Unknown(uint32_t tag);
  void Count(const FieldDescriptor& field, uint64_t n) {
    totals_.entries[&field] += n;
  }
  void AddString(uint64_t length) {
    totals_.object_bytes +=
        kStringObjectBytes + (length > 15 ? kHeapHeaderBytes : 0);
    totals_.payload_bytes += length > 15 ? length + 1 : 0;
  }

  CodedInputStream* const in_;
  const uint64_t size_;
  ScanTotals totals_;
  const FieldDescriptor* bad_utf8_ = nullptr;
};

bool Scanner::Message(const Descriptor& type) {
  while (true) {
    // The end of this message's limit, or of the bytes.
    const int left = in_->BytesUntilLimit();
    if (left == 0 ||
        (left < 0 && static_cast<uint64_t>(in_->CurrentPosition()) == size_)) {
      return true;
    }
    uint32_t tag;
    if (!ReadTag(&tag) || !Field(type, tag)) return false;
  }
}

// A tag as protobuf's parser reads one: at most 5 bytes, its low 32 bits
// (CodedInputStream::ReadTag would take longer ones), with a field number
// other than 0 (refused at any depth, inside unknown groups too).
bool Scanner::ReadTag(uint32_t* tag) {
  const int start = in_->CurrentPosition();
  uint64_t varint;
  if (!in_->ReadVarint64(&varint) || in_->CurrentPosition() - start > 5) {
    return false;
  }
  *tag = static_cast<uint32_t>(varint);
  return WireFormatLite::GetTagFieldNumber(*tag) != 0;
}

// A length as protobuf's parser reads one: at most 5 bytes and below 2^31
// (CodedInputStream::ReadVarint32 would take longer ones and keep their
// low 32 bits, so a length of 2^32 would read as 0).
bool Scanner::ReadLength(uint32_t* length) {
  const int start = in_->CurrentPosition();
  uint64_t varint;
  if (!in_->ReadVarint64(&varint) || in_->CurrentPosition() - start > 5 ||
      varint > static_cast<uint64_t>(INT32_MAX)) {
    return false;
  }
  *length = static_cast<uint32_t>(varint);
  return true;
}

// Skips the value of a field of `tag` as protobuf's parser reads it:
// lengths by ReadLength, tags by ReadTag, a group's fields up to its own
// end tag within the recursion limit that messages count against too.
bool Scanner::SkipValue(uint32_t tag) {
  uint64_t u64;
  uint32_t u32;
  switch (WireFormatLite::GetTagWireType(tag)) {
    case WireFormatLite::WIRETYPE_VARINT:
      return in_->ReadVarint64(&u64);
    case WireFormatLite::WIRETYPE_FIXED64:
      return in_->ReadLittleEndian64(&u64);
    case WireFormatLite::WIRETYPE_FIXED32:
      return in_->ReadLittleEndian32(&u32);
    case WireFormatLite::WIRETYPE_LENGTH_DELIMITED:
      return ReadLength(&u32) && in_->Skip(static_cast<int>(u32));
    case WireFormatLite::WIRETYPE_START_GROUP: {
      if (!in_->IncrementRecursionDepth()) return false;
      bool ok = true;
      while (ok) {
        uint32_t inner;
        ok = ReadTag(&inner);
        if (ok && WireFormatLite::GetTagWireType(inner) ==
                      WireFormatLite::WIRETYPE_END_GROUP) {
          ok = WireFormatLite::GetTagFieldNumber(inner) ==
               WireFormatLite::GetTagFieldNumber(tag);
          break;
        }
        ok = ok && SkipValue(inner);
      }
      in_->DecrementRecursionDepth();
      return ok;
    }
    default:  // an end tag without its group, or no wire type at all
      return false;
  }
}

// The wire type protobuf expects of `field` when not packed.
WireFormatLite::WireType ExpectedWireType(const FieldDescriptor& field) {
  return WireFormatLite::WireTypeForFieldType(
      static_cast<WireFormatLite::FieldType>(field.type()));
}

bool Scanner::Field(const Descriptor& type, uint32_t tag) {
  const int number = WireFormatLite::GetTagFieldNumber(tag);
  const auto wire = WireFormatLite::GetTagWireType(tag);
  const FieldDescriptor* field = type.FindFieldByNumber(number);
  if (field == nullptr) return Unknown(tag);
  if (wire == WireFormatLite::WIRETYPE_LENGTH_DELIMITED) {
    if (ExpectedWireType(*field) == wire) return LengthDelimited(*field);
    if (field->is_packable()) {
      uint32_t length;
      return ReadLength(&length) && Packed(*field, length);
    }
    return Unknown(tag);  // protobuf keeps a mismatched field as unknown
  }
  if (ExpectedWireType(*field) != wire) return Unknown(tag);
  if (field->is_repeated()) {
    Count(*field, 1);
    totals_.object_bytes += kRepeatedSlotBytes;
  }
  return WireFormatLite::SkipField(in_, tag);
}

bool Scanner::LengthDelimited(const FieldDescriptor& field) {
  uint32_t length;
  if (!ReadLength(&length)) return false;
  if (field.is_repeated()) {
    Count(field, 1);
    totals_.object_bytes += kRepeatedSlotBytes;
  }
  if (field.type() == FieldDescriptor::TYPE_STRING) {
    // proto3 strings must be UTF-8 (protobuf refuses to parse them
    // otherwise): named here, where the field is known.
    AddString(length);
    std::string text;
    if (!in_->ReadString(&text, static_cast<int>(length))) return false;
    if (bad_utf8_ == nullptr &&
        !google::protobuf::internal::IsStructurallyValidUTF8(text)) {
      bad_utf8_ = &field;
    }
    return true;
  }
  if (field.type() != FieldDescriptor::TYPE_MESSAGE) {
    AddString(length);
    return in_->Skip(static_cast<int>(length));
  }
  totals_.object_bytes += MessageObjectBytes(*field.message_type());
  const auto limit = in_->PushLimit(static_cast<int>(length));
  if (in_->BytesUntilLimit() != static_cast<int>(length) ||
      !in_->IncrementRecursionDepth()) {
    return false;
  }
  const bool ok = Message(*field.message_type());
  in_->DecrementRecursionDepth();
  in_->PopLimit(limit);
  return ok;
}

bool Scanner::Packed(const FieldDescriptor& field, uint32_t length) {
  const auto limit = in_->PushLimit(static_cast<int>(length));
  if (in_->BytesUntilLimit() != static_cast<int>(length)) return false;
  uint64_t n = 0;
  const auto wire = ExpectedWireType(field);
  while (in_->BytesUntilLimit() > 0) {
    uint64_t v;
    uint32_t v32;
    const bool ok = wire == WireFormatLite::WIRETYPE_VARINT
                        ? in_->ReadVarint64(&v)
                    : wire == WireFormatLite::WIRETYPE_FIXED32
                        ? in_->ReadLittleEndian32(&v32)
                        : in_->ReadLittleEndian64(&v);
    if (!ok) return false;
    ++n;
  }
  in_->PopLimit(limit);
  Count(field, n);
  totals_.object_bytes += n * kRepeatedSlotBytes;
  return true;
}

bool Scanner::Unknown(uint32_t tag) {
  ++totals_.unknown_fields;
  const int before = in_->CurrentPosition();
  if (!SkipValue(tag)) return false;
  const uint64_t bytes = in_->CurrentPosition() - before;
  switch (WireFormatLite::GetTagWireType(tag)) {
    case WireFormatLite::WIRETYPE_LENGTH_DELIMITED:
      totals_.object_bytes += kUnknownFieldBytes;
      AddString(bytes);
      break;
    case WireFormatLite::WIRETYPE_START_GROUP:
      // A group holds unknown fields of its own, each at least two bytes:
      // counted and costed as if every byte were one.
      totals_.unknown_fields += bytes / 2;
      totals_.object_bytes += (kUnknownFieldBytes + kStringObjectBytes) * bytes;
      break;
    default:
      totals_.object_bytes += kUnknownFieldBytes;
  }
  return true;
}

}  // namespace

uint64_t MaxRequestEntries(const FieldDescriptor& field) {
  static const auto* const caps = new std::map<std::string, uint64_t>{
      {"optimd.v1.TensorSpec.shape", kMaxDims * kMaxTensorsPerSession},
      {"optimd.v1.TensorSpec.global_shape", kMaxDims * kMaxTensorsPerSession},
      {"optimd.v1.TensorSpec.global_offset", kMaxDims * kMaxTensorsPerSession},
      {"optimd.v1.StepRequest.overrides", kMaxGroupsPerSession},
      {"optimd.v1.StepRequest.buffer_updates", kMaxGroupsPerSession},
      {"optimd.v1.GetParamsRequest.group_ids", kMaxGroupsPerSession},
      {"optimd.v1.GetStateRequest.group_ids", kMaxGroupsPerSession},
      {"optimd.v1.SetStateRequest.tensors",
       kMaxStateKindsPerTensor * kMaxTensorsPerSession},
  };
  auto it = caps->find(field.full_name());
  // Everything else is per tensor (tensors, names, aliases, tensor steps):
  // a session holds at most kMaxTensorsPerSession tensors and as many
  // aliases.
  return it == caps->end() ? kMaxTensorsPerSession : it->second;
}

absl::StatusOr<RequestScan> ScanRequest(const grpc::ByteBuffer& bytes,
                                        const Descriptor& type) {
  grpc::ByteBuffer copy(bytes);  // shares the slices
  grpc::ProtoBufferReader reader(&copy);
  CodedInputStream in(&reader);
  Scanner scanner(&in, bytes.Length());
  RequestScan scan;
  scan.encoded_bytes = bytes.Length();
  if (!scanner.Message(type) ||
      static_cast<uint64_t>(in.CurrentPosition()) != scan.encoded_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("the request is not a valid ", type.full_name(), " (",
                     scan.encoded_bytes, " bytes, malformed from about byte ",
                     in.CurrentPosition(), "); nothing was done"));
  }
  if (scanner.bad_utf8() != nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("the request's ", scanner.bad_utf8()->full_name(),
                     " is not valid UTF-8 (a string field); nothing was done"));
  }
  const ScanTotals& totals = scanner.totals();
  for (const auto& [field, n] : totals.entries) {
    const uint64_t cap = MaxRequestEntries(*field);
    if (n > cap) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "the request has ", n, " entries of ", field->full_name(),
          "; a request may carry at most ", cap,
          " (what one session can hold); nothing was parsed or changed: "
          "send fewer"));
    }
  }
  if (totals.unknown_fields > kMaxUnknownFieldsPerRequest) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the request has ", totals.unknown_fields, " fields unknown to ",
        type.full_name(), "; a request may carry at most ",
        kMaxUnknownFieldsPerRequest, "; nothing was parsed or changed"));
  }
  const uint64_t objects = MessageObjectBytes(type) + totals.object_bytes;
  scan.parsed_bytes = objects + totals.payload_bytes;
  scan.held_bytes = scan.encoded_bytes + scan.parsed_bytes +
                    kConvertedPerObjectByte * objects + totals.payload_bytes;
  return scan;
}

}  // namespace optimd
