// Unary calls whose request gRPC hands over as bytes (the service's raw
// callback methods), so that the daemon sees a request's cost before it is
// parsed: the bytes are scanned (request_scan.h), their parsed cost is held
// against the request budget for the call's life, and only then are they
// parsed, into an arena that goes with the call. The response is
// serialized when the call is finished, and its bytes held against the
// same budget until gRPC is done with the call (its caller read it): the
// reply of a call that changed nothing (ReplyKind::kRefusable) is refused
// with RESOURCE_EXHAUSTED when that would pass half the budget
// (RequestBudget::ReserveReply), any other is held past it.
//
// A RawUnaryCall is made by its handler and deletes itself when gRPC is
// done with it (OnDone). Finish is called once, from any thread; request()
// and response() may be used until then.
#ifndef OPTIMD_SERVER_RAW_CALL_H_
#define OPTIMD_SERVER_RAW_CALL_H_

#include <google/protobuf/arena.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/support/proto_buffer_reader.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "server/convert.h"
#include "server/request_budget.h"
#include "server/request_scan.h"

namespace optimd {

// Scans `bytes` as a `Request`, holds their parsed cost and `extra` bytes
// together against `budget` (one reservation, so that a request larger than
// the budget is still taken when nothing else is held; *held: the bytes
// held, for the caller to release), then parses them into *request. On an
// error before the reservation nothing is held; on a parse error after it,
// *held says what is.
template <typename Request>
absl::Status ParseHeld(const grpc::ByteBuffer& bytes, RequestBudget* budget,
                       Request* request, uint64_t* held, uint64_t extra = 0) {
  auto scan = ScanRequest(bytes, *Request::descriptor());
  if (!scan.ok()) return scan.status();
  if (absl::Status reserved = budget->Reserve(scan->held_bytes + extra);
      !reserved.ok()) {
    return reserved;
  }
  *held = scan->held_bytes + extra;
  grpc::ByteBuffer copy(bytes);  // shares the slices
  grpc::ProtoBufferReader reader(&copy);
  if (!request->ParseFromZeroCopyStream(&reader)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the request is not a valid ", Request::descriptor()->full_name()));
  }
  return absl::OkStatus();
}

// What a unary call in flight costs the daemon beyond its request's parsed
// bytes (about 17 KB measured for a queued Step with an empty request: see
// bench/RESULTS.md).
inline constexpr uint64_t kCallBytes = 16 << 10;

// Whether a call's reply may be refused for the budget (a call that
// changed nothing: GetState, GetMetrics, ListSessions) or must be sent.
enum class ReplyKind { kMustSend, kRefusable };

template <typename Request, typename Response>
class RawUnaryCall final : public grpc::ServerUnaryReactor {
 public:
  // `out`: where the response goes; `budget` must outlive the call.
  RawUnaryCall(grpc::ByteBuffer* out, RequestBudget* budget,
               ReplyKind reply = ReplyKind::kMustSend)
      : out_(out),
        budget_(budget),
        reply_(reply),
        request_(google::protobuf::Arena::CreateMessage<Request>(&arena_)),
        response_(google::protobuf::Arena::CreateMessage<Response>(&arena_)) {}
  RawUnaryCall(const RawUnaryCall&) = delete;
  RawUnaryCall& operator=(const RawUnaryCall&) = delete;

  // Scans `bytes`, holds their parsed cost against the budget until the
  // call is done, then parses them (ParseHeld). The call's own memory
  // (gRPC's call and reactor objects, the arena, a queued task) is held
  // too, kCallBytes, so that calls queued without end are bounded by the
  // budget however small their requests.
  // A call whose reply may be refused is refused here already when
  // replies fill their part of the budget (RequestBudget::CheckReplyRoom).
  absl::Status Parse(const grpc::ByteBuffer& bytes) {
    absl::Status parsed =
        ParseHeld(bytes, budget_, request_, &held_, kCallBytes);
    if (parsed.ok() && reply_ == ReplyKind::kRefusable) {
      parsed = budget_->CheckReplyRoom(held_);
    }
    return parsed;
  }

  const Request& request() const { return *request_; }
  Response* response() { return response_; }

  // Parse, or else finishes the call with its refusal: false then (the
  // handler returns the call as it is).
  bool Parsed(const grpc::ByteBuffer& bytes) {
    absl::Status parsed = Parse(bytes);
    if (!parsed.ok()) Finish(parsed);
    return parsed.ok();
  }

  // Finishes the call: with the response when `status` is OK. (Hides
  // ServerUnaryReactor::Finish, which would send no response: handlers
  // call it through a RawUnaryCall pointer.)
  void Finish(const grpc::Status& status) {
    if (status.ok()) {
      bool own_buffer;
      grpc::Status serialized = grpc::SerializationTraits<Response>::Serialize(
          *response_, out_, &own_buffer);
      if (serialized.ok()) serialized = HoldReply();
      if (!serialized.ok()) {
        grpc::ServerUnaryReactor::Finish(serialized);
        return;
      }
    }
    grpc::ServerUnaryReactor::Finish(status);
  }
  void Finish(const absl::Status& status) { Finish(ToGrpcStatus(status)); }

  void OnDone() override { delete this; }

 private:
  ~RawUnaryCall() override { budget_->Release(held_); }

  // Holds the serialized reply's bytes until the call is done; a
  // refusable one past the budget is dropped, and the refusal returned.
  grpc::Status HoldReply() {
    const uint64_t bytes = out_->Length();
    if (reply_ == ReplyKind::kMustSend) {
      budget_->Hold(bytes);
    } else if (absl::Status held = budget_->ReserveReply(bytes, held_);
               !held.ok()) {
      out_->Clear();
      return ToGrpcStatus(held);
    }
    held_ += bytes;
    return grpc::Status::OK;
  }

  grpc::ByteBuffer* const out_;
  RequestBudget* const budget_;
  const ReplyKind reply_;
  google::protobuf::Arena arena_;
  Request* const request_;
  Response* const response_;
  uint64_t held_ = 0;
};

}  // namespace optimd

#endif  // OPTIMD_SERVER_RAW_CALL_H_
