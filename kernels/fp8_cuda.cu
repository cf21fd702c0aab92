// The encode pass of FP8 parameters whose units the update's warp blocks
// do not hold whole (Fp8Pass): a walk over the launch's items that reads
// each master back and encodes it with its unit's scale, from the amax
// the update took. The scale rules and codecs are core/fp8.h's, so the
// bits equal the CPU reference's.
#include <cstdint>

#include "core/fp8.h"
#include "kernels/cuda_walk.cuh"
#include "kernels/fp8_cuda.cuh"
#include "kernels/fp8_cuda.h"

namespace optimd {
namespace cuda {
namespace {

// Whether element e is the first of its unit (whose thread writes the
// unit's scale inverse).
__device__ __forceinline__ bool UnitStart(const Fp8Geometry& g, uint64_t e) {
  return e / g.cols % g.block_rows == 0 && e % g.cols % g.block_cols == 0;
}

// The multiplier of element e's unit, its scale inverse written by the
// unit's first element.
template <class P>
__device__ __forceinline__ float ElementMultiplier(const DeviceFp8Tensor& t,
                                                   uint64_t e) {
  const uint64_t unit = t.geometry.UnitOf(e);
  return UnitMultiplier<P>(t.geometry.recipe, t.amax[unit], t.scale_inv, unit,
                           UnitStart(t.geometry, e));
}

// Where the update already encoded a per-tensor-scaled item with the
// true amax (its prediction held): Fp8Encode's `from`.
constexpr uint32_t kEncoded = kNoPrediction;

// The walk's body. kPerTensor (every tensor of the launch has per-tensor
// scaling, Fp8Pass::kTensorAmax): each item's multiplier once, in Prepare
// (the tensor's first item writes the scale inverse), and nothing per
// element but the encode and the candidates for the next step's amax
// prediction, so the kernel fits the registers of eight resident blocks a
// multiprocessor; an item whose codes the update wrote from a prediction
// equal to the true amax is left alone (Fp8Prediction). Otherwise
// kElementAmax tensors, unit by element; the one-pass tensors (kFused,
// kUnitWalk) are left alone.
template <class P, bool kPerTensor>
struct Fp8Encode {
  float* mul;      // shared memory, one per item of the block
  uint32_t* from;  // shared memory: CandidateBits, or kEncoded
  __device__ void Prepare(const DeviceItem* cs, uint32_t n) {
    if (!kPerTensor || threadIdx.x >= n) return;
    const DeviceItem& c = cs[threadIdx.x];
    const DeviceFp8Tensor& t = Fp8Of(c);
    const uint32_t amax = t.amax[0];
    if (PredictedAmax(t) == amax) {
      from[threadIdx.x] = kEncoded;
      return;
    }
    Fp8Prediction* pr = t.prediction;
    from[threadIdx.x] = CandidateBits(amax, pr != nullptr ? pr->narrow : 0);
    const bool first = c.begin == 0 && c.end > c.begin;
    mul[threadIdx.x] =
        UnitMultiplier<P>(t.geometry.recipe, amax, t.scale_inv, 0, first);
    if (first && pr != nullptr) {
      ++pr->encode_passes;
      pr->read_back = 1;
    }
  }
  // The multipliers of a lane's tile share at i (LoadTile's order).
  __device__ void TileMultipliers(const DeviceFp8Tensor& t, uint32_t k,
                                  uint64_t i, float* m) {
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      const uint64_t e = i + q * (kTileElements / 2);
      if (kPerTensor) {
        m[4 * q] = m[4 * q + 1] = m[4 * q + 2] = m[4 * q + 3] = mul[k];
      } else {
#pragma unroll
        for (int j = 0; j < 4; ++j)
          m[4 * q + j] = ElementMultiplier<P>(t, e + j);
      }
    }
  }
  __device__ void Tile(const DeviceItem& c, uint32_t k, uint64_t i) {
    const DeviceFp8Tensor& t = Fp8Of(c);
    if (!kPerTensor && t.pass != Fp8Pass::kElementAmax) return;
    if (kPerTensor && from[k] == kEncoded) return;
    float x[8], m[8];
    LoadF<8, F32>(c.master, i, x);
    TileMultipliers(t, k, i, m);
    uint32_t w[2] = {0, 0};
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      w[j / 4] |= static_cast<uint32_t>(Fp8Codec<P>::Encode(x[j] * m[j]))
                  << (8 * (j % 4));
    }
    uint8_t* q = static_cast<uint8_t*>(c.param);
    *reinterpret_cast<uint32_t*>(q + i) = w[0];
    *reinterpret_cast<uint32_t*>(q + i + kTileElements / 2) = w[1];
    if constexpr (kPerTensor) {
      if (t.prediction == nullptr) return;
      uint32_t bits[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) bits[j] = MagnitudeBits(x[j]);
      AddTileCandidates(t.prediction, 1, i, 0xffu, bits, from[k]);
    }
  }
  __device__ void Scalar(const DeviceItem& c, uint32_t k, uint64_t i) {
    const DeviceFp8Tensor& t = Fp8Of(c);
    if (!kPerTensor && t.pass != Fp8Pass::kElementAmax) return;
    if (kPerTensor && from[k] == kEncoded) return;
    const float x = static_cast<const float*>(c.master)[i];
    const float m = kPerTensor ? mul[k] : ElementMultiplier<P>(t, i);
    static_cast<uint8_t*>(c.param)[i] = Fp8Codec<P>::Encode(x * m);
    if (kPerTensor && t.prediction != nullptr && MagnitudeBits(x) >= from[k]) {
      AddCandidate(t.prediction, 1, i);
    }
  }
};

// Per-tensor scaling: eight resident blocks of 256 threads a
// multiprocessor (32 registers a thread), for the bytes in flight a
// bandwidth-bound pass needs; the other recipes' unit arithmetic needs more.
template <class P>
__global__ void __launch_bounds__(kThreadsPerBlock, 8)
    Fp8EncodePerTensorKernel(const Work work,
                             const DeviceScalars* __restrict__ scalars) {
  if (scalars->skip) return;
  __shared__ float mul[kMaxItemsPerBlock];
  __shared__ uint32_t from[kMaxItemsPerBlock];
  Fp8Encode<P, true> body{mul, from};
  Walk(work, body);
}

template <class P>
__global__ void __launch_bounds__(kThreadsPerBlock)
    Fp8EncodeKernel(const Work work,
                    const DeviceScalars* __restrict__ scalars) {
  if (scalars->skip) return;
  Fp8Encode<P, false> body{nullptr, nullptr};
  Walk(work, body);
}

template <class P>
void LaunchFor(Fp8Recipe recipe, const Work& work, const DeviceScalars* scalars,
               Stream stream) {
  if (recipe == Fp8Recipe::kTensor) {
    Fp8EncodePerTensorKernel<P>
        <<<work.num_blocks, kThreadsPerBlock, 0, stream>>>(work, scalars);
  } else {
    Fp8EncodeKernel<P>
        <<<work.num_blocks, kThreadsPerBlock, 0, stream>>>(work, scalars);
  }
}

}  // namespace

absl::Status LaunchFp8Encode(bool e5m2, Fp8Recipe recipe, const Work& work,
                             const DeviceScalars* scalars, Stream stream) {
  if (work.num_blocks == 0) return absl::OkStatus();
  if (e5m2) {
    LaunchFor<Fp8Param<kE5M2>>(recipe, work, scalars, stream);
  } else {
    LaunchFor<Fp8Param<kE4M3>>(recipe, work, scalars, stream);
  }
  return LaunchStatus("FP8 encode kernel launch");
}

}  // namespace cuda
}  // namespace optimd
