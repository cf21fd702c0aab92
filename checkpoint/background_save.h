// BackgroundSave: a session's background saves, kept with the session
// (Session::Attachment): at most one writing at a time, on a thread of its
// own, with its progress and outcome for GetSaveStatus. A session destroys
// its attachments first when it goes, so the writing thread ends before
// the session does.
//
// Thread-safe. Status never waits for a step or for the write.
#ifndef OPTIMD_CHECKPOINT_BACKGROUND_SAVE_H_
#define OPTIMD_CHECKPOINT_BACKGROUND_SAVE_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/snapshot.h"
#include "common/mutex.h"
#include "core/session_attachment.h"

namespace optimd {

// A background save's progress and outcome (GetSaveStatus).
struct SaveStatusInfo {
  enum State { kNone, kRunning, kSucceeded, kFailed } state = kNone;
  std::string path;
  uint64_t bytes_written = 0;
  uint64_t total_bytes = 0;
  absl::Status error;
  double seconds = 0;
};

class BackgroundSave final : public SessionAttachment {
 public:
  BackgroundSave() = default;
  // Waits for a save still writing.
  ~BackgroundSave() override;

  // FAILED_PRECONDITION while a save is still writing (naming it and its
  // progress); otherwise joins the thread of the last one, which has ended.
  absl::Status CheckIdle() ABSL_LOCKS_EXCLUDED(mu_);
  // Writes `snapshot` to `path` on a thread of its own, replacing the
  // record of the last save (which CheckIdle found ended). `on_written`, if
  // given, is called on that thread once the write has ended (succeeded or
  // failed). Seconds count from `started`.
  void Start(std::string path, std::shared_ptr<CheckpointSnapshot> snapshot,
             CheckpointOptions options,
             std::function<void(const SaveStatusInfo&)> on_written,
             std::chrono::steady_clock::time_point started)
      ABSL_LOCKS_EXCLUDED(mu_);
  // The last save's progress (kNone before the first).
  SaveStatusInfo Status() const ABSL_LOCKS_EXCLUDED(mu_);
  // Waits until a save that is still writing has ended; true when there
  // was one.
  bool Wait() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  // One save: written by its thread, read by status calls.
  struct Write {
    SaveProgress progress;
    std::thread thread;
    std::string path;
    std::atomic<bool> done{false};
    absl::Status result;  // valid once done
    double seconds = 0;   // likewise
  };
  static SaveStatusInfo StatusOf(const Write& write);

  mutable Mutex mu_;
  std::unique_ptr<Write> write_ ABSL_GUARDED_BY(mu_);
};

}  // namespace optimd

#endif  // OPTIMD_CHECKPOINT_BACKGROUND_SAVE_H_
