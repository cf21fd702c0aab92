// Device code of FP8 parameters' requantization (docs/fp8_parameters.md)
// that the update kernels share with the encode pass (kernels/fp8_cuda.cu):
// a unit's scale from its amax, the one-pass requantization of a warp
// block whose units it holds whole, the amax of the units of the passes
// with an encode pass, and the walk of a 128x128 unit (Fp8Pass,
// kernels/cuda_step_types.h). The rules are core/fp8.h's
// host-device functions, so the bits equal the CPU reference's.
// Included by the .cu files of kernels/ only (nvcc).
#ifndef OPTIMD_KERNELS_FP8_CUDA_CUH_
#define OPTIMD_KERNELS_FP8_CUDA_CUH_

#include <cstdint>

#include "core/fp8.h"
#include "kernels/cuda_walk.cuh"

namespace optimd {
namespace cuda {

// The update's warp blocks (WalkBlocks8) are tiles: Block8Offset lays
// their elements out as LoadTile does.
static_assert(kBlock8Elements == kTileElements, "warp blocks are tiles");

// The bits of |x|. As unsigned integers they order as the magnitudes do,
// and a NaN's lie above infinity's: their maximum, read back as a float,
// is Fp8Amax's result, or a NaN where Fp8Amax gives one, and every scale
// rule treats all NaNs alike.
__device__ __forceinline__ uint32_t MagnitudeBits(float x) {
  return __float_as_uint(x) & 0x7fffffffu;
}

// The codec of an FP8 parameter type P (Fp8Param, kernels/cuda_walk.cuh):
// kernels take P, a class, as their template argument (nvcc's launch stubs
// cannot name a kernel instantiated on a reference to a format).
template <class P>
struct Fp8Codec;
template <const Fp8Format& F>
struct Fp8Codec<Fp8Param<F>> {
  static constexpr float kMax = F.max_value;
  __device__ static uint8_t Encode(float x) { return EncodeFp8<F>(x); }
};

// The FP8 parameter of an FP8 item (DeviceItem::scales).
__device__ __forceinline__ const DeviceFp8Tensor& Fp8Of(const DeviceItem& c) {
  return *static_cast<const DeviceFp8Tensor*>(c.scales);
}

// What unit `unit` multiplies its masters by before encoding, from the
// bits of its amax; with `write`, its scale inverse is stored too (the
// e8m0 code for MXFP8, else 1 / scale).
template <class P>
__device__ __forceinline__ float UnitMultiplier(Fp8Recipe recipe,
                                                uint32_t amax_bits,
                                                void* scale_inv, uint64_t unit,
                                                bool write) {
  const float amax = __uint_as_float(amax_bits);
  if (recipe == Fp8Recipe::kMxfp8) {
    const uint8_t code = Fp8E8M0(amax, Fp8Codec<P>::kMax);
    if (write) static_cast<uint8_t*>(scale_inv)[unit] = code;
    return E8M0Multiplier(code);
  }
  const float mul =
      Fp8Scale(amax, Fp8Codec<P>::kMax, recipe != Fp8Recipe::kTensor);
  if (write) static_cast<float*>(scale_inv)[unit] = 1.0f / mul;
  return mul;
}

// The largest of a lane's first four (h = 0) or last four (h = 1) bits.
__device__ __forceinline__ uint32_t HalfMax(const uint32_t* bits, int h) {
  return max(max(bits[4 * h], bits[4 * h + 1]),
             max(bits[4 * h + 2], bits[4 * h + 3]));
}

// Requantizes the units of a kFused warp block at `first` (n valid
// elements, whole units of kWidth elements, the unit of element e being
// e / kWidth) from the lanes' new masters p: kWidth / 4 consecutive lanes
// hold a unit's elements in each half of the block (Block8Offset), so a
// unit's amax is a butterfly over those lanes; their first lane writes its
// scale inverse.
template <class P, uint32_t kWidth>
__device__ __forceinline__ void EncodeFusedBlock(const DeviceFp8Tensor& t,
                                                 uint64_t first, uint32_t n,
                                                 bool vector, const float* p,
                                                 const uint32_t* bits) {
  constexpr uint32_t kLanes = kWidth / 4;
  const uint32_t lane = threadIdx.x & 31;
  uint32_t h[2] = {HalfMax(bits, 0), HalfMax(bits, 1)};
#pragma unroll
  for (uint32_t o = kLanes / 2; o > 0; o >>= 1) {
    h[0] = max(h[0], __shfl_xor_sync(0xffffffffu, h[0], o));
    h[1] = max(h[1], __shfl_xor_sync(0xffffffffu, h[1], o));
  }
  float mul[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const uint32_t offset = half * (kTileElements / 2) + lane / kLanes * kWidth;
    const bool write = lane % kLanes == 0 && offset < n;
    mul[half] = UnitMultiplier<P>(t.geometry.recipe, h[half], t.scale_inv,
                                  (first + offset) / kWidth, write);
  }
  uint8_t codes[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) codes[j] = Fp8Codec<P>::Encode(p[j] * mul[j / 4]);
  StoreCodes(t.param, first, n, vector, codes);
}

// Takes the unit amax of a warp block of a parameter with an encode pass
// (atomic maxima): per-tensor scaling reduces across the warp into the
// item's word of the thread block's shared memory, `item_amax` (the
// update adds it to t.amax once per item: FinishItemAmax), since every
// warp of the launch's running blocks would otherwise hit the same word;
// other shapes go element by element.
__device__ __forceinline__ void RecordAmax(const DeviceFp8Tensor& t,
                                           uint64_t first, uint32_t n,
                                           const uint32_t* bits,
                                           uint32_t* item_amax) {
  const uint32_t lane = threadIdx.x & 31;
  if (t.pass == Fp8Pass::kTensorAmax) {
    const uint32_t v =
        __reduce_max_sync(0xffffffffu, max(HalfMax(bits, 0), HalfMax(bits, 1)));
    if (lane == 0) atomicMax(item_amax, v);
    return;
  }
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const uint32_t e = Block8Offset(j);
    if (e < n) atomicMax(&t.amax[t.geometry.UnitOf(first + e)], bits[j]);
  }
}

// A parameter without a predicted amax this step (Fp8Prediction): no
// magnitude's bits are this large.
constexpr uint32_t kNoPrediction = 0xffffffffu;

// The amax bits that the update of t encodes with: its prediction's, or
// kNoPrediction.
__device__ __forceinline__ uint32_t PredictedAmax(const DeviceFp8Tensor& t) {
  const Fp8Prediction* pr = t.prediction;
  return pr != nullptr && pr->predicted ? pr->amax : kNoPrediction;
}

// The bits from which a new master is a candidate for the next step's
// amax prediction, given this step's amax bits: within amax / 2^(4 +
// narrow) of it (Fp8Prediction::narrow; 1/16 at most, a margin above what
// a step moves the largest weight).
__device__ __forceinline__ uint32_t CandidateBits(uint32_t amax_bits,
                                                  uint32_t narrow) {
  const float a = __uint_as_float(amax_bits);
  return MagnitudeBits(a - ldexpf(a, -4 - static_cast<int>(narrow)));
}

// Keeps element `index` in candidate list `list` of pr while it has room
// (one thread alone; a full list takes no atomic).
__device__ __forceinline__ void AddCandidate(Fp8Prediction* pr, int list,
                                             uint64_t index) {
  if (*static_cast<volatile uint32_t*>(&pr->count[list]) >= kAmaxCandidates) {
    return;
  }
  const uint32_t slot = atomicAdd(&pr->count[list], 1u);
  if (slot < kAmaxCandidates) pr->index[list][slot] = index;
}

// The candidates among a lane's tile elements (element j at base + j, or
// base + kTileHalf + j - 4 for j >= 4, as LoadTile lays them out): those
// of `valid` (bit j) whose bits reach `from`, by the whole warp. One atomic
// a warp for all its candidates, none once the list is full: a tensor
// whose elements are all alike (a norm's ones) makes every element one.
__device__ __forceinline__ void AddTileCandidates(Fp8Prediction* pr, int list,
                                                  uint64_t base, uint32_t valid,
                                                  const uint32_t* bits,
                                                  uint32_t from) {
  uint32_t mine = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    if (bits[j] >= from) mine |= 1u << j;
  }
  mine &= valid;
  if (__ballot_sync(0xffffffffu, mine != 0) == 0) return;
  const uint32_t lane = threadIdx.x & 31;
  const uint32_t n = __popc(mine);
  uint32_t through = n;  // the candidates of lanes 0..lane
#pragma unroll
  for (uint32_t o = 1; o < 32; o <<= 1) {
    const uint32_t below = __shfl_up_sync(0xffffffffu, through, o);
    if (lane >= o) through += below;
  }
  uint32_t first = kAmaxCandidates;
  if (lane == 31) {
    uint32_t* count = &pr->count[list];
    if (*static_cast<volatile uint32_t*>(count) < kAmaxCandidates) {
      first = atomicAdd(count, through);
    }
  }
  uint32_t slot = __shfl_sync(0xffffffffu, first, 31) + (through - n);
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    if ((mine >> j & 1u) == 0) continue;
    if (slot < kAmaxCandidates) {
      pr->index[list][slot] = base + (j < 4 ? j : kTileHalf + j - 4);
    }
    ++slot;
  }
}

// A per-tensor-scaled warp block's codes from the predicted amax (the
// update's, for the encode pass to leave alone where the true amax is the
// same), and its candidates for the next prediction. The block at the
// tensor's start writes the scale inverse.
template <class P>
__device__ __forceinline__ void EncodePredicted(const DeviceFp8Tensor& t,
                                                uint64_t first, uint32_t n,
                                                bool vector, const float* p,
                                                const uint32_t* bits,
                                                uint32_t predicted) {
  const uint32_t lane = threadIdx.x & 31;
  const float mul = UnitMultiplier<P>(t.geometry.recipe, predicted, t.scale_inv,
                                      0, first == 0 && lane == 0);
  uint8_t codes[8];
  uint32_t valid = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    codes[j] = Fp8Codec<P>::Encode(p[j] * mul);
    if (Block8Offset(j) < n) valid |= 1u << j;
  }
  StoreCodes(t.param, first, n, vector, codes);
  AddTileCandidates(t.prediction, 0, first + 4 * lane, valid, bits,
                    CandidateBits(predicted, t.prediction->narrow));
}

// After the update of a warp block of an FP8 parameter's item c (n valid
// elements from `first`, the lanes' new masters in p, 0 where invalid):
// its codes and scale inverses (kFused), or its units' amax (item_amax:
// the item's shared word, see RecordAmax) and, with a predicted amax
// (`predicted`, else kNoPrediction), the codes from it.
template <class P>
__device__ __forceinline__ void Fp8AfterUpdate(const DeviceItem& c,
                                               uint64_t first, uint32_t n,
                                               bool vector, const float* p,
                                               uint32_t* item_amax,
                                               uint32_t predicted) {
  const DeviceFp8Tensor& t = Fp8Of(c);
  uint32_t bits[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) bits[j] = MagnitudeBits(p[j]);
  if (HasEncodePass(t.pass)) {
    RecordAmax(t, first, n, bits, item_amax);
    if (predicted != kNoPrediction) {
      EncodePredicted<P>(t, first, n, vector, p, bits, predicted);
    }
  } else if (t.pass == Fp8Pass::kUnitWalk) {
    return;  // walked by unit (WalkUnit), never by item
  } else if (t.geometry.recipe == Fp8Recipe::kMxfp8) {
    EncodeFusedBlock<P, 32>(t, first, n, vector, p, bits);
  } else {
    EncodeFusedBlock<P, kTileElements / 2>(t, first, n, vector, p, bits);
  }
}

// After a thread block's update (its items in cs, item_amax their shared
// words, zeroed before it), by every thread: a per-tensor-scaled item's
// amax into its tensor's word.
__device__ __forceinline__ void FinishItemAmax(const DeviceItem* cs, uint32_t n,
                                               const uint32_t* item_amax) {
  if (threadIdx.x >= n) return;
  const DeviceFp8Tensor& t = Fp8Of(cs[threadIdx.x]);
  if (t.pass == Fp8Pass::kTensorAmax) atomicMax(t.amax, item_amax[threadIdx.x]);
}

// The update and requantization of unit `unit` of a kUnitWalk parameter
// (its first item c, in shared memory; `masters`: the thread block's
// shared memory for the unit's kWalkUnitSide^2 new masters; `unit_amax`:
// a shared word, zeroed), by the whole thread block. Each warp takes pairs
// of the unit's rows, a lane four columns of both: body.Tile(c, i, half,
// p) updates a lane's share of rows r and r + 1 (elements i.. and
// i + half.., half = the columns; LoadTile), body.One(c, i, p) element i
// alone (the unit's odd last row, or streams not 16-byte aligned). The
// masters go to shared memory as well as to the master, so that once the
// unit's amax is known the codes come from there: one pass over the master.
template <class P, class Body>
__device__ __forceinline__ void WalkUnit(const DeviceItem& c, uint32_t unit,
                                         float* masters, uint32_t* unit_amax,
                                         Body& body) {
  const DeviceFp8Tensor& t = Fp8Of(c);
  const uint64_t cols = t.geometry.cols;
  const uint64_t unit_cols = cols / kWalkUnitSide;
  const uint64_t first_row = unit / unit_cols * kWalkUnitSide;
  const uint64_t left = t.geometry.rows - first_row;
  const uint32_t rows =
      left < kWalkUnitSide ? static_cast<uint32_t>(left) : kWalkUnitSide;
  const uint64_t base = first_row * cols + unit % unit_cols * kWalkUnitSide;
  const bool vector = c.tiles > 0;
  const uint32_t lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  uint32_t amax = 0;
  for (uint32_t r = 2 * (threadIdx.x >> 5); r < rows; r += 2 * warps) {
    const uint64_t i = base + r * cols + 4 * lane;
    float p[8];
    if (vector && r + 1 < rows) {
      body.Tile(c, i, cols, p);
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        p[j] = 0.0f;
        if (r + j / 4 < rows) body.One(c, i + (j / 4) * cols + j % 4, &p[j]);
      }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if (r + h >= rows) continue;
      *reinterpret_cast<float4*>(masters + (r + h) * kWalkUnitSide + 4 * lane) =
          make_float4(p[4 * h], p[4 * h + 1], p[4 * h + 2], p[4 * h + 3]);
#pragma unroll
      for (int j = 0; j < 4; ++j) amax = max(amax, MagnitudeBits(p[4 * h + j]));
    }
  }
  amax = __reduce_max_sync(0xffffffffu, amax);
  if (lane == 0) atomicMax(unit_amax, amax);
  __syncthreads();
  const float mul = UnitMultiplier<P>(t.geometry.recipe, *unit_amax,
                                      t.scale_inv, unit, threadIdx.x == 0);
  for (uint32_t e = 4 * threadIdx.x; e < rows * kWalkUnitSide;
       e += 4 * blockDim.x) {
    const float4 x = *reinterpret_cast<const float4*>(masters + e);
    const uint8_t codes[4] = {
        Fp8Codec<P>::Encode(x.x * mul), Fp8Codec<P>::Encode(x.y * mul),
        Fp8Codec<P>::Encode(x.z * mul), Fp8Codec<P>::Encode(x.w * mul)};
    uint8_t* q = t.param + base + e / kWalkUnitSide * cols + e % kWalkUnitSide;
    if (vector) {
      *reinterpret_cast<uint32_t*>(q) = codes[0] | codes[1] << 8 |
                                        codes[2] << 16 |
                                        static_cast<uint32_t>(codes[3]) << 24;
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j) q[j] = codes[j];
    }
  }
}

}  // namespace cuda
}  // namespace optimd

#endif  // OPTIMD_KERNELS_FP8_CUDA_CUH_
