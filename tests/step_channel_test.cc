// liboptimd_step_channel's C interface (client/step_channel.h) against the
// real daemon over its Unix socket: replies in order, a refused step's
// status, a daemon gone, and channels freed in every state without a hang.
#include "client/step_channel.h"

#include <memory>
#include <string>
#include <vector>

#include "client/client.h"
#include "gtest/gtest.h"
#include "optimd/v1/optimd.pb.h"
#include "tests/daemon_process.h"

namespace optimd {
namespace {

class StepChannelTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto d = DaemonProcess::Start();
    ASSERT_TRUE(d.ok()) << d.status();
    daemon_ = *std::move(d);
    auto c = daemon_->Connect();
    ASSERT_TRUE(c.ok()) << c.status();
    client_ = *std::move(c);
    v1::CreateSessionRequest r;
    r.set_job_id("step-channel");
    r.set_world_size(1);
    r.set_device(-1);
    ASSERT_TRUE(client_->CreateSession(r).ok());
  }

  void* Open() {
    char err[256] = {};
    void* ch = optimd_step_channel_open(daemon_->address().c_str(),
                                        client_->session_token().c_str(), 10000,
                                        err, sizeof(err));
    EXPECT_NE(ch, nullptr) << err;
    return ch;
  }

  static int Send(void* ch, const v1::StepRequest& request) {
    const std::string bytes = request.SerializeAsString();
    return optimd_step_channel_send(ch, bytes.data(), bytes.size());
  }

  static v1::StepRequest Plain() {
    v1::StepRequest r;
    r.set_assume_finite(true);
    return r;
  }

  // The next reply (waiting for it), or the stream's end: rc, code, text.
  struct Next {
    int rc;
    int code;
    std::string text;
  };
  static Next Wait(void* ch, size_t cap = 4096, int timeout_ms = -1) {
    std::vector<char> buf(cap + 1);
    size_t len = 0;
    int code = -1;
    const int rc =
        optimd_step_channel_next(ch, timeout_ms, buf.data(), cap, &len, &code);
    return {rc, code,
            rc == 1 ? std::string(buf.data(), len) : std::string(buf.data())};
  }

  std::unique_ptr<DaemonProcess> daemon_;
  std::unique_ptr<Client> client_;
};

TEST_F(StepChannelTest, RepliesComeInOrderAndTheChannelFinishes) {
  void* ch = Open();
  ASSERT_NE(ch, nullptr);
  for (int i = 0; i < 40; ++i) ASSERT_EQ(Send(ch, Plain()), 0);
  for (int i = 0; i < 40; ++i) {
    const Next n = Wait(ch);
    ASSERT_EQ(n.rc, 1) << n.text;
    v1::StepResponse reply;
    ASSERT_TRUE(reply.ParseFromString(n.text));
    EXPECT_TRUE(reply.known());
  }
  size_t len = 0;
  int code = 0;
  char buf[64];
  EXPECT_EQ(optimd_step_channel_next(ch, 0, buf, sizeof(buf), &len, &code),
            0);  // nothing more, and no wait
  optimd_step_channel_finish(ch, 10000);
  const Next end = Wait(ch);
  EXPECT_EQ(end.rc, -1);
  EXPECT_EQ(Send(ch, Plain()), -1);  // a finished channel takes nothing
  optimd_step_channel_free(ch);
}

TEST_F(StepChannelTest, AReplyLargerThanTheBufferIsKeptForTheNextCall) {
  void* ch = Open();
  ASSERT_NE(ch, nullptr);
  ASSERT_EQ(Send(ch, Plain()), 0);
  std::vector<char> buf(4096);
  size_t len = 0;
  int code = 0;
  int rc;
  while ((rc = optimd_step_channel_next(ch, -1, buf.data(), 0, &len, &code)) ==
         0) {
  }
  ASSERT_EQ(rc, -2);
  ASSERT_GT(len, 0u);
  ASSERT_EQ(optimd_step_channel_next(ch, 0, buf.data(), len, &len, &code), 1);
  v1::StepResponse reply;
  EXPECT_TRUE(reply.ParseFromArray(buf.data(), static_cast<int>(len)));
  optimd_step_channel_free(ch);
}

TEST_F(StepChannelTest, ARefusedStepEndsTheStreamWithItsStatus) {
  void* ch = Open();
  ASSERT_NE(ch, nullptr);
  v1::StepRequest bad = Plain();
  bad.add_overrides()->set_group_id("no-such-group");
  ASSERT_EQ(Send(ch, bad), 0);
  const Next end = Wait(ch);
  ASSERT_EQ(end.rc, -1);
  EXPECT_EQ(end.code, static_cast<int>(grpc::StatusCode::NOT_FOUND));
  EXPECT_NE(end.text.find("no-such-group"), std::string::npos) << end.text;
  EXPECT_EQ(Send(ch, Plain()), -1);
  optimd_step_channel_free(ch);
  // The session steps on over a new channel.
  void* again = Open();
  ASSERT_EQ(Send(again, Plain()), 0);
  EXPECT_EQ(Wait(again).rc, 1);
  optimd_step_channel_free(again);
}

TEST_F(StepChannelTest, ADaemonGoneEndsTheStreamAndFreeingDoesNotHang) {
  void* ch = Open();
  ASSERT_NE(ch, nullptr);
  ASSERT_EQ(Send(ch, Plain()), 0);
  ASSERT_EQ(Wait(ch).rc, 1);
  EXPECT_EQ(daemon_->Stop(), 0);
  daemon_.reset();
  const Next end = Wait(ch);
  EXPECT_EQ(end.rc, -1);
  EXPECT_EQ(end.code, static_cast<int>(grpc::StatusCode::UNAVAILABLE))
      << end.text;
  optimd_step_channel_free(ch);
}

TEST_F(StepChannelTest, AChannelFreedWithStepsInFlightIsCancelled) {
  void* ch = Open();
  ASSERT_NE(ch, nullptr);
  for (int i = 0; i < 20; ++i) ASSERT_EQ(Send(ch, Plain()), 0);
  optimd_step_channel_free(ch);  // not finished: cancelled, no hang
  // The daemon keeps serving the session.
  v1::StepRequest r = Plain();
  EXPECT_TRUE(client_->Step(r).ok());
}

TEST_F(StepChannelTest, AFinishPastItsTimeoutCancelsTheStream) {
  void* ch = Open();
  ASSERT_NE(ch, nullptr);
  if (!daemon_->Freeze()) {  // answers nothing now
    daemon_->Thaw();
    FAIL() << "the daemon did not stop";
  }
  ASSERT_EQ(Send(ch, Plain()), 0);
  optimd_step_channel_finish(ch, 200);
  // The end while the daemon is still stopped (bounded), then resumed
  // before any assertion, so that no failure leaves it stopped.
  const Next end = Wait(ch, 4096, 20000);
  const bool resumed = daemon_->Thaw();
  EXPECT_EQ(end.rc, -1);
  EXPECT_EQ(end.code, static_cast<int>(grpc::StatusCode::CANCELLED))
      << end.text;
  optimd_step_channel_free(ch);
  ASSERT_TRUE(resumed);
  v1::StepRequest r = Plain();
  EXPECT_TRUE(client_->Step(r).ok());  // the session steps on
}

TEST(StepChannelOpen, NoDaemonIsNullWithTheReason) {
  char err[256] = {};
  void* ch = optimd_step_channel_open("unix:/nonexistent/optimd.sock", "t", 200,
                                      err, sizeof(err));
  EXPECT_EQ(ch, nullptr);
  EXPECT_NE(std::string(err).find("no optimd daemon answers"),
            std::string::npos)
      << err;
}

}  // namespace
}  // namespace optimd
