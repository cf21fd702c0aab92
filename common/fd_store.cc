#include "common/fd_store.h"

#include <fcntl.h>

#include <cerrno>
#include <cstring>
#include <iterator>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"

namespace optimd {

absl::Status FdStore::Put(uint64_t owner, const std::vector<std::string>& ids,
                          std::vector<UniqueFd> fds) {
  if (ids.size() != fds.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        ids.size(), " ids for ", fds.size(), " descriptors: one id each"));
  }
  // Nothing to keep: no owner entry is made for it either.
  if (fds.empty()) return absl::OkStatus();
  std::set<std::string> seen;
  for (const std::string& id : ids) {
    if (id.size() != kIdBytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          "a descriptor id is ", kIdBytes, " bytes, got ", id.size()));
    }
    if (!seen.insert(id).second) {
      return absl::InvalidArgumentError("a descriptor id given twice");
    }
  }
  MutexLock lock(&mu_);
  for (const std::string& id : ids) {
    if (entries_.count(id) != 0) {
      return absl::InvalidArgumentError(
          "a descriptor id already held: choose ids at random");
    }
  }
  size_t& mine = per_owner_[owner];
  if (entries_.size() + fds.size() > max_total_ ||
      mine + fds.size() > max_per_owner_) {
    if (mine == 0) per_owner_.erase(owner);
    return absl::ResourceExhaustedError(absl::StrCat(
        "the daemon holds at most ", max_per_owner_,
        " descriptors per connection (", max_total_,
        " in all): a trainer that names more chunks of CUDA memory starts "
        "a new connection, and so forgets those it sent before"));
  }
  for (size_t i = 0; i < ids.size(); ++i) {
    entries_[ids[i]] = Entry{owner, std::move(fds[i])};
  }
  mine += fds.size();
  return absl::OkStatus();
}

namespace {

absl::Status NotHeld() {
  return absl::NotFoundError(
      "no descriptor under this id: the trainer sends it over the "
      "daemon's descriptor socket (<socket>.fds) first, and keeps that "
      "connection open while the daemon may map its memory");
}

}  // namespace

absl::StatusOr<UniqueFd> FdStore::Dup(const std::string& id) const {
  MutexLock lock(&mu_);
  auto it = entries_.find(id);
  if (it == entries_.end()) return NotHeld();
  UniqueFd copy(fcntl(it->second.fd.get(), F_DUPFD_CLOEXEC, 0));
  if (!copy.valid()) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "cannot duplicate a trainer's descriptor: ", std::strerror(errno)));
  }
  return copy;
}

absl::Status FdStore::Held(const std::string& id) const {
  MutexLock lock(&mu_);
  return entries_.count(id) != 0 ? absl::OkStatus() : NotHeld();
}

void FdStore::DropOwner(uint64_t owner) {
  MutexLock lock(&mu_);
  for (auto it = entries_.begin(); it != entries_.end();) {
    it = it->second.owner == owner ? entries_.erase(it) : std::next(it);
  }
  per_owner_.erase(owner);
}

size_t FdStore::size() const {
  MutexLock lock(&mu_);
  return entries_.size();
}

}  // namespace optimd
