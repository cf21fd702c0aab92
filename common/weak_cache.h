// A cache of shared objects by key that keeps none of them alive: whoever
// holds an object keeps it, and the cache finds it while anyone does (the
// backends' mappings of trainer buffers: shared-memory segments, CUDA IPC
// allocations). Not thread-safe: the owner locks around it.
#ifndef OPTIMD_COMMON_WEAK_CACHE_H_
#define OPTIMD_COMMON_WEAK_CACHE_H_

#include <map>
#include <memory>
#include <string>

namespace optimd {

template <class T>
class WeakCache {
 public:
  // The live object under `key`, or null.
  std::shared_ptr<T> Find(const std::string& key) const {
    auto it = entries_.find(key);
    return it == entries_.end() ? nullptr : it->second.lock();
  }

  // Remembers `value` under `key`, and forgets the entries whose objects
  // are gone, so that the cache holds no more entries than live objects
  // plus one.
  void Put(const std::string& key, const std::shared_ptr<T>& value) {
    entries_[key] = value;
    for (auto it = entries_.begin(); it != entries_.end();) {
      it = it->second.expired() ? entries_.erase(it) : std::next(it);
    }
  }

  // Objects still alive.
  int Live() const {
    int n = 0;
    for (const auto& [key, weak] : entries_) n += weak.expired() ? 0 : 1;
    return n;
  }

 private:
  std::map<std::string, std::weak_ptr<T>> entries_;
};

}  // namespace optimd

#endif  // OPTIMD_COMMON_WEAK_CACHE_H_
