// SnapshotReservation: the host memory of one snapshot of a session's
// state (a stream being read, a background save writing), reserved against
// the daemon's state budget (its tensors' bytes) and metadata budget (its
// header, built from the tensors' names and shapes), and the session's
// count of live snapshots.
//
// Thread-compatible: one owner at a time. It may outlive its session (a
// snapshot still being streamed): it holds the budget, which outlives every
// session, and a share of the session's counter.
#ifndef OPTIMD_CORE_SNAPSHOT_RESERVATION_H_
#define OPTIMD_CORE_SNAPSHOT_RESERVATION_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <utility>

#include "core/state_budget.h"

namespace optimd {

class SnapshotReservation {
 public:
  // Takes over `bytes` of state and `metadata_bytes` of metadata already
  // reserved from `budget` and one count already added to `live`; gives
  // them back when destroyed.
  SnapshotReservation(StateBudget* budget, uint64_t bytes,
                      uint64_t metadata_bytes,
                      std::shared_ptr<std::atomic<int>> live)
      : budget_(budget),
        bytes_(bytes),
        metadata_bytes_(metadata_bytes),
        live_(std::move(live)) {}
  SnapshotReservation(SnapshotReservation&& other) noexcept
      : budget_(std::exchange(other.budget_, nullptr)),
        bytes_(std::exchange(other.bytes_, 0)),
        metadata_bytes_(std::exchange(other.metadata_bytes_, 0)),
        live_(std::move(other.live_)) {}
  SnapshotReservation& operator=(SnapshotReservation&& other) noexcept {
    if (this != &other) {
      Release();
      budget_ = std::exchange(other.budget_, nullptr);
      bytes_ = std::exchange(other.bytes_, 0);
      metadata_bytes_ = std::exchange(other.metadata_bytes_, 0);
      live_ = std::move(other.live_);
    }
    return *this;
  }
  SnapshotReservation(const SnapshotReservation&) = delete;
  SnapshotReservation& operator=(const SnapshotReservation&) = delete;
  ~SnapshotReservation() { Release(); }

  uint64_t bytes() const { return bytes_; }

 private:
  void Release() {
    if (budget_ != nullptr) budget_->Release(bytes_, metadata_bytes_);
    if (live_ != nullptr) live_->fetch_sub(1);
    budget_ = nullptr;
    bytes_ = 0;
    metadata_bytes_ = 0;
    live_.reset();
  }

  StateBudget* budget_;
  uint64_t bytes_;
  uint64_t metadata_bytes_;
  std::shared_ptr<std::atomic<int>> live_;
};

}  // namespace optimd

#endif  // OPTIMD_CORE_SNAPSHOT_RESERVATION_H_
