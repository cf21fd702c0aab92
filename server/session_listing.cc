#include "server/session_listing.h"

#include "server/convert.h"

namespace optimd {

uint32_t AddSessionInfos(
    size_t count, const std::function<SessionInfo(size_t)>& info_of,
    google::protobuf::RepeatedPtrField<v1::SessionInfo>* out,
    size_t max_bytes) {
  size_t bytes = 0;
  uint32_t omitted = 0;
  for (size_t i = 0; i < count; ++i) {
    v1::SessionInfo info;
    SessionInfoToProto(info_of(i), &info);
    // The entry's encoded size plus its tag and length prefix.
    const size_t n = info.ByteSizeLong() + 8;
    if (bytes + n > max_bytes) {
      ++omitted;
      continue;
    }
    bytes += n;
    *out->Add() = std::move(info);
  }
  return omitted;
}

}  // namespace optimd
