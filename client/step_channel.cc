// liboptimd_step_channel.so: one session's StepStream for the Python
// client, driven without Python threads.
//
// grpcio takes a stream's requests from an iterator on a Python thread of
// its own and delivers replies on another, and each of them needs the GIL
// for every step: the trainer's thread waits for the hand-off (hundreds of
// microseconds on a busy host) and loses the GIL to them again during the
// next forward. Here the trainer's thread hands the serialized request to a
// C++ writer thread (a queue push: microseconds, the GIL held) and a C++
// reader thread puts the replies in a queue the trainer polls when it wants
// them, so no Python thread runs per step.
//
// The C interface (ctypes): client/step_channel.h. One thread at a time
// may call next (it alone touches a held reply); send, wait and end_writes
// may come from any thread; the writer and reader threads are this file's
// own.
#include "client/step_channel.h"

#include <chrono>
#include <cstddef>
#include <cstring>
#include <deque>
#include <memory>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/mutex.h"
#include "grpcpp/grpcpp.h"
#include "optimd/v1/optimd.grpc.pb.h"

namespace optimd {
namespace {

void CopyMessage(const std::string& message, char* out, size_t cap) {
  if (cap == 0) return;
  const size_t n = message.size() < cap - 1 ? message.size() : cap - 1;
  std::memcpy(out, message.data(), n);
  out[n] = '\0';
}

class StepChannel {
 public:
  StepChannel(const std::shared_ptr<grpc::Channel>& channel,
              const std::string& token)
      : stub_(v1::Optimizer::NewStub(channel)) {
    context_.AddMetadata("x-optimd-session", token);
    stream_ = stub_->StepStream(&context_);
    writer_ = std::thread([this] { WriteRequests(); });
    reader_ = std::thread([this] { ReadReplies(); });
  }

  ~StepChannel() {
    Close(0);        // a stream still open is cancelled
    reader_.join();  // which joined the writer
  }

  // Queues a serialized StepRequest for the writer thread; false once the
  // stream has ended or is closing (Next then gives its status).
  bool Send(const void* data, size_t len) {
    MutexLock lock(&mu_);
    if (reading_done_ || closing_) return false;
    outgoing_.emplace_back(static_cast<const char*>(data), len);
    return true;
  }

  // Ends the requests once those queued are written; the daemon answers
  // them, then ends the stream.
  void EndWrites() {
    MutexLock lock(&mu_);
    closing_ = true;
  }

  // Whether a reply is queued or the stream has ended (until_end: whether
  // it has ended), waiting up to timeout_ms for it.
  bool Wait(int timeout_ms, bool until_end) {
    MutexLock lock(&mu_);
    return mu_.AwaitWithDeadline(until_end ? &Ended : &ReplyOrEnd, this,
                                 absl::Now() + absl::Milliseconds(timeout_ms));
  }

  // EndWrites; a stream the daemon has not ended within timeout_ms is then
  // cancelled.
  void Close(int timeout_ms) {
    EndWrites();
    if (!Wait(timeout_ms, /*until_end=*/true)) context_.TryCancel();
  }

  // Next, into the caller's buffer (the C interface's contract).
  int NextInto(int timeout_ms, char* buf, size_t cap, size_t* len, int* code) {
    std::string reply;
    grpc::Status status;
    int rc = 1;
    if (!held_.empty()) {
      reply = std::move(held_);
      held_.clear();
    } else {
      rc = Next(timeout_ms, &reply, &status);
    }
    if (rc == 1) {
      *len = reply.size();
      if (reply.size() > cap) {
        held_ = std::move(reply);
        return -2;
      }
      std::memcpy(buf, reply.data(), reply.size());
    } else if (rc == -1) {
      *code = static_cast<int>(status.error_code());
      CopyMessage(status.error_message(), buf, cap);
    }
    return rc;
  }

 private:
  // Await's conditions (mu_ held while absl evaluates them).
  static bool Ended(StepChannel* c) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    return c->ended_;
  }
  static bool ReplyOrEnd(StepChannel* c) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    return !c->replies_.empty() || c->ended_;
  }

  // 1: a reply in *reply; 0: none within timeout_ms (0: no wait; negative:
  // no limit); -1: the stream ended, its status in *status.
  int Next(int timeout_ms, std::string* reply, grpc::Status* status) {
    MutexLock lock(&mu_);
    if (timeout_ms < 0) {
      mu_.Await(&ReplyOrEnd, this);
    } else if (timeout_ms == 0) {
      // No timed wait: one whose deadline has passed can still sleep for
      // the kernel's timer slack (about 50 us), on every look.
      if (!ReplyOrEnd(this)) return 0;
    } else if (!mu_.AwaitWithDeadline(
                   &ReplyOrEnd, this,
                   absl::Now() + absl::Milliseconds(timeout_ms))) {
      return 0;
    }
    if (!replies_.empty()) {
      *reply = std::move(replies_.front());
      replies_.pop_front();
      return 1;
    }
    *status = status_;
    return -1;
  }

  // Writes the queued requests in order until the stream ends, or until
  // Close and the queue is empty (then half-closes).
  void WriteRequests() {
    for (;;) {
      std::string bytes;
      {
        MutexLock lock(&mu_);
        mu_.Await(
            +[](StepChannel* c) ABSL_NO_THREAD_SAFETY_ANALYSIS {
              return !c->outgoing_.empty() || c->closing_ || c->reading_done_;
            },
            this);
        if (reading_done_) return;
        if (outgoing_.empty()) break;  // closing, everything written
        bytes = std::move(outgoing_.front());
        outgoing_.pop_front();
      }
      v1::StepRequest request;
      if (!request.ParseFromString(bytes)) {
        // Not a request the client serialized: end the stream rather than
        // send something else (an empty request is a plain step).
        context_.TryCancel();
        return;
      }
      if (!stream_->Write(request)) return;  // ended: the reader reports it
    }
    stream_->WritesDone();
  }

  void ReadReplies() {
    v1::StepResponse response;
    while (stream_->Read(&response)) {
      std::string bytes = response.SerializeAsString();
      MutexLock lock(&mu_);
      replies_.push_back(std::move(bytes));
    }
    {
      MutexLock lock(&mu_);
      reading_done_ = true;  // a writer waiting for requests stops
    }
    // Finish only once the writer is gone: a Write racing Finish is not
    // allowed.
    writer_.join();
    const grpc::Status status = stream_->Finish();  // OK: the daemon ended it
    MutexLock lock(&mu_);
    status_ = status;
    ended_ = true;
  }

  std::unique_ptr<v1::Optimizer::Stub> stub_;
  grpc::ClientContext context_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::StepRequest, v1::StepResponse>>
      stream_;
  Mutex mu_;
  std::deque<std::string> outgoing_ ABSL_GUARDED_BY(mu_);
  std::deque<std::string> replies_ ABSL_GUARDED_BY(mu_);
  bool closing_ ABSL_GUARDED_BY(mu_) = false;
  bool reading_done_ ABSL_GUARDED_BY(mu_) = false;  // the stream's end seen
  bool ended_ ABSL_GUARDED_BY(mu_) = false;         // and its status taken
  grpc::Status status_ ABSL_GUARDED_BY(mu_);
  std::string held_;  // a reply too large for the caller's buffer (caller's)
  std::thread writer_;
  std::thread reader_;
};

}  // namespace
}  // namespace optimd

extern "C" {

void* optimd_step_channel_open(const char* target, const char* token,
                               int connect_timeout_ms, char* err,
                               size_t err_cap) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  args.SetMaxSendMessageSize(-1);
  auto channel = grpc::CreateCustomChannel(
      target, grpc::InsecureChannelCredentials(), args);
  // Until connected or refused (as grpcio's calls fail fast: a daemon
  // gone is an error at once, not after the whole timeout).
  const auto deadline = std::chrono::system_clock::now() +
                        std::chrono::milliseconds(connect_timeout_ms);
  grpc_connectivity_state state = channel->GetState(/*try_to_connect=*/true);
  while (state != GRPC_CHANNEL_READY &&
         state != GRPC_CHANNEL_TRANSIENT_FAILURE &&
         state != GRPC_CHANNEL_SHUTDOWN &&
         channel->WaitForStateChange(state, deadline)) {
    state = channel->GetState(/*try_to_connect=*/true);
  }
  if (state != GRPC_CHANNEL_READY) {
    optimd::CopyMessage(absl::StrCat("no optimd daemon answers at ", target),
                        err, err_cap);
    return nullptr;
  }
  return new optimd::StepChannel(channel, token);
}

int optimd_step_channel_send(void* channel, const void* data, size_t len) {
  return static_cast<optimd::StepChannel*>(channel)->Send(data, len) ? 0 : -1;
}

int optimd_step_channel_next(void* channel, int timeout_ms, char* buf,
                             size_t cap, size_t* len, int* code) {
  return static_cast<optimd::StepChannel*>(channel)->NextInto(timeout_ms, buf,
                                                              cap, len, code);
}

int optimd_step_channel_wait(void* channel, int timeout_ms, int until_end) {
  return static_cast<optimd::StepChannel*>(channel)->Wait(timeout_ms,
                                                          until_end != 0)
             ? 1
             : 0;
}

void optimd_step_channel_end_writes(void* channel) {
  static_cast<optimd::StepChannel*>(channel)->EndWrites();
}

void optimd_step_channel_finish(void* channel, int timeout_ms) {
  static_cast<optimd::StepChannel*>(channel)->Close(timeout_ms);
}

void optimd_step_channel_free(void* channel) {
  delete static_cast<optimd::StepChannel*>(channel);
}

}  // extern "C"
