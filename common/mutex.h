// optimd::Mutex and optimd::MutexLock: Mutex, told to ThreadSanitizer.
//
// Debian's Abseil is not built with -fsanitize=thread, so TSan cannot see
// Mutex's own synchronization and would report every hand-off of
// guarded data between threads as a race. Under TSan (tools/test.sh's
// --config=tsan), these wrappers announce each lock and unlock through
// TSan's mutex annotations; otherwise they are Mutex itself, inline.
// Clang's -Wthread-safety analysis sees them as Mutex.
#ifndef OPTIMD_COMMON_MUTEX_H_
#define OPTIMD_COMMON_MUTEX_H_

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

#if defined(__SANITIZE_THREAD__)
#define OPTIMD_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define OPTIMD_TSAN 1
#endif
#endif

#ifdef OPTIMD_TSAN
#include <sanitizer/tsan_interface.h>
#endif

namespace optimd {

class ABSL_LOCKABLE Mutex {
 public:
  Mutex() {
#ifdef OPTIMD_TSAN
    __tsan_mutex_create(this, 0);
#endif
  }
  ~Mutex() {
#ifdef OPTIMD_TSAN
    __tsan_mutex_destroy(this, 0);
#endif
  }
  Mutex(const Mutex&) = delete;
  Mutex& operator=(const Mutex&) = delete;

  void Lock() ABSL_EXCLUSIVE_LOCK_FUNCTION() {
#ifdef OPTIMD_TSAN
    __tsan_mutex_pre_lock(this, 0);
#endif
    mu_.Lock();
#ifdef OPTIMD_TSAN
    __tsan_mutex_post_lock(this, 0, 0);
#endif
  }
  void Unlock() ABSL_UNLOCK_FUNCTION() {
#ifdef OPTIMD_TSAN
    __tsan_mutex_pre_unlock(this, 0);
#endif
    mu_.Unlock();
#ifdef OPTIMD_TSAN
    __tsan_mutex_post_unlock(this, 0);
#endif
  }
  // Releases the mutex until pred(arg) holds, then holds it again, as
  // absl::Mutex::Await(absl::Condition(pred, arg)). absl evaluates the
  // predicate with the mutex held (in this thread or in one unlocking it):
  // under TSan each evaluation is announced as a lock of its own.
  template <typename T>
  void Await(bool (*pred)(T*), T* arg) ABSL_EXCLUSIVE_LOCKS_REQUIRED(this) {
    AwaitWithDeadline(pred, arg, absl::InfiniteFuture());
  }
  // As Await, giving up at `deadline`: whether pred(arg) holds on return.
  template <typename T>
  bool AwaitWithDeadline(bool (*pred)(T*), T* arg, absl::Time deadline)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(this) {
    struct Eval {
      Mutex* mu;
      bool (*pred)(T*);
      T* arg;
    };
    Eval eval{this, pred, arg};
    Announce(false);
    const absl::Condition condition(
        +[](Eval* e) {
          e->mu->Announce(true);
          const bool held = e->pred(e->arg);
          e->mu->Announce(false);
          return held;
        },
        &eval);
    const bool holds = mu_.AwaitWithDeadline(condition, deadline);
    Announce(true);
    return holds;
  }
  void AssertHeld() const ABSL_ASSERT_EXCLUSIVE_LOCK() { mu_.AssertHeld(); }

 private:
  // Tells TSan the mutex was just taken (or is about to be released).
  void Announce([[maybe_unused]] bool locked) {
#ifdef OPTIMD_TSAN
    if (locked) {
      __tsan_mutex_pre_lock(this, 0);
      __tsan_mutex_post_lock(this, 0, 0);
    } else {
      __tsan_mutex_pre_unlock(this, 0);
      __tsan_mutex_post_unlock(this, 0);
    }
#endif
  }

  absl::Mutex mu_;
};

class ABSL_SCOPED_LOCKABLE MutexLock {
 public:
  explicit MutexLock(Mutex* mu) ABSL_EXCLUSIVE_LOCK_FUNCTION(mu) : mu_(mu) {
    mu_->Lock();
  }
  ~MutexLock() ABSL_UNLOCK_FUNCTION() { mu_->Unlock(); }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

 private:
  Mutex* const mu_;
};

}  // namespace optimd

#endif  // OPTIMD_COMMON_MUTEX_H_
