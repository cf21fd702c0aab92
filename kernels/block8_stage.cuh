// Staging of a whole block8 block (kBlock8Elements elements) in shared
// memory: while a warp computes one block, its lanes copy the next one's
// streams (weight, gradient, remainders, both moments' codes, the scales)
// from global memory with cp.async, which holds no registers; the block's
// loads then read shared memory instead of waiting for memory.
//
// A warp owns two slots of Block8Stage::kBytes and alternates between
// them: block i is read from slot i % 2 while block i + 1 is copied into
// the other. Device functions only; each called by every lane of a warp.
#ifndef OPTIMD_KERNELS_BLOCK8_STAGE_CUH_
#define OPTIMD_KERNELS_BLOCK8_STAGE_CUH_

#include <cuda_runtime.h>

#include <cstdint>

#include "core/block8.h"

namespace optimd {
namespace cuda {

// Where each stream of a staged block lies in its slot, for weight
// elements of kWeight bytes, gradient elements of kGrad bytes, and with
// kRem the 2-byte remainders: each at the offset of element 0, so a lane
// reads its elements at the offsets a tile gives them.
template <uint32_t kWeight, uint32_t kGrad, bool kRem>
struct Block8Stage {
  static constexpr uint32_t kElements = kBlock8Elements;
  static constexpr uint32_t kGradAt = kElements * kWeight;
  static constexpr uint32_t kRemAt = kGradAt + kElements * kGrad;
  static constexpr uint32_t kExpAvgAt = kRemAt + (kRem ? kElements * 2 : 0);
  static constexpr uint32_t kExpAvgSqAt = kExpAvgAt + kElements;
  static constexpr uint32_t kScalesAt = kExpAvgSqAt + kElements;
  static constexpr uint32_t kBytes = kScalesAt + 16;  // two fp32 scales
  static_assert(kBytes % 16 == 0, "16-byte copies");
};

__device__ __forceinline__ uint32_t SharedAddress(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// The lane's share of an asynchronous copy of kBytes (a multiple of 16;
// both addresses 16-byte aligned) from global `src` to shared `dst`, in
// 16-byte pieces: piece j by lane j % 32.
template <uint32_t kBytes>
__device__ __forceinline__ void StageBytes(char* dst, const char* src) {
  static_assert(kBytes % 16 == 0, "16-byte pieces");
#pragma unroll
  for (uint32_t at = 0; at < kBytes; at += 32 * 16) {
    const uint32_t piece = at + 16 * (threadIdx.x & 31);
    if (kBytes % (32 * 16) == 0 || piece < kBytes) {
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(
                       SharedAddress(dst + piece)),
                   "l"(src + piece)
                   : "memory");
    }
  }
}

// 8 bytes from global `src` to shared `dst` (both 8-byte aligned), by the
// calling lane.
__device__ __forceinline__ void Stage8Bytes(char* dst, const char* src) {
  asm volatile(
      "cp.async.ca.shared.global [%0], [%1], 8;" ::"r"(SharedAddress(dst)),
      "l"(src)
      : "memory");
}

// Closes the lane's copies issued since the last call into one group.
__device__ __forceinline__ void CommitStage() {
  asm volatile("cp.async.commit_group;" ::: "memory");
}

// Waits until every group of the lane's copies but the newest is complete,
// then for the warp's other lanes to do the same: the slot that the
// next-to-last group filled can be read by any lane.
__device__ __forceinline__ void WaitForStageButNewest() {
  asm volatile("cp.async.wait_group 1;" ::: "memory");
  __syncwarp();
}

// A lane's 8 elements (a tile's positions: 4 * lane + j and 128 + 4 * lane
// + j) of a staged stream of kBytes-byte elements, as the words LoadTile
// gives.
template <int kBytes>
__device__ __forceinline__ void LoadStagedTile(const char* s, uint32_t* w) {
  const uint32_t lane = threadIdx.x & 31;
  if constexpr (kBytes == 4) {
    const uint4 a = *reinterpret_cast<const uint4*>(s + 16 * lane);
    const uint4 b = *reinterpret_cast<const uint4*>(s + 512 + 16 * lane);
    w[0] = a.x, w[1] = a.y, w[2] = a.z, w[3] = a.w;
    w[4] = b.x, w[5] = b.y, w[6] = b.z, w[7] = b.w;
  } else {
    static_assert(kBytes == 2, "2- or 4-byte elements");
    const uint2 a = *reinterpret_cast<const uint2*>(s + 8 * lane);
    const uint2 b = *reinterpret_cast<const uint2*>(s + 256 + 8 * lane);
    w[0] = a.x, w[1] = a.y, w[2] = b.x, w[3] = b.y;
  }
}

// A lane's 8 codes of a staged 1-byte stream, in the order LoadCodes
// gives them (Block8Offset).
__device__ __forceinline__ void LoadStagedCodes(const char* s, uint8_t* c) {
  const uint32_t lane = threadIdx.x & 31;
  const uint32_t a = *reinterpret_cast<const uint32_t*>(s + 4 * lane);
  const uint32_t b = *reinterpret_cast<const uint32_t*>(s + 128 + 4 * lane);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    c[j] = static_cast<uint8_t>(a >> (8 * j));
    c[j + 4] = static_cast<uint8_t>(b >> (8 * j));
  }
}

}  // namespace cuda
}  // namespace optimd

#endif  // OPTIMD_KERNELS_BLOCK8_STAGE_CUH_
