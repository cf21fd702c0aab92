#include "server/request_scan.h"

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <string>

#include "core/group.h"
#include "core/session_checks.h"
#include "optimd/v1/optimd.pb.h"

namespace optimd {
namespace {

grpc::ByteBuffer BufferOf(const std::string& bytes) {
  grpc::Slice slice(bytes);
  return grpc::ByteBuffer(&slice, 1);
}

// A RegisterGroupRequest of `n` tensors named "a" (7 bytes each).
std::string TinyTensors(size_t n) {
  std::string body = "\x0a\x01g";
  for (size_t i = 0; i < n; ++i)
    body += std::string("\x22\x05\x0a\x01\x61\x18\x01", 7);
  return body;
}

TEST(RequestScanTest, CostsAValidRequestAboveItsParsedSize) {
  v1::RegisterGroupRequest request;
  request.set_group_id("g");
  for (int i = 0; i < 1000; ++i) {
    v1::TensorSpec* t = request.add_tensors();
    t->set_name("tensor-with-a-long-enough-name-" + std::to_string(i));
    t->add_shape(4);
    t->add_shape(8);
    t->add_aliases("alias" + std::to_string(i));
    t->mutable_param()->mutable_shared_memory()->set_segment_name("seg");
  }
  const std::string bytes = request.SerializeAsString();
  auto scan = ScanRequest(BufferOf(bytes), *request.GetDescriptor());
  ASSERT_TRUE(scan.ok()) << scan.status();
  EXPECT_EQ(scan->encoded_bytes, bytes.size());
  EXPECT_GE(scan->parsed_bytes, request.SpaceUsedLong());
  EXPECT_GE(scan->held_bytes, scan->encoded_bytes + 2 * scan->parsed_bytes);
}

// Fields of up to kMaxDims entries per tensor (shapes, a shard's place in
// its whole tensor) may hold that many per tensor of a full session.
TEST(RequestScanTest, PerDimensionFieldsHoldADimensionListPerTensor) {
  const google::protobuf::Descriptor* t = v1::TensorSpec::descriptor();
  for (const char* name : {"shape", "global_shape", "global_offset"}) {
    SCOPED_TRACE(name);
    EXPECT_EQ(MaxRequestEntries(*t->FindFieldByName(name)),
              kMaxDims * kMaxTensorsPerSession);
  }
  EXPECT_EQ(MaxRequestEntries(*t->FindFieldByName("aliases")),
            kMaxTensorsPerSession);
}

TEST(RequestScanTest, RefusesMoreTensorsThanASessionHoldsNamingTheCount) {
  const std::string bytes = TinyTensors(kMaxTensorsPerSession + 1);
  auto scan =
      ScanRequest(BufferOf(bytes), *v1::RegisterGroupRequest::descriptor());
  ASSERT_EQ(scan.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(scan.status().message().find(
                std::to_string(kMaxTensorsPerSession + 1) +
                " entries of optimd.v1.RegisterGroupRequest.tensors"),
            std::string::npos)
      << scan.status();
  EXPECT_NE(scan.status().message().find(std::to_string(kMaxTensorsPerSession)),
            std::string::npos);
  EXPECT_TRUE(ScanRequest(BufferOf(TinyTensors(kMaxTensorsPerSession)),
                          *v1::RegisterGroupRequest::descriptor())
                  .ok());
}

TEST(RequestScanTest, CountsNestedEntriesOverTheWholeRequest) {
  // Step's buffer updates: tensors summed over every update.
  v1::StepRequest step;
  for (int u = 0; u < 3; ++u) {
    v1::UpdateBuffersRequest* update = step.add_buffer_updates();
    for (size_t i = 0; i < kMaxTensorsPerSession / 2; ++i) {
      update->add_tensors()->set_name("x");
    }
  }
  auto scan =
      ScanRequest(BufferOf(step.SerializeAsString()), *step.GetDescriptor());
  ASSERT_EQ(scan.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(scan.status().message().find("UpdateBuffersRequest.tensors"),
            std::string::npos)
      << scan.status();
}

TEST(RequestScanTest, CostsUnknownFieldsAndCapsThem) {
  // Field 100 is unknown to CreateSessionRequest: each empty occurrence is
  // 3 bytes on the wire and an object once parsed.
  std::string few;
  for (int i = 0; i < 1000; ++i) few += std::string("\xa2\x06\x00", 3);
  auto scan =
      ScanRequest(BufferOf(few), *v1::CreateSessionRequest::descriptor());
  ASSERT_TRUE(scan.ok()) << scan.status();
  v1::CreateSessionRequest parsed;
  ASSERT_TRUE(parsed.ParseFromString(few));
  EXPECT_GE(scan->parsed_bytes, parsed.SpaceUsedLong());

  std::string many;
  for (uint64_t i = 0; i <= kMaxUnknownFieldsPerRequest; ++i) {
    many += std::string("\xa0\x06\x00", 3);
  }
  EXPECT_EQ(ScanRequest(BufferOf(many), *v1::CreateSessionRequest::descriptor())
                .status()
                .code(),
            absl::StatusCode::kResourceExhausted);
}

TEST(RequestScanTest, RefusesMalformedBytes) {
  const auto& type = *v1::RegisterGroupRequest::descriptor();
  // A tensor whose length runs past the end; a zero tag; a bad wire type.
  for (const std::string& bad :
       {std::string("\x22\x09\x0a\x01\x61", 5), std::string("\x00\x01", 2),
        std::string("\x0f", 1), std::string("\x22\x02\x0c\x00", 4),
        // A valid group id, then a tag of 0 (the fuzz target's finding).
        std::string("\x0a\x01g\x00", 4),
        std::string("\x22\x03\x0a\x01\x61\x00", 6),
        // A tag of 8 bytes, which CodedInputStream::ReadTag takes.
        std::string("\xf5\xfe\x98\xef\xf8\xe5\xad\x0a\x00", 9),
        // An unknown group (field 14) holding a field numbered 0.
        std::string("\x73\x02\x00\x74", 4),
        std::string("\x73\x73\x01\x00\x74\x74", 6)}) {
    auto scan = ScanRequest(BufferOf(bad), type);
    EXPECT_EQ(scan.status().code(), absl::StatusCode::kInvalidArgument)
        << scan.status() << " for " << bad.size() << " bytes";
    v1::RegisterGroupRequest parsed;
    EXPECT_FALSE(parsed.ParseFromString(bad)) << bad.size() << " bytes";
  }
  // The same unknown group holding a numbered field: protobuf keeps it.
  const std::string group("\x73\x08\x01\x74", 4);
  EXPECT_TRUE(ScanRequest(BufferOf(group), type).ok());
  EXPECT_TRUE(ScanRequest(BufferOf(""), type).ok());
  // A group id that is not UTF-8, named.
  auto utf8 = ScanRequest(BufferOf(std::string("\x0a\x02\xff\xfe", 4)), type);
  EXPECT_EQ(utf8.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(utf8.status().message().find(
                "optimd.v1.RegisterGroupRequest.group_id is not valid UTF-8"),
            std::string::npos)
      << utf8.status();
}

}  // namespace
}  // namespace optimd
