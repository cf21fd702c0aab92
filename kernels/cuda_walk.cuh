// Device code every CUDA step kernel shares: element types and their
// conversions, vector tile accesses, fp32 masters kept as remainders, the
// walk over a work block, a weight's load and store for each master kind,
// and block sums. Included by the .cu files of kernels/ only (nvcc).
#ifndef OPTIMD_KERNELS_CUDA_WALK_CUH_
#define OPTIMD_KERNELS_CUDA_WALK_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "core/block8.h"
#include "core/fp8.h"
#include "core/layout.h"
#include "kernels/cuda_math.cuh"
#include "kernels/cuda_step_types.h"

namespace optimd {
namespace cuda {

// Element types. Store: round to nearest even, keeping a NaN's sign and
// payload as the CPU reference does (F16: the hardware conversion, whose
// NaN may differ from the reference's in its bits). Round: the same for every
// value but NaN, which it may make the canonical NaN: the step kernels store
// with it only results of GPU arithmetic, whose NaNs are canonical already, and
// for those both agree (tests/cuda_math_test checks every float).
//
// A lane's share of a tile (8 elements, see LoadTile) travels as kTileWords
// 32-bit words: Unpack turns them into floats, Pack rounds floats into
// them as Round does (two 16-bit elements per word: one conversion
// instruction).
struct F32 {
  using T = float;
  static constexpr int kTileWords = 8;
  __device__ static float Load(T x) { return x; }
  __device__ static T Store(float x) { return x; }
  __device__ static T Round(float x) { return x; }
  __device__ static void Unpack(const uint32_t* w, float* x) {
#pragma unroll
    for (int k = 0; k < 8; ++k) x[k] = __uint_as_float(w[k]);
  }
  __device__ static void Pack(const float* x, uint32_t* w) {
#pragma unroll
    for (int k = 0; k < 8; ++k) w[k] = __float_as_uint(x[k]);
  }
};
struct BF16 {
  using T = uint16_t;
  static constexpr int kTileWords = 4;
  __device__ static float Load(T x) {
    return __uint_as_float(static_cast<uint32_t>(x) << 16);
  }
  __device__ static T Store(float x) { return Bf16FromFloat(x); }
  // One conversion instruction instead of about seven.
  __device__ static T Round(float x) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(x));
  }
  __device__ static void Unpack(const uint32_t* w, float* x) {
#pragma unroll
    for (int j = 0; j < 4; ++j) UnpackBf16x2(w[j], &x[2 * j], &x[2 * j + 1]);
  }
  __device__ static void Pack(const float* x, uint32_t* w) {
#pragma unroll
    for (int j = 0; j < 4; ++j) w[j] = PackBf16x2(x[2 * j], x[2 * j + 1]);
  }
};
struct F16 {
  using T = uint16_t;
  static constexpr int kTileWords = 4;
  __device__ static float Load(T x) {
    return __half2float(__ushort_as_half(x));
  }
  __device__ static T Store(float x) {
    return __half_as_ushort(__float2half_rn(x));
  }
  __device__ static T Round(float x) { return Store(x); }
  __device__ static void Unpack(const uint32_t* w, float* x) {
#pragma unroll
    for (int j = 0; j < 4; ++j) UnpackF16x2(w[j], &x[2 * j], &x[2 * j + 1]);
  }
  __device__ static void Pack(const float* x, uint32_t* w) {
#pragma unroll
    for (int j = 0; j < 4; ++j) w[j] = PackF16x2(x[2 * j], x[2 * j + 1]);
  }
};

// float64 layouts only (parameter, gradient and moments; ResolveLayout):
// their kernels read and write doubles element by element, so F64 has no
// tile codec.
struct F64 {
  using T = double;
};

// FP8 parameters (core/fp8.h): the update kernels read and write their
// fp32 masters only (StoreWeight leaves the parameter alone); the codes
// and scale inverses are written after each warp block's update
// (kernels/fp8_cuda.cuh) or by the encode pass (kernels/fp8_cuda.h).
// Dispatched only to launchers that declare `static constexpr bool
// kTakesFp8 = true` (TakesFp8), with kFp32 masters.
template <const Fp8Format& F>
struct Fp8Param {
  using T = uint8_t;
};

template <class P>
struct IsFp8Param : std::false_type {};
template <const Fp8Format& F>
struct IsFp8Param<Fp8Param<F>> : std::true_type {};

// A tile lane's elements one by one (f(i) for each), for kernels that
// read and write them singly (the float64 layout, which has no tile
// codec): i..i+3 and i+128..i+131, LoadTile's order.
template <class F>
__device__ __forceinline__ void ForEachTileLaneElement(uint64_t i, F f) {
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    f(i + j);
    f(i + kTileElements / 2 + j);
  }
}

// Plain (weak, default-cached) global vector accesses. The compiler cannot
// tell that a pointer read from a shared-memory descriptor is global: it
// emitted generic accesses, and split some vector stores. Explicit
// ld/st.global are faster for many small tensors and the same for large
// ones; streaming hints (ld/st.global.cs) and L2 prefetch hints are
// slower, and the cache-operator intrinsics __ldca/__stwb compile to
// strong .STRONG.SM accesses. The measurements: bench/RESULTS.md, "CUDA
// backend on one H200, training-like gradients" (kernel variants) and
// "... flattened work blocks and step graphs" (cache hints).
__device__ __forceinline__ uint4 LoadGlobal(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}
__device__ __forceinline__ uint2 LoadGlobal(const uint2* p) {
  uint2 v;
  asm volatile("ld.global.v2.u32 {%0, %1}, [%2];"
               : "=r"(v.x), "=r"(v.y)
               : "l"(p));
  return v;
}
__device__ __forceinline__ void StoreGlobal(uint4* p, uint4 v) {
  asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x),
               "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}
__device__ __forceinline__ void StoreGlobal(uint2* p, uint2 v) {
  asm volatile("st.global.v2.u32 [%0], {%1, %2};" ::"l"(p), "r"(v.x), "r"(v.y)
               : "memory");
}

// A lane's share of the tile at i - 4 * lane, as 32-bit words: elements
// i..i+3 and i+128..i+131, so each access of a warp covers 32 consecutive
// 8- or 16-byte pieces. `half` (a multiple of 4): where the second four
// lie instead, i + half.. (the unit walk's rows, kernels/fp8_cuda.cuh).
constexpr uint32_t kTileHalf = kTileElements / 2;
template <int kBytes>
__device__ __forceinline__ void LoadTile(const void* base, uint64_t i,
                                         uint32_t* w,
                                         uint64_t half = kTileHalf) {
  if constexpr (kBytes == 4) {
    const uint4* p =
        reinterpret_cast<const uint4*>(static_cast<const uint32_t*>(base) + i);
    const uint4 a = LoadGlobal(p), b = LoadGlobal(p + half / 4);
    w[0] = a.x, w[1] = a.y, w[2] = a.z, w[3] = a.w;
    w[4] = b.x, w[5] = b.y, w[6] = b.z, w[7] = b.w;
  } else {
    static_assert(kBytes == 2, "2- or 4-byte elements");
    const uint2* p =
        reinterpret_cast<const uint2*>(static_cast<const uint16_t*>(base) + i);
    const uint2 a = LoadGlobal(p), b = LoadGlobal(p + half / 4);
    w[0] = a.x, w[1] = a.y, w[2] = b.x, w[3] = b.y;
  }
}

template <int kBytes>
__device__ __forceinline__ void StoreTile(void* base, uint64_t i,
                                          const uint32_t* w,
                                          uint64_t half = kTileHalf) {
  if constexpr (kBytes == 4) {
    uint4* p = reinterpret_cast<uint4*>(static_cast<uint32_t*>(base) + i);
    StoreGlobal(p, make_uint4(w[0], w[1], w[2], w[3]));
    StoreGlobal(p + half / 4, make_uint4(w[4], w[5], w[6], w[7]));
  } else {
    static_assert(kBytes == 2, "2- or 4-byte elements");
    uint2* p = reinterpret_cast<uint2*>(static_cast<uint16_t*>(base) + i);
    StoreGlobal(p, make_uint2(w[0], w[1]));
    StoreGlobal(p + half / 4, make_uint2(w[2], w[3]));
  }
}

// Elements of one stream of type X as floats. N == 8: a lane's share of a
// tile (LoadTile, its second four at i + half). N == 1: element i alone.
template <int N, class X>
__device__ __forceinline__ void LoadF(const void* base, uint64_t i, float* x,
                                      uint64_t half = kTileHalf) {
  if constexpr (N == 1) {
    x[0] = X::Load(static_cast<const typename X::T*>(base)[i]);
  } else {
    static_assert(N == 8, "a tile lane holds 8 elements");
    uint32_t w[X::kTileWords];
    LoadTile<sizeof(typename X::T)>(base, i, w, half);
    X::Unpack(w, x);
  }
}

// Stores floats rounded to X (X::Round: results of GPU arithmetic only).
template <int N, class X>
__device__ __forceinline__ void StoreF(void* base, uint64_t i, const float* x,
                                       uint64_t half = kTileHalf) {
  if constexpr (N == 1) {
    static_cast<typename X::T*>(base)[i] = X::Round(x[0]);
  } else {
    static_assert(N == 8, "a tile lane holds 8 elements");
    uint32_t w[X::kTileWords];
    X::Pack(x, w);
    StoreTile<sizeof(typename X::T)>(base, i, w, half);
  }
}

// fp32 masters kept as bfloat16 parameters and 16-bit remainders.
template <int N>
__device__ __forceinline__ void LoadRemainderMasters(
    const void* param, const void* rem, uint64_t i, float* x,
    uint64_t half = kTileHalf) {
  if constexpr (N == 1) {
    x[0] = ReconstructFromRemainder(static_cast<const uint16_t*>(param)[i],
                                    static_cast<const int16_t*>(rem)[i]);
  } else {
    uint32_t h[4], r[4];
    LoadTile<2>(param, i, h, half);
    LoadTile<2>(rem, i, r, half);
    ReconstructFromRemainder8(h, r, x);
  }
}

template <int N>
__device__ __forceinline__ void StoreRemainderMasters(
    void* param, void* rem, uint64_t i, const float* x,
    uint64_t half = kTileHalf) {
  if constexpr (N == 1) {
    SplitToRemainder(x[0], static_cast<uint16_t*>(param) + i,
                     static_cast<int16_t*>(rem) + i);
  } else {
    uint32_t h[4], r[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      SplitToRemainder2(x[2 * j], x[2 * j + 1], &h[j], &r[j]);
    }
    StoreTile<2>(param, i, h, half);
    StoreTile<2>(rem, i, r, half);
  }
}

// Walks work block blockIdx.x of `work`: its item descriptors are copied
// into shared memory once, then the block is one flattened space of tiles
// (one warp each) and one of scalar elements (one thread each), so tensor
// boundaries cost no idle lanes beyond an item's last partial tile and no
// dependent loads of descriptors. body.Prepare(items, n), run by every
// thread once the descriptors are in shared memory, derives per-item
// values for the walk; body.Tile(item, k, i) handles a lane's share of the
// tile at i - 4 * lane of the block's item k; body.Scalar(item, k, i)
// element i.
// (Fewer thread blocks, each walking many work blocks and prefetching the
// next one's descriptors, measured slower on the H200: bench/RESULTS.md.)
// Copies the item descriptors of `block` into shared memory `buffer` (by
// all threads; the caller synchronizes); returns their count.
__device__ __forceinline__ uint32_t CopyItems(const Work& work,
                                              const DeviceBlock& block,
                                              uint4* buffer) {
  const uint32_t n = block.end - block.first;
  const uint4* src = reinterpret_cast<const uint4*>(work.items + block.first);
  const uint32_t pieces = n * static_cast<uint32_t>(sizeof(DeviceItem) / 16);
  for (uint32_t i = threadIdx.x; i < pieces; i += blockDim.x) {
    buffer[i] = src[i];
  }
  return n;
}

template <class Body>
__device__ __forceinline__ void Walk(const Work& work, Body& body) {
  __shared__ uint4 buffer[kMaxItemsPerBlock * sizeof(DeviceItem) / 16];
  // tile_end[k], scalar_end[k]: tiles and scalar elements of items <= k.
  __shared__ uint32_t tile_end[kMaxItemsPerBlock];
  __shared__ uint32_t scalar_end[kMaxItemsPerBlock];
  const DeviceItem* cs = reinterpret_cast<const DeviceItem*>(buffer);
  const DeviceBlock block = work.blocks[blockIdx.x];
  const uint32_t n = CopyItems(work, block, buffer);
  __syncthreads();
  if (threadIdx.x == 0) {
    uint32_t tiles = 0, scalars = 0;
    for (uint32_t k = 0; k < n; ++k) {
      tiles += cs[k].tiles;
      scalars += static_cast<uint32_t>(cs[k].end - cs[k].begin) -
                 cs[k].tiles * kTileElements;
      tile_end[k] = tiles;
      scalar_end[k] = scalars;
    }
  }
  body.Prepare(cs, n);
  __syncthreads();
  const uint32_t lane = threadIdx.x & 31, warp = threadIdx.x >> 5,
                 warps = blockDim.x >> 5;
  uint32_t k = 0;
  for (uint32_t t = warp; t < block.tiles; t += warps) {
    while (t >= tile_end[k]) ++k;
    const DeviceItem& c = cs[k];
    const uint32_t first = tile_end[k] - c.tiles;
    body.Tile(
        c, k,
        c.begin + static_cast<uint64_t>(t - first) * kTileElements + 4 * lane);
  }
  k = 0;
  for (uint32_t e = threadIdx.x; e < block.scalars; e += blockDim.x) {
    while (e >= scalar_end[k]) ++k;
    const DeviceItem& c = cs[k];
    const uint32_t first = k == 0 ? 0 : scalar_end[k - 1];
    body.Scalar(
        c, k,
        c.begin + static_cast<uint64_t>(c.tiles) * kTileElements + (e - first));
  }
}

// Walks work block blockIdx.x of `work` for block8 moments: one warp per
// block8 block (kBlock8Elements consecutive elements of an item; an item's
// last block may be shorter), since a block's scale is the maximum over
// all its new values. Items start on block8 blocks (BuildPlan), so no
// block straddles two items or two work blocks. body.Prepare as for Walk;
// body.Block(item, k, first, n): the n elements from `first` of the
// block's item k, by the whole warp; body.Prefetch(item, first, n), by the
// whole warp: once with the arguments of the warp's first Block, before
// Prepare (so that its loads overlap Prepare), then before each Block with
// those of the Block after it (n = 0 where there is none), so a body can fetch
// one block ahead; body.Finish(items, n), by every thread once all of the work
// block's elements are done.
template <class Body>
__device__ __forceinline__ void WalkBlocks8(const Work& work, Body& body) {
  __shared__ uint4 buffer[kMaxItemsPerBlock * sizeof(DeviceItem) / 16];
  // block_end[k]: block8 blocks of items <= k.
  __shared__ uint32_t block_end[kMaxItemsPerBlock];
  const DeviceItem* cs = reinterpret_cast<const DeviceItem*>(buffer);
  const uint32_t n = CopyItems(work, work.blocks[blockIdx.x], buffer);
  __syncthreads();
  const uint32_t warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const auto blocks_of = [&](uint32_t k) {
    return static_cast<uint32_t>(Block8Blocks(cs[k].end - cs[k].begin));
  };
  // Block b of item k, whose first block is block `first` of the work
  // block: its first element.
  const auto start_in = [&](uint32_t b, uint32_t k, uint32_t first) {
    return cs[k].begin + static_cast<uint64_t>(b - first) * kBlock8Elements;
  };
  const auto length_of = [&](uint32_t k, uint64_t start) {
    const uint64_t left = cs[k].end - start;
    return static_cast<uint32_t>(left < kBlock8Elements ? left
                                                        : kBlock8Elements);
  };
  // The warp's first block (block `warp`), found by counting items' blocks
  // here rather than through block_end, so that its Prefetch starts before
  // Prepare and the barrier after it.
  {
    uint32_t k = 0, first = 0;
    while (k < n && warp >= first + blocks_of(k)) first += blocks_of(k++);
    if (k < n) {
      const uint64_t start = start_in(warp, k, first);
      body.Prefetch(cs[k], start, length_of(k, start));
    }
  }
  if (threadIdx.x == 0) {
    uint32_t blocks = 0;
    for (uint32_t k = 0; k < n; ++k) {
      blocks += blocks_of(k);
      block_end[k] = blocks;
    }
  }
  body.Prepare(cs, n);
  __syncthreads();
  if (n == 0) return;
  const uint32_t total = block_end[n - 1];
  // Block b of item k (the first item whose block_end passes b): its first
  // element.
  const auto start_of = [&](uint32_t b, uint32_t k) {
    return start_in(b, k, k == 0 ? 0 : block_end[k - 1]);
  };
  // Warp w takes blocks w, w + warps, ... (handing blocks out by a shared
  // counter instead was slower: bench/RESULTS.md, 2026-12-05). Each Block
  // is preceded by the Prefetch of the warp's block after it.
  uint32_t k = 0;
  for (uint32_t b = warp; b < total; b += warps) {
    const uint32_t next = b + warps;
    while (b >= block_end[k]) ++k;
    if (next < total) {
      uint32_t kn = k;
      while (next >= block_end[kn]) ++kn;
      const uint64_t start = start_of(next, kn);
      body.Prefetch(cs[kn], start, length_of(kn, start));
    } else {
      body.Prefetch(cs[k], 0, 0);
    }
    const uint64_t start = start_of(b, k);
    body.Block(cs[k], k, start, length_of(k, start));
  }
  __syncthreads();
  body.Finish(cs, n);
}

// A lane's 8 elements of a WalkBlocks8 block at `first` (n of them valid):
// first + 4 * lane + j and first + 128 + 4 * lane + j - 4, as tiles lay
// them out.
__device__ __forceinline__ uint32_t Block8Offset(int j) {
  const uint32_t lane = threadIdx.x & 31;
  return (j < 4 ? 0 : 128 - 4) + 4 * lane + j;
}

// The bytes of a lane's elements of a WalkBlocks8 block of one stream
// (block8 codes) read one by one (invalid elements: 0); a whole aligned
// block is staged instead (LoadStagedCodes, kernels/block8_stage.cuh).
__device__ __forceinline__ void LoadCodes(const uint8_t* q, uint64_t first,
                                          uint32_t n, uint8_t* c) {
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const uint32_t e = Block8Offset(j);
    c[j] = e < n ? q[first + e] : 0;
  }
}

__device__ __forceinline__ void StoreCodes(uint8_t* q, uint64_t first,
                                           uint32_t n, bool vector,
                                           const uint8_t* c) {
  if (vector) {
    const uint32_t lane = threadIdx.x & 31;
    uint32_t a = 0, b = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      a |= static_cast<uint32_t>(c[j]) << (8 * j);
      b |= static_cast<uint32_t>(c[j + 4]) << (8 * j);
    }
    *reinterpret_cast<uint32_t*>(q + first + 4 * lane) = a;
    *reinterpret_cast<uint32_t*>(q + first + 128 + 4 * lane) = b;
    return;
  }
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const uint32_t e = Block8Offset(j);
    if (e < n) q[first + e] = c[j];
  }
}

// A weight's value (N elements as LoadF): the fp32 master where there is
// one (the old parameter is never read), the value rebuilt from the
// parameter and its remainder, or the parameter itself.
template <int N, class P, MasterKind K>
__device__ __forceinline__ void LoadWeight(const DeviceItem& t, uint64_t i,
                                           float* p,
                                           uint64_t half = kTileHalf) {
  if constexpr (K == MasterKind::kFp32) {
    LoadF<N, F32>(t.master, i, p, half);
  } else if constexpr (K == MasterKind::kRemainder) {
    LoadRemainderMasters<N>(t.param, t.master, i, p, half);
  } else {
    LoadF<N, P>(t.param, i, p, half);
  }
}

// Writes new weights back: master and rounded parameter, the parameter
// and remainder that rebuild them exactly, or the parameter.
template <int N, class P, MasterKind K>
__device__ __forceinline__ void StoreWeight(const DeviceItem& t, uint64_t i,
                                            const float* p,
                                            uint64_t half = kTileHalf) {
  if constexpr (K == MasterKind::kFp32) {
    StoreF<N, F32>(t.master, i, p, half);
    if constexpr (!IsFp8Param<P>::value) StoreF<N, P>(t.param, i, p, half);
  } else if constexpr (K == MasterKind::kRemainder) {
    StoreRemainderMasters<N>(t.param, t.master, i, p, half);
  } else {
    StoreF<N, P>(t.param, i, p, half);
  }
}

// Sums session_sums in a fixed order: the same total in every block.
__device__ __forceinline__ double SessionTotal(const double* sums, uint32_t n) {
  double total = 0;
  for (uint32_t i = 0; i < n; ++i) total += sums[i];
  return total;
}

template <int kThreads>
__device__ double BlockSum(double v) {
  __shared__ double warp_sums[kThreads / 32];
  for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) warp_sums[warp] = v;
  __syncthreads();
  double total = 0;
  if (threadIdx.x == 0) {
    for (int w = 0; w < kThreads / 32; ++w) total += warp_sums[w];
  }
  return total;  // valid in thread 0
}

// `e` as a status naming `what`.
inline absl::Status CudaErrorStatus(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorName(e), ": ",
                                          cudaGetErrorString(e)));
}

// The status of the kernel launch just made.
inline absl::Status LaunchStatus(const char* what) {
  return CudaErrorStatus(cudaGetLastError(), what);
}

// block8 moments (core/block8.h): no per-element codec, since a block's
// elements share a scale. Dispatched as M only to launchers that declare
// `static constexpr bool kTakesBlock8 = true` (TakesBlock8).
struct Block8 {
  using T = uint8_t;
};

template <class Body, class = void>
struct TakesFp8 : std::false_type {};
template <class Body>
struct TakesFp8<Body, std::void_t<decltype(Body::kTakesFp8)>>
    : std::bool_constant<Body::kTakesFp8> {};

template <class Body, class = void>
struct TakesBlock8 : std::false_type {};
template <class Body>
struct TakesBlock8<Body, std::void_t<decltype(Body::kTakesBlock8)>>
    : std::bool_constant<Body::kTakesBlock8> {};

// Launchers with a float64 kernel declare `static constexpr bool
// kTakesFloat64 = true` and get Run<F64, F64, F64, MasterKind::kNone>.
template <class Body, class = void>
struct TakesFloat64 : std::false_type {};
template <class Body>
struct TakesFloat64<Body, std::void_t<decltype(Body::kTakesFloat64)>>
    : std::bool_constant<Body::kTakesFloat64> {};

// Calls body.template Run<P, G, M, K>() for the element types and master
// kind of `layout` (an update kernel's launcher), or says there is no such
// kernel: fp32 parameters have no master, remainders go with bf16.
template <class Body>
absl::Status DispatchLayout(const Layout& l, Body& body) {
  auto master = [&](auto p, auto g, auto m) -> absl::Status {
    using P = decltype(p);
    using G = decltype(g);
    using M = decltype(m);
    switch (l.master) {
      case MasterKind::kNone:
        if constexpr (std::is_same_v<P, F32>) {
          return body.template Run<P, G, M, MasterKind::kNone>();
        }
        break;
      case MasterKind::kFp32:
        return body.template Run<P, G, M, MasterKind::kFp32>();
      case MasterKind::kRemainder:
        if constexpr (std::is_same_v<P, BF16>) {
          return body.template Run<P, G, M, MasterKind::kRemainder>();
        }
        break;
    }
    return absl::InvalidArgumentError(
        absl::StrCat("no CUDA kernel for layout ", l.DebugString()));
  };
  auto moment = [&](auto p, auto g) -> absl::Status {
    if (l.moment_dtype == DType::kBlock8) {
      if constexpr (TakesBlock8<Body>::value &&
                    !IsFp8Param<decltype(p)>::value) {
        return master(p, g, Block8{});
      }
      return absl::InvalidArgumentError(
          absl::StrCat("no CUDA kernel for layout ", l.DebugString()));
    }
    if (l.moment_dtype == DType::kBFloat16) return master(p, g, BF16{});
    return master(p, g, F32{});
  };
  auto grad = [&](auto p) -> absl::Status {
    switch (l.grad_dtype) {
      case DType::kFloat32:
        return moment(p, F32{});
      case DType::kBFloat16:
        return moment(p, BF16{});
      case DType::kFloat16:
        return moment(p, F16{});
      default:
        break;
    }
    return absl::InvalidArgumentError("unknown gradient dtype");
  };
  switch (l.param_dtype) {
    case DType::kFloat32:
      return grad(F32{});
    case DType::kBFloat16:
      return grad(BF16{});
    case DType::kFloat16:
      return grad(F16{});
    case DType::kFloat64:
      if constexpr (TakesFloat64<Body>::value) {
        if (l.grad_dtype == DType::kFloat64 &&
            l.moment_dtype == DType::kFloat64 &&
            l.master == MasterKind::kNone) {
          return body.template Run<F64, F64, F64, MasterKind::kNone>();
        }
      }
      return absl::InvalidArgumentError(
          absl::StrCat("no CUDA kernel for layout ", l.DebugString()));
    case DType::kFloat8E4M3:
      if constexpr (TakesFp8<Body>::value) return grad(Fp8Param<kE4M3>{});
      break;
    case DType::kFloat8E5M2:
      if constexpr (TakesFp8<Body>::value) return grad(Fp8Param<kE5M2>{});
      break;
    default:
      break;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("no CUDA kernel for layout ", l.DebugString()));
}

}  // namespace cuda
}  // namespace optimd

#endif  // OPTIMD_KERNELS_CUDA_WALK_CUH_
