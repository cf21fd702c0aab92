// OptimizerServiceImpl's checkpoint streams: SaveStateStream, which streams
// a snapshot's file bytes, and LoadStateStream, which spools a streamed
// file and loads it as LoadState loads one (optimizer_service.cc has the
// other calls).
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <thread>

#include "absl/strings/str_format.h"
#include "absl/strings/str_replace.h"
#include "absl/time/clock.h"
#include "checkpoint/session_checkpoint.h"
#include "common/mutex.h"
#include "server/convert.h"
#include "server/log.h"
#include "server/optimizer_service.h"
#include "server/raw_call.h"
#include "server/session_name.h"
#include "server/spool_files.h"

namespace optimd {

// Streams a snapshot's file bytes. A thread of its own computes the
// checksums and produces one chunk at a time, waiting for each write to
// complete before the next (flow control by the client's reads). The
// stream ends with ABORTED when its session is retired (closed, evicted,
// reaped) before every byte was sent; a write that a client which stopped
// reading never takes is cancelled after a grace, so that such a client
// does not keep the snapshot (or the session, which the reactor holds
// until OnDone) past its session.
class OptimizerServiceImpl::SaveStreamReactor final
    : public grpc::ServerWriteReactor<grpc::ByteBuffer> {
 public:
  SaveStreamReactor(OptimizerServiceImpl* service,
                    grpc::CallbackServerContext* context,
                    std::shared_ptr<Session> session,
                    std::shared_ptr<DeviceWorker> worker, uint64_t chunk_bytes)
      : service_(service),
        context_(context),
        session_(std::move(session)),
        name_(SessionName(session_->identity())),
        chunk_bytes_(chunk_bytes),
        start_(absl::Now()) {
    log::Info(absl::StrCat("checkpoint save started (stream): ", name_));
    // Not under mu_: for a session retired already, the callback runs here,
    // at once, and takes mu_ itself.
    const uint64_t on_retire =
        session_->OnRetire([this] { OnSessionRetired(); });
    {
      MutexLock lock(&mu_);
      on_retire_ = on_retire;
    }
    worker->Post(session_.get(), [this] { Start(); });
  }

  void OnWriteDone(bool ok) override {
    MutexLock lock(&mu_);
    write_ok_ = ok;
    writing_ = false;
  }

  void OnCancel() override {
    MutexLock lock(&mu_);
    cancelled_ = true;
  }

  void OnDone() override {
    if (producer_.joinable()) {
      // OnDone may run inline in the producer's own Finish.
      if (producer_.get_id() == std::this_thread::get_id()) {
        producer_.detach();
      } else {
        producer_.join();
      }
    }
    uint64_t on_retire;
    {
      MutexLock lock(&mu_);
      on_retire = on_retire_;
    }
    // Last, before this goes: waits for a retirement callback under way
    // (Session::Retire calls it under the lock that ForgetOnRetire takes).
    session_->ForgetOnRetire(on_retire);
    delete this;
  }

 private:
  // Session::OnRetire's callback, on the retiring thread (or the
  // constructor's, for a session retired already): the producer ends the
  // call with ABORTED at its next chunk (Start, Produce), or once the
  // write under way is done (AwaitWrite). A call that sent every byte is
  // left to its Finish, so that a close right after a complete stream does
  // not fail it.
  void OnSessionRetired() {
    MutexLock lock(&mu_);
    retired_ = true;
  }

  // On the session's worker: takes the snapshot and starts the producer.
  // A session retired first ends the call without one (a snapshot of a
  // closed session would only hold host memory until the producer saw it).
  void Start() {
    bool retired;
    {
      MutexLock lock(&mu_);
      retired = retired_;
    }
    if (retired) {
      End(RetiredStatus(), 0, 0);
      return;
    }
    auto snapshot = SnapshotSession(*session_);
    if (!snapshot.ok()) {
      End(ToGrpcStatus(snapshot.status()), 0, 0);
      return;
    }
    snapshot_ = *std::move(snapshot);
    // Under mu_, which Produce takes first: the producer cannot end the
    // call (after which OnDone reads producer_ and deletes this) before
    // producer_ holds it.
    MutexLock lock(&mu_);
    producer_ = std::thread([this] { Produce(); });
  }

  void Produce() {
    { MutexLock started(&mu_); }  // producer_ is set (Start)
    const uint64_t total = snapshot_->FileSize();
    for (uint64_t offset = 0; offset < total;) {
      const uint64_t n = std::min(chunk_bytes_, total - offset);
      chunk_.set_offset(offset);
      chunk_.set_total_bytes(total);
      chunk_.mutable_data()->resize(n);
      snapshot_->ReadFile(
          offset, n, reinterpret_cast<uint8_t*>(chunk_.mutable_data()->data()));
      {
        MutexLock lock(&mu_);
        if (cancelled_ || retired_) break;
        writing_ = true;
      }
      // The last chunk's write is done: its bytes may go.
      out_.Clear();
      bool own_buffer;
      grpc::Status serialized =
          grpc::SerializationTraits<v1::StateChunk>::Serialize(chunk_, &out_,
                                                               &own_buffer);
      if (!serialized.ok()) {
        snapshot_.reset();
        End(serialized, sent_bytes(), total);
        return;
      }
      StartWrite(&out_);
      if (!AwaitWrite()) break;
      offset += n;
      MutexLock lock(&mu_);
      sent_ = offset;
    }
    snapshot_.reset();
    End(Outcome(total), sent_bytes(), total);
  }

  // Waits for the write just started; false when the stream is to end: the
  // write failed or the call was cancelled. Once the session is retired, a
  // write the client does not take within kRetiredWriteGrace is
  // cancelled, so that such a client does not keep the
  // snapshot (or the session) past its session.
  bool AwaitWrite() {
    bool stuck;
    {
      MutexLock lock(&mu_);
      mu_.Await(
          +[](SaveStreamReactor* r) ABSL_NO_THREAD_SAFETY_ANALYSIS {
            return WriteOver(r) || r->retired_;
          },
          this);
      stuck = !mu_.AwaitWithDeadline(&WriteOver, this,
                                     absl::Now() + kRetiredWriteGrace);
    }
    // Outside mu_, which OnCancel takes.
    if (stuck) context_->TryCancel();
    MutexLock lock(&mu_);
    mu_.Await(&WriteOver, this);
    if (!write_ok_ || cancelled_) {
      cancelled_ = true;
      return false;
    }
    return true;  // a retirement ends the stream at its next chunk
  }

  // The write under way is done, or the call cancelled (which ends it).
  static bool WriteOver(SaveStreamReactor* r) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    return !r->writing_ || r->cancelled_;
  }

  // How the producer's stream of `total` bytes ends: ABORTED when its
  // session was retired with bytes unsent; CANCELLED when the client broke
  // it off (a write failed) otherwise; OK when every byte was sent, even if
  // the session was retired just after.
  grpc::Status Outcome(uint64_t total) {
    MutexLock lock(&mu_);
    if (sent_ < total && retired_) return RetiredStatus();
    if (cancelled_ && !retired_) {
      return grpc::Status(grpc::StatusCode::CANCELLED,
                          "the client stopped reading");
    }
    return grpc::Status::OK;
  }

  static grpc::Status RetiredStatus() {
    return grpc::Status(grpc::StatusCode::ABORTED,
                        "the session was closed, evicted or reaped while "
                        "its checkpoint was streamed");
  }

  uint64_t sent_bytes() {
    MutexLock lock(&mu_);
    return sent_;
  }

  void End(const grpc::Status& status, uint64_t sent, uint64_t total) {
    service_->EndStreamedSave(name_, status, sent, total,
                              absl::ToDoubleSeconds(absl::Now() - start_));
    Finish(status);
  }

  // How long a write may stay untaken by the client once the session is
  // retired.
  static constexpr absl::Duration kRetiredWriteGrace = absl::Seconds(2);

  OptimizerServiceImpl* const service_;
  grpc::CallbackServerContext* const context_;
  // Held until OnDone, which forgets the retirement callback with it.
  const std::shared_ptr<Session> session_;
  const std::string name_;
  const uint64_t chunk_bytes_;
  const absl::Time start_;
  std::unique_ptr<CheckpointSnapshot> snapshot_;
  v1::StateChunk chunk_;
  grpc::ByteBuffer out_;  // chunk_, serialized for its write
  std::thread producer_;
  Mutex mu_;
  uint64_t on_retire_ ABSL_GUARDED_BY(mu_) = 0;  // Session::OnRetire's id
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool write_ok_ ABSL_GUARDED_BY(mu_) = true;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  bool retired_ ABSL_GUARDED_BY(mu_) = false;  // set by OnSessionRetired
  uint64_t sent_ ABSL_GUARDED_BY(mu_) = 0;     // bytes the client received
};

void OptimizerServiceImpl::EndStreamedSave(const std::string& name,
                                           const grpc::Status& status,
                                           uint64_t bytes, uint64_t total_bytes,
                                           double seconds) {
  if (!status.ok()) {
    checkpoint_failures_.fetch_add(1);
    log::Warn(absl::StrCat(
        "checkpoint save failed (stream): ", name,
        total_bytes == 0
            ? std::string()
            : absl::StrCat(" after ", bytes, " of ", total_bytes, " bytes"),
        ": ", status.error_message().substr(0, 500)));
    return;
  }
  checkpoint_saves_.fetch_add(1);
  checkpoint_save_bytes_.fetch_add(bytes);
  log::Info(absl::StrCat("checkpoint saved (stream): ", name, ", ", bytes,
                         " bytes, ", absl::StrFormat("%.3f", seconds), " s"));
}

grpc::ServerWriteReactor<grpc::ByteBuffer>*
OptimizerServiceImpl::SaveStateStream(grpc::CallbackServerContext* context,
                                      const grpc::ByteBuffer* bytes) {
  class Refused final : public grpc::ServerWriteReactor<grpc::ByteBuffer> {
   public:
    explicit Refused(grpc::Status s) { Finish(std::move(s)); }
    void OnDone() override { delete this; }
  };
  auto session = SessionOf(context);
  if (!session.ok()) return new Refused(ToGrpcStatus(session.status()));
  // Scanned before it is parsed (ParseHeld), held only while it is read.
  v1::SaveStateStreamRequest request;
  uint64_t held = 0;
  absl::Status parsed =
      ParseHeld(*bytes, request_budget_.get(), &request, &held);
  request_budget_->Release(held);
  if (!parsed.ok()) return new Refused(ToGrpcStatus(parsed));
  const uint64_t chunk =
      request.chunk_bytes() == 0 ? (uint64_t{4} << 20) : request.chunk_bytes();
  if (chunk > (uint64_t{64} << 20)) {
    return new Refused(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                                    "chunk_bytes may be at most 64 MiB"));
  }
  std::shared_ptr<DeviceWorker> worker = WorkerFor(*session);
  return new SaveStreamReactor(this, context, *std::move(session),
                               std::move(worker), chunk);
}

// Spools the streamed file to a private temporary file, then loads it on
// the session's worker, as LoadState loads a file: verified whole before
// any state changes. The spool file is removed on every path (and by a
// later daemon if this one is killed). The stream reads only once it holds
// its session's claim (LoadStreamClaims: a stream of the session still
// open is waited for, up to the claims' grace, then this one is refused);
// the claim ends as soon as gRPC reports the call cancelled (the client
// broke it off and may already be sending its next stream) or else before
// the call finishes.
class OptimizerServiceImpl::LoadStreamReactor final
    : public grpc::ServerReadReactor<grpc::ByteBuffer> {
 public:
  LoadStreamReactor(OptimizerServiceImpl* service,
                    grpc::CallbackServerContext* context,
                    std::shared_ptr<Session> session,
                    std::shared_ptr<DeviceWorker> worker,
                    CheckpointOptions options, grpc::ByteBuffer* out,
                    LoadStreamClaims* claims)
      : service_(service),
        name_(SessionName(session->identity())),
        start_(absl::Now()),
        context_(context),
        session_(std::move(session)),
        worker_(std::move(worker)),
        options_(std::move(options)),
        out_(out),
        claims_(claims) {
    // gRPC hands the reactor to its own threads through synchronization
    // that ThreadSanitizer cannot see (an uninstrumented library), and
    // OnCancel may run on any of them: it takes this lock before reading
    // the members set above, which orders the two where TSan can see it.
    // A session closed, evicted or reaped while its checkpoint arrives: the
    // call is cancelled (as if the client broke it off), so that a client
    // that stopped sending does not keep the session's state alive.
    on_retire_ = session_->OnRetire([this] { context_->TryCancel(); });
    { MutexLock publish(&spool_mu_); }
    if (claims_->Claim(session_.get(), this, [this](bool granted) {
          if (granted) {
            Begin();
          } else {
            Finish(grpc::Status(
                grpc::StatusCode::FAILED_PRECONDITION,
                "another LoadStateStream of this session is still arriving; "
                "a session loads one stream at a time (wait for it to end)"));
          }
        })) {
      Begin();
    }
  }

  // May run beside OnReadDone, the worker's load or the claim's outcome: it
  // takes the spool file out of its directory (before the claim passes to
  // the session's next stream) and ends the claim (or the wait for it).
  // The file's descriptor closes when the read that the cancel fails
  // returns.
  void OnCancel() override {
    Unlink();
    if (claims_->Release(session_.get(), this)) {
      Finish(Broken());
    }
  }

  void OnReadDone(bool ok) override {
    if (ok) {
      // Each chunk is scanned before it is parsed (ParseHeld), and held
      // against the request budget while it is written to the spool file.
      uint64_t held = 0;
      absl::Status parsed =
          ParseHeld(in_, service_->request_budget_.get(), &chunk_, &held);
      in_.Clear();
      const grpc::Status spooled = parsed.ok() ? Spool() : ToGrpcStatus(parsed);
      chunk_.Clear();
      service_->request_budget_->Release(held);
      if (!spooled.ok()) {
        Fail(spooled);
        return;
      }
      StartRead(&in_);
      return;
    }
    if (context_->IsCancelled()) {
      Fail(Broken());
      return;
    }
    if (total_ == 0 || received_ != total_) {
      Fail(grpc::Status(grpc::StatusCode::DATA_LOSS,
                        "the stream ended after " + std::to_string(received_) +
                            " of " + std::to_string(total_) +
                            " bytes; nothing was loaded"));
      return;
    }
    worker_->Post(session_.get(), [this] {
      const std::string path = SpoolPath();
      auto r = LoadSessionFile(*session_, path, options_);
      if (!r.ok()) {
        // The spool file is the daemon's own: the client knows its data
        // as the stream.
        End(ToGrpcStatus(absl::Status(
            r.status().code(),
            absl::StrReplaceAll(r.status().message(),
                                {{path, "the streamed checkpoint"}}))));
        return;
      }
      response_.set_path("(stream)");
      response_.set_bytes(r->bytes);
      response_.set_peak_staging_bytes(r->peak_staging_bytes);
      response_.set_seconds(r->seconds);
      End(grpc::Status::OK);
    });
  }

  void OnDone() override {
    // Cleanup first: its lock (spool_mu_, published in the constructor)
    // orders the constructor's writes, on_retire_ included, before the
    // reads here, where ThreadSanitizer can see it.
    Cleanup();
    session_->ForgetOnRetire(on_retire_);
    claims_->Release(session_.get(), this);
    delete this;
  }

 private:
  // With the session's claim: opens the spool file, reads the first chunk.
  // A call the client has broken off already (it may reach the daemon
  // after the client's next stream, and wait for that one's claim) ends
  // without a file.
  void Begin() {
    if (context_->IsCancelled()) {
      End(Broken());
      return;
    }
    log::Info(absl::StrCat("checkpoint load started (stream): ", name_));
    const std::string dir = SpoolDirectory(options_);
    int error = 0;
    {
      MutexLock lock(&spool_mu_);
      // The pid lets a later daemon remove the file if this one is killed.
      path_ = dir + "/.optimd-load-" + std::to_string(getpid()) + "-XXXXXX";
      fd_ = mkstemp(path_.data());
      if (fd_ < 0) error = errno;
    }
    if (error != 0) {
      End(ToGrpcStatus(SpoolFileError(error, "creating", dir)));
      return;
    }
    StartRead(&in_);
  }

  std::string SpoolPath() {
    MutexLock lock(&spool_mu_);
    return path_;
  }

  // Checks the parsed chunk_ and writes its bytes to the spool file.
  grpc::Status Spool() {
    if (chunk_.offset() != received_ ||
        (total_ != 0 && chunk_.total_bytes() != total_)) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          "chunks must arrive in order with one total_bytes; "
                          "expected offset " +
                              std::to_string(received_));
    }
    if (total_ == 0) {
      // A checkpoint of this session cannot be larger than its state and
      // parameters plus the header: refuse early instead of filling the
      // disk with a spool file.
      const SessionInfo info = session_->Info();
      const uint64_t limit =
          info.state_bytes + info.param_bytes + kMaxCheckpointHeaderBytes + 16;
      if (chunk_.total_bytes() > limit) {
        return grpc::Status(
            grpc::StatusCode::INVALID_ARGUMENT,
            "total_bytes " + std::to_string(chunk_.total_bytes()) +
                " exceeds what a checkpoint of this session can hold (" +
                std::to_string(limit) + " bytes)");
      }
    }
    total_ = chunk_.total_bytes();
    const std::string& d = chunk_.data();
    if (received_ + d.size() > total_) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          "chunks run past total_bytes");
    }
    int fd;
    {
      MutexLock lock(&spool_mu_);
      fd = fd_;
    }
    for (size_t done = 0; done < d.size();) {
      const ssize_t w =
          pwrite(fd, d.data() + done, d.size() - done, received_ + done);
      if (w < 0) {
        return ToGrpcStatus(
            SpoolFileError(errno, "writing", SpoolDirectory(options_)));
      }
      done += w;
    }
    received_ += d.size();
    return grpc::Status::OK;
  }

  void Fail(grpc::Status s) { End(std::move(s)); }

  // Removes the spool file, ends the session's claim, logs, then finishes.
  void End(grpc::Status s) {
    Cleanup();
    claims_->Release(session_.get(), this);
    service_->EndStreamedLoad(name_, s, s.ok() ? response_.bytes() : 0,
                              absl::ToDoubleSeconds(absl::Now() - start_));
    if (s.ok()) {
      bool own_buffer;
      s = grpc::SerializationTraits<v1::LoadStateResponse>::Serialize(
          response_, out_, &own_buffer);
    }
    Finish(std::move(s));
  }

  // The status of a stream the client broke off.
  static grpc::Status Broken() {
    return grpc::Status(grpc::StatusCode::CANCELLED,
                        "the stream broke; nothing was loaded");
  }

  // Takes the spool file out of its directory; its descriptor stays open,
  // as a write may be under way on gRPC's reading thread.
  void Unlink() {
    MutexLock lock(&spool_mu_);
    UnlinkLocked();
  }

  // Takes the spool file out of its directory, and closes it.
  void Cleanup() {
    MutexLock lock(&spool_mu_);
    if (fd_ >= 0) {
      UnlinkLocked();
      close(fd_);
      fd_ = -1;
    }
  }

  // Once only: after an Unlink the name may be another stream's file.
  void UnlinkLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(spool_mu_) {
    if (fd_ >= 0 && !unlinked_) {
      unlink(path_.c_str());
      unlinked_ = true;
    }
  }

  OptimizerServiceImpl* const service_;
  const std::string name_;
  const absl::Time start_;
  grpc::CallbackServerContext* const context_;
  const std::shared_ptr<Session> session_;
  const std::shared_ptr<DeviceWorker> worker_;
  const CheckpointOptions options_;
  grpc::ByteBuffer* const out_;
  v1::LoadStateResponse response_;
  LoadStreamClaims* const claims_;
  uint64_t on_retire_ = 0;  // Session::OnRetire's id
  // The spool file. Begin() may run on the thread of another stream's
  // cancel (the claim granted), the writes on gRPC's reading thread, the
  // load and Cleanup() on the worker or gRPC's: gRPC orders them
  // (StartRead, OnReadDone, Finish), but inside its libraries, where
  // ThreadSanitizer cannot see it, so they also meet under this mutex.
  Mutex spool_mu_;
  std::string path_ ABSL_GUARDED_BY(spool_mu_);
  int fd_ ABSL_GUARDED_BY(spool_mu_) = -1;
  bool unlinked_ ABSL_GUARDED_BY(spool_mu_) = false;
  grpc::ByteBuffer in_;
  v1::StateChunk chunk_;  // the chunk being spooled, parsed from in_
  uint64_t received_ = 0;
  uint64_t total_ = 0;
};

void OptimizerServiceImpl::EndStreamedLoad(const std::string& name,
                                           const grpc::Status& status,
                                           uint64_t bytes, double seconds) {
  if (!status.ok()) {
    checkpoint_failures_.fetch_add(1);
    log::Warn(absl::StrCat("checkpoint load failed (stream): ", name, ": ",
                           status.error_message().substr(0, 500)));
    return;
  }
  checkpoint_loads_.fetch_add(1);
  checkpoint_load_bytes_.fetch_add(bytes);
  log::Info(absl::StrCat("checkpoint loaded (stream): ", name, ", ", bytes,
                         " bytes, ", absl::StrFormat("%.3f", seconds), " s"));
}

grpc::ServerReadReactor<grpc::ByteBuffer>*
OptimizerServiceImpl::LoadStateStream(grpc::CallbackServerContext* context,
                                      grpc::ByteBuffer* response) {
  class Refused final : public grpc::ServerReadReactor<grpc::ByteBuffer> {
   public:
    explicit Refused(grpc::Status s) { Finish(std::move(s)); }
    void OnDone() override { delete this; }
  };
  auto session = SessionOf(context);
  if (!session.ok()) return new Refused(ToGrpcStatus(session.status()));
  std::shared_ptr<DeviceWorker> worker = WorkerFor(*session);
  return new LoadStreamReactor(this, context, *std::move(session),
                               std::move(worker), checkpoint_options_, response,
                               &load_stream_claims_);
}

}  // namespace optimd
