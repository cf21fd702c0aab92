#include "backends/cpu/handle_fuzz.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "backends/cpu/cpu_backend.h"

namespace optimd {
namespace {

// Segments of awkward sizes, made once per process under names of its own
// (SegmentName: processes running at once neither share nor unlink each
// other's): one byte, one page less one, two pages, and one of 64 MiB,
// sparse.
struct Segment {
  const char* name;
  uint64_t bytes;
};
constexpr Segment kSegments[] = {{"/optimd-fuzz-handle-1", 1},
                                 {"/optimd-fuzz-handle-4095", 4095},
                                 {"/optimd-fuzz-handle-8192", 8192},
                                 {"/optimd-fuzz-handle-64m", 64ull << 20}};
constexpr int kSegmentCount = sizeof(kSegments) / sizeof(kSegments[0]);

// This process's name of segment i.
const std::string& SegmentName(int i) {
  static const std::vector<std::string>* const names = [] {
    auto* n = new std::vector<std::string>;
    for (const Segment& s : kSegments)
      n->push_back(absl::StrCat(s.name, "-", getpid()));
    return n;
  }();
  return (*names)[i];
}

CpuBackend& FuzzBackend() {
  static CpuBackend* backend = [] {
    for (int i = 0; i < kSegmentCount; ++i) {
      const int fd = shm_open(SegmentName(i).c_str(), O_RDWR | O_CREAT, 0600);
      if (fd < 0 ||
          ftruncate(fd, static_cast<off_t>(kSegments[i].bytes)) != 0) {
        std::abort();
      }
      close(fd);
    }
    std::atexit([] {
      for (int i = 0; i < kSegmentCount; ++i) {
        shm_unlink(SegmentName(i).c_str());
      }
    });
    return new CpuBackend(CpuBackend::Options{1, 1024});
  }();
  return *backend;
}

// Little-endian integer of `n` bytes from the input, zero past its end.
uint64_t Take(const uint8_t*& data, size_t& size, int n) {
  uint64_t v = 0;
  for (int i = 0; i < n; ++i) {
    const uint64_t byte = size > 0 ? *data : 0;
    if (size > 0) {
      ++data;
      --size;
    }
    v |= byte << (8 * i);
  }
  return v;
}

// Input layout: [segment selector][offset: 8][size: 8][alignment
// exponent][name bytes, when the selector names no known segment].
BufferHandle HandleFrom(const uint8_t* data, size_t size, uint64_t* alignment) {
  BufferHandle h;
  h.kind = BufferHandle::Kind::kSharedMemory;
  const uint64_t which = Take(data, size, 1);
  h.offset = Take(data, size, 8);
  h.size = Take(data, size, 8);
  *alignment = uint64_t{1} << (Take(data, size, 1) % 8);
  if (which % 8 < kSegmentCount) {
    h.segment_name = SegmentName(static_cast<int>(which % 8));
  } else {
    h.segment_name.assign(reinterpret_cast<const char*>(data),
                          std::min<size_t>(size, 300));
  }
  return h;
}

std::string Encode(int segment, uint64_t offset, uint64_t size,
                   int alignment_log2) {
  std::string out(1, static_cast<char>(segment));
  for (uint64_t v : {offset, size}) {
    for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>(v >> (8 * i)));
  }
  out.push_back(static_cast<char>(alignment_log2));
  return out;
}

}  // namespace

absl::Status ApplyFuzzHandle(const uint8_t* data, size_t size) {
  CpuBackend& backend = FuzzBackend();
  uint64_t alignment = 1;
  const BufferHandle h = HandleFrom(data, size, &alignment);
  auto ref = backend.ResolveBuffer(h, alignment, "fuzz buffer");
  if (!ref.ok()) return ref.status();
  if (ref->size != h.size) std::abort();  // resolved to another size
  if (ref->size > 0) {
    // Inside the mapping: both ends are memory of the segment.
    volatile uint8_t* first = ref->data;
    volatile uint8_t* last = ref->data + ref->size - 1;
    *first = *first;
    *last = *last;
  }
  return absl::OkStatus();
}

absl::Status WriteHandleSeeds(const std::string& dir) {
  const std::vector<std::string> seeds = {
      Encode(0, 0, 1, 0),          Encode(1, 0, 4095, 0),
      Encode(1, 4094, 1, 0),       Encode(2, 16, 8176, 4),
      Encode(3, 4096, 1 << 20, 3), Encode(3, (64ull << 20) - 8, 8, 3),
  };
  for (size_t i = 0; i < seeds.size(); ++i) {
    std::ofstream f(absl::StrCat(dir, "/valid-", i), std::ios::binary);
    f << seeds[i];
    if (!f) return absl::InternalError("cannot write a seed");
  }
  return absl::OkStatus();
}

}  // namespace optimd

// libFuzzer's entry point (tools/fuzz.sh).
extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  (void)optimd::ApplyFuzzHandle(data, size);
  return 0;
}
