// Fused multi-tensor AdamW and gradient statistics on CUDA. The arithmetic
// follows kernels/adamw_cpu.h operation by operation (this file is built
// with -fmad=false, IEEE division and square root), so results equal the CPU
// reference bit for bit given the same step scalars.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "kernels/adamw_cuda.h"
#include "kernels/cuda_math.cuh"

namespace optimd {
namespace cuda {
namespace {

// Store: round to nearest even, keeping a NaN's sign and payload (as the
// CPU reference does). Round: the same for every value but NaN, which it
// may make the canonical NaN: the step kernels store with it only results
// of GPU arithmetic, whose NaNs are canonical already, and for those both
// agree (tests/cuda_math_test checks every float).
struct F32 {
  using T = float;
  __device__ static float Load(T x) { return x; }
  __device__ static T Store(float x) { return x; }
  __device__ static T Round(float x) { return x; }
};
struct BF16 {
  using T = uint16_t;
  __device__ static float Load(T x) {
    return __uint_as_float(static_cast<uint32_t>(x) << 16);
  }
  __device__ static T Store(float x) { return Bf16FromFloat(x); }
  // One conversion instruction instead of about seven.
  __device__ static T Round(float x) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(x));
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
  __device__ static T Round(float x) { return Store(x); }
};

// Elements of one stream. N == 8: a lane's share of a tile, elements
// i..i+3 and i+128..i+131 (i = tile start + 4 * lane), so each access of a
// warp covers 32 consecutive 8- or 16-byte pieces. N == 1: element i alone.
// Plain accesses: streaming hints (ld/st.global.cs) and 256-byte L2
// prefetch hints measured 3-5% slower for fp32 on the H200
// (bench/RESULTS.md).
template <int N, typename T>
__device__ __forceinline__ void LoadN(const void* base, uint64_t i, T* out) {
  const T* p = static_cast<const T*>(base) + i;
  if constexpr (N == 1) {
    out[0] = *p;
  } else {
    static_assert(N == 8, "a tile lane holds 8 elements");
    using Q = std::conditional_t<sizeof(T) == 4, uint4, uint2>;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const Q x = *reinterpret_cast<const Q*>(p + h * kTileElements / 2);
      memcpy(out + 4 * h, &x, sizeof(Q));
    }
  }
}

template <int N, typename T>
__device__ __forceinline__ void StoreN(void* base, uint64_t i, const T* in) {
  T* p = static_cast<T*>(base) + i;
  if constexpr (N == 1) {
    *p = in[0];
  } else {
    static_assert(N == 8, "a tile lane holds 8 elements");
    using Q = std::conditional_t<sizeof(T) == 4, uint4, uint2>;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      Q x;
      memcpy(&x, in + 4 * h, sizeof(Q));
      *reinterpret_cast<Q*>(p + h * kTileElements / 2) = x;
    }
  }
}

// Walks work block blockIdx.x of `work`: its chunk descriptors are copied
// into shared memory once, then the block is one flattened space of tiles
// (one warp each) and one of scalar elements (one thread each), so tensor
// boundaries cost no idle lanes beyond a chunk's last partial tile and no
// dependent loads of descriptors. body.Tile(chunk, i) handles a lane's
// share of the tile at i - 4 * lane; body.Scalar(chunk, i) element i.
// (Fewer thread blocks, each walking many work blocks and prefetching the
// next one's descriptors, measured slower on the H200: bench/RESULTS.md.)
template <class Body>
__device__ __forceinline__ void Walk(const Work& work, Body& body) {
  __shared__ uint4 buffer[kMaxChunksPerBlock * sizeof(DeviceChunk) / 16];
  // tile_end[k], scalar_end[k]: tiles and scalar elements of chunks <= k.
  __shared__ uint32_t tile_end[kMaxChunksPerBlock];
  __shared__ uint32_t scalar_end[kMaxChunksPerBlock];
  const DeviceChunk* cs = reinterpret_cast<const DeviceChunk*>(buffer);
  const DeviceBlock block = work.blocks[blockIdx.x];
  const uint32_t n = block.end - block.first;
  const uint4* src = reinterpret_cast<const uint4*>(work.chunks + block.first);
  const uint32_t pieces = n * static_cast<uint32_t>(sizeof(DeviceChunk) / 16);
  for (uint32_t i = threadIdx.x; i < pieces; i += blockDim.x) {
    buffer[i] = src[i];
  }
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
  __syncthreads();
  const uint32_t lane = threadIdx.x & 31, warp = threadIdx.x >> 5,
                 warps = blockDim.x >> 5;
  uint32_t k = 0;
  for (uint32_t t = warp; t < block.tiles; t += warps) {
    while (t >= tile_end[k]) ++k;
    const DeviceChunk& c = cs[k];
    const uint32_t first = tile_end[k] - c.tiles;
    body.Tile(c, c.begin + static_cast<uint64_t>(t - first) * kTileElements +
                     4 * lane);
  }
  k = 0;
  for (uint32_t e = threadIdx.x; e < block.scalars; e += blockDim.x) {
    while (e >= scalar_end[k]) ++k;
    const DeviceChunk& c = cs[k];
    const uint32_t first = k == 0 ? 0 : scalar_end[k - 1];
    body.Scalar(c, c.begin + static_cast<uint64_t>(c.tiles) * kTileElements +
                       (e - first));
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

template <class G>
struct SumSquares {
  double acc = 0;
  __device__ void Tile(const DeviceChunk& c, uint64_t i) {
    typename G::T v[8];
    LoadN<8>(c.grad, i, v);
#pragma unroll
    for (int q = 0; q < 8; ++q) {
      const double x = G::Load(v[q]);
      acc += x * x;
    }
  }
  __device__ void Scalar(const DeviceChunk& c, uint64_t i) {
    typename G::T v;
    LoadN<1>(c.grad, i, &v);
    const double x = G::Load(v);
    acc += x * x;
  }
};

template <class G>
__global__ void __launch_bounds__(kThreadsPerBlock)
    GradSumSquaresKernel(const Work work, double* __restrict__ partials) {
  SumSquares<G> body;
  Walk(work, body);
  const double total = BlockSum<kThreadsPerBlock>(body.acc);
  if (threadIdx.x == 0) partials[blockIdx.x] = total;
}

template <class S, class D>
__global__ void ConvertKernel(const void* __restrict__ src,
                              void* __restrict__ dst, uint64_t n) {
  const auto* in = static_cast<const typename S::T*>(src);
  auto* out = static_cast<typename D::T*>(dst);
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  for (uint64_t i =
           static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       i < n; i += stride) {
    out[i] = D::Store(S::Load(in[i]));
  }
}

// The step scalars of one group (see adamw_cpu.cc's MakeStepScalars: the
// same double arithmetic, rounded to float once).
__device__ DeviceScalars MakeScalars(const StepHyper& h, double total,
                                     uint64_t step) {
  DeviceScalars s{};
  s.skip = isfinite(total) ? 0 : 1;
  if (s.skip) return s;
  const double scale = h.grad_scale > 0 ? h.grad_scale : 1.0;
  const double norm = sqrt(total) / scale;
  double clip = 1.0;
  if (h.max_grad_norm > 0) clip = fmin(1.0, h.max_grad_norm / (norm + 1e-6));
  const double t = static_cast<double>(step + 1);
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
  s.rbc2 = __fdiv_rn(1.0f, s.bc2);
  s.neg_step = -static_cast<float>(h.lr / bc1);
  double mul = clip / scale;
  if (h.maximize) mul = -mul;
  s.grad_mul = static_cast<float>(mul);
  return s;
}

__global__ void __launch_bounds__(kThreadsPerBlock)
    PrepareStepsKernel(const GroupStep* __restrict__ args,
                       GroupStep* __restrict__ scratch, uint32_t n,
                       int statistics, double* __restrict__ sums) {
  // One pass over pinned host memory, all threads at once.
  {
    const uint4* src = reinterpret_cast<const uint4*>(args);
    uint4* dst = reinterpret_cast<uint4*>(scratch);
    const uint32_t pieces = n * static_cast<uint32_t>(sizeof(GroupStep) / 16);
    for (uint32_t i = threadIdx.x; i < pieces; i += blockDim.x) {
      dst[i] = src[i];
    }
  }
  __syncthreads();
  for (uint32_t g = 0; g < n; ++g) {
    double acc = 0;
    if (statistics) {
      const double* partials = scratch[g].partials;
      const uint32_t count = scratch[g].num_partials;
      for (uint32_t i = threadIdx.x; i < count; i += blockDim.x) {
        acc += partials[i];
      }
    }
    const double sum = BlockSum<kThreadsPerBlock>(acc);
    if (threadIdx.x == 0) sums[g] = sum;
    __syncthreads();  // BlockSum's shared memory is reused next round
  }
  __shared__ double total;
  if (threadIdx.x == 0) total = SessionTotal(sums, n);
  __syncthreads();
  for (uint32_t g = threadIdx.x; g < n; g += blockDim.x) {
    const GroupStep& a = scratch[g];
    *a.scalars = MakeScalars(a.hyper, total, a.state->step);
  }
}

__global__ void CommitStepsKernel(const GroupStep* __restrict__ scratch,
                                  uint32_t n, const double* __restrict__ sums,
                                  DeviceGroupState* __restrict__ totals,
                                  DeviceGroupState* __restrict__ report) {
  const double total = SessionTotal(sums, n);
  const bool skipped = !isfinite(total);
  for (uint32_t g = threadIdx.x; g <= n; g += blockDim.x) {
    DeviceGroupState* state = g == 0 ? totals : scratch[g - 1].state;
    DeviceGroupState s = *state;
    s.last_sumsq = total;
    s.last_skipped = skipped ? 1 : 0;
    if (skipped) {
      s.skipped += 1;
    } else {
      s.step += 1;
    }
    *state = s;
    report[g] = s;
  }
}

template <int N, class P, class G, class M, MasterKind K, bool kAms,
          bool kAdamW>
__device__ __forceinline__ void UpdateN(const DeviceChunk& t, uint64_t i,
                                        const DeviceScalars& s) {
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
      p = ReconstructFromRemainder(pr[k], rem[k]);
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
    mr[k] = M::Round(mi);
    vr[k] = M::Round(vi);
    float vd = vi;
    if constexpr (kAms) {
      vd = fmaxf(M::Load(xr[k]), vi);
      xr[k] = M::Round(vd);
    }
    const float denom = DivByRecip(sqrtf(vd), s.bc2, s.rbc2) + s.eps;
    p = p + s.neg_step * (mi / denom);
    if constexpr (K == MasterKind::kFp32) {
      master[k] = p;
      pr[k] = P::Round(p);
    } else if constexpr (K == MasterKind::kRemainder) {
      uint16_t hi;
      SplitToRemainder(p, &hi, &rem[k]);
      pr[k] = hi;
    } else {
      pr[k] = P::Round(p);
    }
  }
  StoreN<N>(t.param, i, pr);
  StoreN<N>(t.exp_avg, i, mr);
  StoreN<N>(t.exp_avg_sq, i, vr);
  if constexpr (kAms) StoreN<N>(t.max_exp_avg_sq, i, xr);
  if constexpr (K == MasterKind::kFp32) StoreN<N>(t.master, i, master);
  if constexpr (K == MasterKind::kRemainder) StoreN<N>(t.master, i, rem);
}

template <class P, class G, class M, MasterKind K, bool kAms, bool kAdamW>
struct Update {
  const DeviceScalars& s;
  __device__ void Tile(const DeviceChunk& c, uint64_t i) {
    UpdateN<8, P, G, M, K, kAms, kAdamW>(c, i, s);
  }
  __device__ void Scalar(const DeviceChunk& c, uint64_t i) {
    UpdateN<1, P, G, M, K, kAms, kAdamW>(c, i, s);
  }
};

// At most 64 registers a thread: four resident blocks per multiprocessor,
// enough bytes in flight to keep HBM busy.
template <class P, class G, class M, MasterKind K, bool kAms, bool kAdamW>
__global__ void __launch_bounds__(kThreadsPerBlock, 4)
    AdamWKernel(const Work work, const DeviceScalars* __restrict__ scalars) {
  const DeviceScalars s = *scalars;
  if (s.skip) return;
  Update<P, G, M, K, kAms, kAdamW> body{s};
  Walk(work, body);
}

absl::Status Check(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorName(e), ": ",
                                          cudaGetErrorString(e)));
}

struct Args {
  Work work;
  const DeviceScalars* scalars;
  bool adamw;
  Stream stream;
};

template <class P, class G, class M, MasterKind K, bool kAms, bool kAdamW>
absl::Status Launch(const Args& a) {
  AdamWKernel<P, G, M, K, kAms, kAdamW>
      <<<a.work.num_blocks, kThreadsPerBlock, 0, a.stream>>>(a.work, a.scalars);
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

absl::Status LaunchGradSumSquares(DType grad_dtype, const Work& work,
                                  double* partials, Stream stream) {
  if (work.num_blocks == 0) return absl::OkStatus();
  switch (grad_dtype) {
    case DType::kFloat32:
      GradSumSquaresKernel<F32>
          <<<work.num_blocks, kThreadsPerBlock, 0, stream>>>(work, partials);
      break;
    case DType::kBFloat16:
      GradSumSquaresKernel<BF16>
          <<<work.num_blocks, kThreadsPerBlock, 0, stream>>>(work, partials);
      break;
    case DType::kFloat16:
      GradSumSquaresKernel<F16>
          <<<work.num_blocks, kThreadsPerBlock, 0, stream>>>(work, partials);
      break;
  }
  return Check(cudaGetLastError(), "gradient statistics kernel launch");
}

absl::Status LaunchPrepareSteps(const GroupStep* args, GroupStep* scratch,
                                uint32_t n, bool statistics, double* sums,
                                Stream stream) {
  if (n == 0) return absl::OkStatus();
  PrepareStepsKernel<<<1, kThreadsPerBlock, 0, stream>>>(
      args, scratch, n, statistics ? 1 : 0, sums);
  return Check(cudaGetLastError(), "prepare kernel launch");
}

absl::Status LaunchCommitSteps(const GroupStep* scratch, uint32_t n,
                               const double* sums, DeviceGroupState* totals,
                               DeviceGroupState* report, Stream stream) {
  CommitStepsKernel<<<1, kThreadsPerBlock, 0, stream>>>(scratch, n, sums,
                                                        totals, report);
  return Check(cudaGetLastError(), "commit kernel launch");
}

absl::Status LaunchAdamW(const Layout& layout, bool adamw, const Work& work,
                         const DeviceScalars* scalars, Stream stream) {
  if (work.num_blocks == 0) return absl::OkStatus();
  const Args a{work, scalars, adamw, stream};
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
      ConvertKernel<S, F32>
          <<<blocks, kThreadsPerBlock, 0, stream>>>(src, dst, n);
      break;
    case DType::kBFloat16:
      ConvertKernel<S, BF16>
          <<<blocks, kThreadsPerBlock, 0, stream>>>(src, dst, n);
      break;
    case DType::kFloat16:
      ConvertKernel<S, F16>
          <<<blocks, kThreadsPerBlock, 0, stream>>>(src, dst, n);
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

}  // namespace cuda
}  // namespace optimd
