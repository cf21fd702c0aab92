// UniqueFd: a file descriptor that is closed when its owner goes away.
//
// Thread-compatible: one owner at a time.
#ifndef OPTIMD_COMMON_UNIQUE_FD_H_
#define OPTIMD_COMMON_UNIQUE_FD_H_

#include <unistd.h>

#include <utility>

namespace optimd {

class UniqueFd {
 public:
  // Owns `fd`; a negative value owns nothing.
  explicit UniqueFd(int fd = -1) : fd_(fd) {}
  UniqueFd(UniqueFd&& other) noexcept : fd_(other.release()) {}
  UniqueFd& operator=(UniqueFd&& other) noexcept {
    reset(other.release());
    return *this;
  }
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  ~UniqueFd() { reset(); }

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }

  // Closes the descriptor held, if any, and owns `fd` instead.
  void reset(int fd = -1) {
    if (fd_ >= 0) close(fd_);
    fd_ = fd;
  }

  // Gives the descriptor up without closing it.
  int release() { return std::exchange(fd_, -1); }

 private:
  int fd_;
};

}  // namespace optimd

#endif  // OPTIMD_COMMON_UNIQUE_FD_H_
