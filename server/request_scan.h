// What a request will cost the daemon once parsed, read from its encoded
// bytes before anything is parsed. A parsed request takes far more memory
// than its encoding when it holds many small entries (a 7-byte TensorSpec
// becomes hundreds of bytes of message and, once converted, of core
// structs), so the request budget must hold the parsed cost, not the
// encoded size, and requests with more entries than any session can hold
// must be refused before they are parsed at all.
//
// The scan walks the protobuf wire format with CodedInputStream against
// the message's descriptor, creating no message objects: every field
// occurrence of a known message, string or repeated type is counted and
// costed, unknown fields (which protobuf keeps, one object each) included.
//
// Thread-compatible (plain functions).
#ifndef OPTIMD_SERVER_REQUEST_SCAN_H_
#define OPTIMD_SERVER_REQUEST_SCAN_H_

#include <google/protobuf/descriptor.h>
#include <grpcpp/support/byte_buffer.h>

#include <cstdint>

#include "absl/status/statusor.h"

namespace optimd {

// Unknown fields one request may carry (fields of a newer API, a few per
// tensor at most); each is an object of its own once parsed.
inline constexpr uint64_t kMaxUnknownFieldsPerRequest = uint64_t{4} << 20;

// A request's entries and estimated cost, from its encoded bytes.
struct RequestScan {
  // The encoded size.
  uint64_t encoded_bytes = 0;
  // Upper estimate of the bytes the parsed message takes (message objects,
  // strings, repeated fields, unknown fields).
  uint64_t parsed_bytes = 0;
  // The bytes to hold against the request budget while the request lives:
  // its encoding, the parsed message and the core structs converted from
  // it.
  uint64_t held_bytes = 0;
};

// The most entries a request may carry in `field` (a repeated field),
// summed over every occurrence in the request (e.g. TensorSpec.aliases
// over all its tensors): what a session can hold of them.
uint64_t MaxRequestEntries(const google::protobuf::FieldDescriptor& field);

// Scans `bytes` as an encoded message of `type`. INVALID_ARGUMENT when
// they are not one (malformed wire format); RESOURCE_EXHAUSTED naming the
// field, its count and its cap when a repeated field has more entries than
// MaxRequestEntries, or there are more than kMaxUnknownFieldsPerRequest
// unknown fields.
absl::StatusOr<RequestScan> ScanRequest(
    const grpc::ByteBuffer& bytes, const google::protobuf::Descriptor& type);

}  // namespace optimd

#endif  // OPTIMD_SERVER_REQUEST_SCAN_H_
