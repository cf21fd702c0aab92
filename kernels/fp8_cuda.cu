// FP8 requantization on CUDA: core/fp8_quantize.h's QuantizeFp8Unit with
// one warp per scaling unit. The amax is a warp reduction with Fp8Amax
// (order-independent), the scale and codes come from the host-device
// functions of core/fp8.h, so the bits equal the CPU reference's.
#include <cstdint>

#include "core/fp8.h"
#include "kernels/cuda_walk.cuh"
#include "kernels/fp8_cuda.h"

namespace optimd {
namespace cuda {
namespace {

// The index of the tensor holding unit `u`: the last with first_unit <= u.
__device__ uint32_t TensorOf(const DeviceFp8Tensor* t, uint32_t n, uint64_t u) {
  uint32_t lo = 0, hi = n;
  while (hi - lo > 1) {
    const uint32_t mid = (lo + hi) / 2;
    if (t[mid].first_unit <= u) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

__device__ bool Absent(const uint32_t* absent, uint32_t entry) {
  if (absent == nullptr) return false;
  for (uint32_t i = 0; i < absent[0]; ++i) {
    if (absent[1 + i] == entry) return true;
  }
  return false;
}

template <const Fp8Format& F>
__device__ void QuantizeUnit(const DeviceFp8Tensor& t, uint64_t unit) {
  const Fp8Geometry& g = t.geometry;
  const uint64_t cols_of_units = g.UnitColumns();
  const uint64_t row0 = unit / cols_of_units * g.block_rows;
  const uint64_t col0 = unit % cols_of_units * g.block_cols;
  const uint64_t rows = min(g.block_rows, g.rows - row0);
  const uint64_t cols = min(g.block_cols, g.cols - col0);
  const uint64_t n = rows * cols;
  const uint32_t lane = threadIdx.x & 31;
  float amax = 0.0f;
  for (uint64_t k = lane; k < n; k += 32) {
    amax =
        Fp8Amax(amax, t.master[(row0 + k / cols) * g.cols + col0 + k % cols]);
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    amax = Fp8Amax(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  }
  float mul;
  if (g.recipe == Fp8Recipe::kMxfp8) {
    const uint8_t code = Fp8E8M0(amax, F.max_value);
    if (lane == 0) static_cast<uint8_t*>(t.scale_inv)[unit] = code;
    mul = E8M0Multiplier(code);
  } else {
    mul = Fp8Scale(amax, F.max_value, g.recipe != Fp8Recipe::kTensor);
    if (lane == 0) static_cast<float*>(t.scale_inv)[unit] = 1.0f / mul;
  }
  for (uint64_t k = lane; k < n; k += 32) {
    const uint64_t i = (row0 + k / cols) * g.cols + col0 + k % cols;
    t.param[i] = EncodeFp8<F>(t.master[i] * mul);
  }
}

__global__ void __launch_bounds__(kThreadsPerBlock)
    Fp8RequantizeKernel(const DeviceFp8Tensor* __restrict__ tensors,
                        uint32_t count, uint64_t units,
                        const DeviceScalars* __restrict__ scalars,
                        const uint32_t* __restrict__ absent) {
  if (scalars->skip) return;
  const uint64_t warps =
      static_cast<uint64_t>(gridDim.x) * (kThreadsPerBlock / 32);
  const uint64_t base = tensors[0].first_unit;
  for (uint64_t w = blockIdx.x * (kThreadsPerBlock / 32) + threadIdx.x / 32;
       w < units; w += warps) {
    const uint64_t u = base + w;
    const DeviceFp8Tensor& t = tensors[TensorOf(tensors, count, u)];
    if (Absent(absent, t.entry)) continue;
    if (t.e5m2) {
      QuantizeUnit<kE5M2>(t, u - t.first_unit);
    } else {
      QuantizeUnit<kE4M3>(t, u - t.first_unit);
    }
  }
}

}  // namespace

absl::Status LaunchFp8Requantize(const DeviceFp8Tensor* tensors, uint32_t count,
                                 uint64_t units, const DeviceScalars* scalars,
                                 const uint32_t* absent, Stream stream) {
  if (count == 0 || units == 0) return absl::OkStatus();
  constexpr uint64_t kMaxBlocks = 132 * 16;  // enough to fill an H200
  const uint64_t per_block = kThreadsPerBlock / 32;
  const uint64_t blocks =
      std::min<uint64_t>(kMaxBlocks, (units + per_block - 1) / per_block);
  Fp8RequantizeKernel<<<static_cast<unsigned>(blocks), kThreadsPerBlock, 0,
                        stream>>>(tensors, count, units, scalars, absent);
  return LaunchStatus("FP8 requantize kernel launch");
}

}  // namespace cuda
}  // namespace optimd
