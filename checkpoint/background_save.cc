#include "checkpoint/background_save.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace optimd {

BackgroundSave::~BackgroundSave() {
  MutexLock lock(&mu_);
  if (write_ != nullptr && write_->thread.joinable()) write_->thread.join();
}

absl::Status BackgroundSave::CheckIdle() {
  MutexLock lock(&mu_);
  if (write_ != nullptr && !write_->done.load()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "a background save to ", write_->path, " is still writing (",
        write_->progress.bytes_written.load(), " of ",
        write_->progress.total_bytes.load(),
        " bytes); wait for it (GetSaveStatus) before saving again"));
  }
  if (write_ != nullptr && write_->thread.joinable()) write_->thread.join();
  return absl::OkStatus();
}

void BackgroundSave::Start(
    std::string path, std::shared_ptr<CheckpointSnapshot> snapshot,
    CheckpointOptions options,
    std::function<void(const SaveStatusInfo&)> on_written,
    std::chrono::steady_clock::time_point started) {
  auto write = std::make_unique<Write>();
  write->path = std::move(path);
  Write* raw = write.get();
  raw->thread = std::thread([raw, snapshot = std::move(snapshot),
                             options = std::move(options), started,
                             on_written = std::move(on_written)] {
    auto r = WriteSnapshot(raw->path, *snapshot, options, &raw->progress);
    raw->result = r.status();
    raw->seconds = std::chrono::duration<double>(
                       std::chrono::steady_clock::now() - started)
                       .count();
    raw->done.store(true);
    if (on_written) on_written(StatusOf(*raw));
  });
  MutexLock lock(&mu_);
  // The last save has ended (CheckIdle): its thread is joined at once.
  if (write_ != nullptr && write_->thread.joinable()) write_->thread.join();
  write_ = std::move(write);
}

SaveStatusInfo BackgroundSave::StatusOf(const Write& write) {
  SaveStatusInfo info;
  info.path = write.path;
  info.bytes_written = write.progress.bytes_written.load();
  info.total_bytes = write.progress.total_bytes.load();
  if (!write.done.load()) {
    info.state = SaveStatusInfo::kRunning;
    return info;
  }
  info.state =
      write.result.ok() ? SaveStatusInfo::kSucceeded : SaveStatusInfo::kFailed;
  info.error = write.result;
  info.seconds = write.seconds;
  return info;
}

SaveStatusInfo BackgroundSave::Status() const {
  MutexLock lock(&mu_);
  if (write_ == nullptr) return SaveStatusInfo();
  return StatusOf(*write_);
}

bool BackgroundSave::Wait() {
  MutexLock lock(&mu_);
  if (write_ == nullptr || !write_->thread.joinable()) return false;
  const bool running = !write_->done.load();
  write_->thread.join();
  return running;
}

}  // namespace optimd
