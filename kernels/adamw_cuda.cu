// Fused multi-tensor AdamW and gradient statistics on CUDA. The arithmetic
// follows kernels/adamw_cpu.h operation by operation (this file is built
// with -fmad=false, IEEE division and square root), so results equal the CPU
// reference bit for bit given the same step scalars.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "kernels/adamw_cuda.h"

namespace optimd {
namespace cuda {
namespace {

struct F32 {
  using T = float;
  __device__ static float Load(T x) { return x; }
  __device__ static T Store(float x) { return x; }
};
struct BF16 {
  using T = uint16_t;
  __device__ static float Load(T x) {
    return __uint_as_float(static_cast<uint32_t>(x) << 16);
  }
  __device__ static T Store(float x) {
    const uint32_t u = __float_as_uint(x);
    const uint32_t rounded = u + 0x7fffu + ((u >> 16) & 1u);
    const bool is_nan = (u & 0x7fffffffu) > 0x7f800000u;
    return static_cast<uint16_t>((is_nan ? (u | 0x00400000u) : rounded) >> 16);
  }
};
struct F16 {
  using T = uint16_t;
  __device__ static float Load(T x) {
    return __half2float(__ushort_as_half(x));
  }
  __device__ static T Store(float x) {
    return __half_as_ushort(__float2half_rn(x));
  }
};

__device__ __forceinline__ float Reconstruct(uint16_t hi_bits, int16_t rem) {
  const uint32_t hi =
      (static_cast<uint32_t>(hi_bits) - (rem < 0 ? 1u : 0u)) & 0xffffu;
  return __uint_as_float((hi << 16) | static_cast<uint16_t>(rem));
}

__device__ __forceinline__ void Split(float p, uint16_t* hi_bits,
                                      int16_t* rem) {
  const uint32_t u = __float_as_uint(p);
  const int16_t r = static_cast<int16_t>(static_cast<uint16_t>(u & 0xffffu));
  *hi_bits = static_cast<uint16_t>(((u >> 16) + (r < 0 ? 1u : 0u)) & 0xffffu);
  *rem = r;
}

// Eight consecutive elements per stream in 16-byte accesses (two for 4-byte
// types, one for 2-byte types), with streaming cache hints: every byte is
// read and written once per step, so nothing is worth keeping in L2.
template <int N, typename T>
__device__ __forceinline__ void LoadN(const void* base, uint64_t i, T* out) {
  const uint4* p = reinterpret_cast<const uint4*>(static_cast<const T*>(base) + i);
  constexpr int kVecs = sizeof(T) * N / 16;
#pragma unroll
  for (int v = 0; v < kVecs; ++v) {
    const uint4 x = __ldcs(p + v);
    memcpy(reinterpret_cast<char*>(out) + 16 * v, &x, 16);
  }
}

template <int N, typename T>
__device__ __forceinline__ void StoreN(void* base, uint64_t i, const T* in) {
  uint4* p = reinterpret_cast<uint4*>(static_cast<T*>(base) + i);
  constexpr int kVecs = sizeof(T) * N / 16;
#pragma unroll
  for (int v = 0; v < kVecs; ++v) {
    uint4 x;
    memcpy(&x, reinterpret_cast<const char*>(in) + 16 * v, 16);
    __stcs(p + v, x);
  }
}

// Sums session_sums in a fixed order: the same total in every block.
__device__ __forceinline__ double SessionTotal(const double* sums,
                                               uint32_t n) {
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

template <class G>
__global__ void __launch_bounds__(kThreadsPerBlock)
    GradSumSquaresKernel(const DeviceBlock* __restrict__ blocks,
                         const DeviceChunk* __restrict__ chunks,
                         const DeviceTensor* __restrict__ tensors,
                         double* __restrict__ partials) {
  const DeviceBlock b = blocks[blockIdx.x];
  double acc = 0;
  for (uint32_t k = b.first; k < b.end; ++k) {
    const DeviceChunk c = chunks[k];
    const auto* g = static_cast<const typename G::T*>(tensors[c.tensor].grad);
    uint64_t i = c.begin + threadIdx.x;
    if (c.vector) {
      const uint64_t n8 = (c.end - c.begin) / 8;
      for (uint64_t j = threadIdx.x; j < n8; j += blockDim.x) {
        typename G::T v[8];
        LoadN<8>(g, c.begin + 8 * j, v);
#pragma unroll
        for (int q = 0; q < 8; ++q) {
          const double x = G::Load(v[q]);
          acc += x * x;
        }
      }
      i = c.begin + 8 * n8 + threadIdx.x;
    }
    for (; i < c.end; i += blockDim.x) {
      const double x = G::Load(g[i]);
      acc += x * x;
    }
  }
  const double total = BlockSum<kThreadsPerBlock>(acc);
  if (threadIdx.x == 0) partials[blockIdx.x] = total;
}

__global__ void ReduceSumsKernel(const double* __restrict__ partials,
                                 uint32_t count, double* __restrict__ out) {
  double acc = 0;
  for (uint32_t i = threadIdx.x; i < count; i += blockDim.x) acc += partials[i];
  const double total = BlockSum<kThreadsPerBlock>(acc);
  if (threadIdx.x == 0) *out = total;
}

__global__ void CommitStepKernel(const double* __restrict__ sums, uint32_t n,
                                 DeviceGroupState* __restrict__ group) {
  const double total = SessionTotal(sums, n);
  const bool skipped = !isfinite(total);
  group->last_sumsq = total;
  group->last_skipped = skipped ? 1 : 0;
  if (skipped) {
    group->skipped += 1;
  } else {
    group->step += 1;
  }
}

template <class S, class D>
__global__ void ConvertKernel(const void* __restrict__ src,
                              void* __restrict__ dst, uint64_t n) {
  const auto* in = static_cast<const typename S::T*>(src);
  auto* out = static_cast<typename D::T*>(dst);
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  for (uint64_t i = static_cast<uint64_t>(blockIdx.x) * blockDim.x +
                    threadIdx.x;
       i < n; i += stride) {
    out[i] = D::Store(S::Load(in[i]));
  }
}

using Scalars = DeviceScalars;

__global__ void PrepareStepKernel(StepHyper h, const double* __restrict__ sums,
                                  uint32_t n,
                                  const DeviceGroupState* __restrict__ group,
                                  DeviceScalars* __restrict__ out) {
  const double total = SessionTotal(sums, n);
  DeviceScalars s{};
  s.skip = isfinite(total) ? 0 : 1;
  if (!s.skip) {
    const double scale = h.grad_scale > 0 ? h.grad_scale : 1.0;
    const double norm = sqrt(total) / scale;
    double clip = 1.0;
    if (h.max_grad_norm > 0) clip = fmin(1.0, h.max_grad_norm / (norm + 1e-6));
    const double t = static_cast<double>(group->step + 1);
    const double bc1 = h.bias_correction ? 1.0 - pow(h.beta1, t) : 1.0;
    const double bc2 = h.bias_correction ? 1.0 - pow(h.beta2, t) : 1.0;
    s.beta1 = static_cast<float>(h.beta1);
    s.beta2 = static_cast<float>(h.beta2);
    s.omb1 = static_cast<float>(1.0 - h.beta1);
    s.omb2 = static_cast<float>(1.0 - h.beta2);
    s.eps = static_cast<float>(h.eps);
    s.decay = h.adamw ? static_cast<float>(1.0 - h.lr * h.weight_decay) : 1.0f;
    s.l2 = h.adamw ? 0.0f : static_cast<float>(h.weight_decay);
    s.bc2 = static_cast<float>(sqrt(bc2));
    s.neg_step = -static_cast<float>(h.lr / bc1);
    double mul = clip / scale;
    if (h.maximize) mul = -mul;
    s.grad_mul = static_cast<float>(mul);
  }
  *out = s;
}

template <class P, class G, class M, MasterKind K, bool kAms, bool kAdamW>
__device__ __forceinline__ void UpdateOne(const DeviceTensor& t, uint64_t i,
                                          const Scalars& s) {
  auto* param = static_cast<typename P::T*>(t.param);
  const auto* grad = static_cast<const typename G::T*>(t.grad);
  auto* m = static_cast<typename M::T*>(t.exp_avg);
  auto* v = static_cast<typename M::T*>(t.exp_avg_sq);
  float g = G::Load(grad[i]) * s.grad_mul;
  float p;
  if constexpr (K == MasterKind::kFp32) {
    p = static_cast<float*>(t.master)[i];
  } else if constexpr (K == MasterKind::kRemainder) {
    p = Reconstruct(param[i], static_cast<int16_t*>(t.master)[i]);
  } else {
    p = P::Load(param[i]);
  }
  if constexpr (kAdamW) {
    p = p * s.decay;
  } else {
    g = g + s.l2 * p;
  }
  const float mi = M::Load(m[i]) * s.beta1 + s.omb1 * g;
  const float vi = M::Load(v[i]) * s.beta2 + s.omb2 * g * g;
  m[i] = M::Store(mi);
  v[i] = M::Store(vi);
  float vd = vi;
  if constexpr (kAms) {
    auto* vmax = static_cast<typename M::T*>(t.max_exp_avg_sq);
    vd = fmaxf(M::Load(vmax[i]), vi);
    vmax[i] = M::Store(vd);
  }
  const float denom = sqrtf(vd) / s.bc2 + s.eps;
  p = p + s.neg_step * (mi / denom);
  if constexpr (K == MasterKind::kFp32) {
    static_cast<float*>(t.master)[i] = p;
    param[i] = P::Store(p);
  } else if constexpr (K == MasterKind::kRemainder) {
    uint16_t hi;
    int16_t r;
    Split(p, &hi, &r);
    param[i] = hi;
    static_cast<int16_t*>(t.master)[i] = r;
  } else {
    param[i] = P::Store(p);
  }
}

template <int N, class P, class G, class M, MasterKind K, bool kAms,
          bool kAdamW>
__device__ __forceinline__ void UpdateN(const DeviceTensor& t, uint64_t i,
                                           const Scalars& s) {
  typename P::T pr[N];
  typename G::T gr[N];
  typename M::T mr[N], vr[N], xr[N];
  float master[N];
  int16_t rem[N];
  // With an fp32 master the old parameter is never read.
  if constexpr (K != MasterKind::kFp32) LoadN<N>(t.param, i, pr);
  LoadN<N>(t.grad, i, gr);
  LoadN<N>(t.exp_avg, i, mr);
  LoadN<N>(t.exp_avg_sq, i, vr);
  if constexpr (kAms) LoadN<N>(t.max_exp_avg_sq, i, xr);
  if constexpr (K == MasterKind::kFp32) LoadN<N>(t.master, i, master);
  if constexpr (K == MasterKind::kRemainder) LoadN<N>(t.master, i, rem);
#pragma unroll
  for (int k = 0; k < N; ++k) {
    float g = G::Load(gr[k]) * s.grad_mul;
    float p;
    if constexpr (K == MasterKind::kFp32) {
      p = master[k];
    } else if constexpr (K == MasterKind::kRemainder) {
      p = Reconstruct(pr[k], rem[k]);
    } else {
      p = P::Load(pr[k]);
    }
    if constexpr (kAdamW) {
      p = p * s.decay;
    } else {
      g = g + s.l2 * p;
    }
    const float mi = M::Load(mr[k]) * s.beta1 + s.omb1 * g;
    const float vi = M::Load(vr[k]) * s.beta2 + s.omb2 * g * g;
    mr[k] = M::Store(mi);
    vr[k] = M::Store(vi);
    float vd = vi;
    if constexpr (kAms) {
      vd = fmaxf(M::Load(xr[k]), vi);
      xr[k] = M::Store(vd);
    }
    const float denom = sqrtf(vd) / s.bc2 + s.eps;
    p = p + s.neg_step * (mi / denom);
    if constexpr (K == MasterKind::kFp32) {
      master[k] = p;
      pr[k] = P::Store(p);
    } else if constexpr (K == MasterKind::kRemainder) {
      uint16_t hi;
      Split(p, &hi, &rem[k]);
      pr[k] = hi;
    } else {
      pr[k] = P::Store(p);
    }
  }
  StoreN<N>(t.param, i, pr);
  StoreN<N>(t.exp_avg, i, mr);
  StoreN<N>(t.exp_avg_sq, i, vr);
  if constexpr (kAms) StoreN<N>(t.max_exp_avg_sq, i, xr);
  if constexpr (K == MasterKind::kFp32) StoreN<N>(t.master, i, master);
  if constexpr (K == MasterKind::kRemainder) StoreN<N>(t.master, i, rem);
}

// At most 64 registers a thread: four resident blocks per multiprocessor,
// enough bytes in flight to keep HBM busy.
template <class P, class G, class M, MasterKind K, bool kAms, bool kAdamW>
__global__ void __launch_bounds__(kThreadsPerBlock, 4)
    AdamWKernel(const DeviceBlock* __restrict__ blocks,
                const DeviceChunk* __restrict__ chunks,
                const DeviceTensor* __restrict__ tensors,
                const DeviceScalars* __restrict__ scalars) {
  const Scalars s = *scalars;
  if (s.skip) return;
  const DeviceBlock b = blocks[blockIdx.x];
  for (uint32_t k = b.first; k < b.end; ++k) {
    const DeviceChunk c = chunks[k];
    const DeviceTensor t = tensors[c.tensor];
    uint64_t i = c.begin + threadIdx.x;
    if (c.vector) {
      // 8 elements per stream per thread: one or two 16-byte accesses. (16
      // for 16-bit layouts measured slower on the H200: bench/RESULTS.md.)
      constexpr int kN = 8;
      const uint64_t nv = (c.end - c.begin) / kN;
      for (uint64_t j = threadIdx.x; j < nv; j += blockDim.x) {
        UpdateN<kN, P, G, M, K, kAms, kAdamW>(t, c.begin + kN * j, s);
      }
      i = c.begin + kN * nv + threadIdx.x;
    }
    for (; i < c.end; i += blockDim.x) {
      UpdateOne<P, G, M, K, kAms, kAdamW>(t, i, s);
    }
  }
}

absl::Status Check(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(
      absl::StrCat(what, ": ", cudaGetErrorName(e), ": ", cudaGetErrorString(e)));
}

struct Args {
  const DeviceBlock* blocks;
  uint32_t num_blocks;
  const DeviceChunk* chunks;
  const DeviceTensor* tensors;
  const DeviceScalars* scalars;
  bool adamw;
  Stream stream;
};

template <class P, class G, class M, MasterKind K, bool kAms, bool kAdamW>
absl::Status Launch(const Args& a) {
  AdamWKernel<P, G, M, K, kAms, kAdamW>
      <<<a.num_blocks, kThreadsPerBlock, 0, a.stream>>>(a.blocks, a.chunks,
                                                        a.tensors, a.scalars);
  return Check(cudaGetLastError(), "AdamW kernel launch");
}

template <class P, class G, class M, MasterKind K>
absl::Status DispatchFlags(const Layout& l, const Args& a) {
  if (l.amsgrad) {
    return a.adamw ? Launch<P, G, M, K, true, true>(a)
                   : Launch<P, G, M, K, true, false>(a);
  }
  return a.adamw ? Launch<P, G, M, K, false, true>(a)
                 : Launch<P, G, M, K, false, false>(a);
}

template <class P, class G, class M>
absl::Status DispatchMaster(const Layout& l, const Args& a) {
  switch (l.master) {
    case MasterKind::kNone:
      if constexpr (std::is_same_v<P, F32>) {
        return DispatchFlags<P, G, M, MasterKind::kNone>(l, a);
      }
      break;
    case MasterKind::kFp32:
      return DispatchFlags<P, G, M, MasterKind::kFp32>(l, a);
    case MasterKind::kRemainder:
      if constexpr (std::is_same_v<P, BF16>) {
        return DispatchFlags<P, G, M, MasterKind::kRemainder>(l, a);
      }
      break;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("no CUDA kernel for layout ", l.DebugString()));
}

template <class P, class G>
absl::Status DispatchMoment(const Layout& l, const Args& a) {
  if (l.moment_dtype == DType::kBFloat16) {
    return DispatchMaster<P, G, BF16>(l, a);
  }
  return DispatchMaster<P, G, F32>(l, a);
}

template <class P>
absl::Status DispatchGrad(const Layout& l, const Args& a) {
  switch (l.grad_dtype) {
    case DType::kFloat32:
      return DispatchMoment<P, F32>(l, a);
    case DType::kBFloat16:
      return DispatchMoment<P, BF16>(l, a);
    case DType::kFloat16:
      return DispatchMoment<P, F16>(l, a);
  }
  return absl::InvalidArgumentError("unknown gradient dtype");
}

}  // namespace

absl::Status LaunchGradSumSquares(DType grad_dtype, const DeviceBlock* blocks,
                                  uint32_t num_blocks,
                                  const DeviceChunk* chunks,
                                  const DeviceTensor* tensors,
                                  double* partials, Stream stream) {
  if (num_blocks == 0) return absl::OkStatus();
  switch (grad_dtype) {
    case DType::kFloat32:
      GradSumSquaresKernel<F32><<<num_blocks, kThreadsPerBlock, 0, stream>>>(
          blocks, chunks, tensors, partials);
      break;
    case DType::kBFloat16:
      GradSumSquaresKernel<BF16><<<num_blocks, kThreadsPerBlock, 0, stream>>>(
          blocks, chunks, tensors, partials);
      break;
    case DType::kFloat16:
      GradSumSquaresKernel<F16><<<num_blocks, kThreadsPerBlock, 0, stream>>>(
          blocks, chunks, tensors, partials);
      break;
  }
  return Check(cudaGetLastError(), "gradient statistics kernel launch");
}

absl::Status LaunchReduceSums(const double* partials, uint32_t count,
                              double* out, Stream stream) {
  ReduceSumsKernel<<<1, kThreadsPerBlock, 0, stream>>>(partials, count, out);
  return Check(cudaGetLastError(), "reduce kernel launch");
}

absl::Status LaunchPrepareStep(const StepHyper& hyper,
                               const double* session_sums, uint32_t num_sums,
                               const DeviceGroupState* group,
                               DeviceScalars* scalars, Stream stream) {
  PrepareStepKernel<<<1, 1, 0, stream>>>(hyper, session_sums, num_sums, group,
                                         scalars);
  return Check(cudaGetLastError(), "prepare kernel launch");
}

absl::Status LaunchAdamW(const Layout& layout, bool adamw,
                             const DeviceBlock* blocks, uint32_t num_blocks,
                             const DeviceChunk* chunks,
                             const DeviceTensor* tensors,
                             const DeviceScalars* scalars, Stream stream) {
  if (num_blocks == 0) return absl::OkStatus();
  const Args a{blocks, num_blocks, chunks, tensors, scalars, adamw, stream};
  switch (layout.param_dtype) {
    case DType::kFloat32:
      return DispatchGrad<F32>(layout, a);
    case DType::kBFloat16:
      return DispatchGrad<BF16>(layout, a);
    case DType::kFloat16:
      return DispatchGrad<F16>(layout, a);
  }
  return absl::InvalidArgumentError("unknown parameter dtype");
}

namespace {

template <class S>
absl::Status ConvertTo(DType dst_dtype, const void* src, void* dst, uint64_t n,
                       Stream stream) {
  const unsigned blocks = static_cast<unsigned>(
      std::min<uint64_t>((n + kThreadsPerBlock - 1) / kThreadsPerBlock, 65536));
  switch (dst_dtype) {
    case DType::kFloat32:
      ConvertKernel<S, F32><<<blocks, kThreadsPerBlock, 0, stream>>>(src, dst, n);
      break;
    case DType::kBFloat16:
      ConvertKernel<S, BF16><<<blocks, kThreadsPerBlock, 0, stream>>>(src, dst, n);
      break;
    case DType::kFloat16:
      ConvertKernel<S, F16><<<blocks, kThreadsPerBlock, 0, stream>>>(src, dst, n);
      break;
  }
  return Check(cudaGetLastError(), "convert kernel launch");
}

}  // namespace

absl::Status LaunchConvert(DType src_dtype, const void* src, DType dst_dtype,
                           void* dst, uint64_t n, Stream stream) {
  if (n == 0) return absl::OkStatus();
  switch (src_dtype) {
    case DType::kFloat32:
      return ConvertTo<F32>(dst_dtype, src, dst, n, stream);
    case DType::kBFloat16:
      return ConvertTo<BF16>(dst_dtype, src, dst, n, stream);
    case DType::kFloat16:
      return ConvertTo<F16>(dst_dtype, src, dst, n, stream);
  }
  return absl::InvalidArgumentError("unknown dtype");
}

absl::Status LaunchCommitStep(const double* session_sums, uint32_t num_sums,
                              DeviceGroupState* group, Stream stream) {
  CommitStepKernel<<<1, 1, 0, stream>>>(session_sums, num_sums, group);
  return Check(cudaGetLastError(), "commit kernel launch");
}

}  // namespace cuda
}  // namespace optimd
