// Fused multi-tensor AdamW and gradient statistics on CUDA. The arithmetic
// follows kernels/adamw/adamw_cpu.h operation by operation (this file is built
// with -fmad=false, IEEE division and square root), so results equal the CPU
// reference bit for bit given the same step scalars.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "kernels/adamw/adamw_cuda.h"
#include "kernels/cuda_math.cuh"

namespace optimd {
namespace cuda {
namespace {

// Element types. Store: round to nearest even, keeping a NaN's sign and
// payload (as the CPU reference does). Round: the same for every value but
// NaN, which it may make the canonical NaN: the step kernels store with it
// only results of GPU arithmetic, whose NaNs are canonical already, and for
// those both agree (tests/cuda_math_test checks every float).
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

// Plain (weak, default-cached) global vector accesses. The compiler cannot
// tell that a pointer read from a shared-memory descriptor is global: it
// emitted generic accesses, and split some vector stores. Explicit
// ld/st.global measured 4% faster for 100,000 tensors of 10,000 elements
// on the H200, the same for large ones (bench/RESULTS.md). (The
// cache-operator intrinsics __ldca/__stwb compile to strong .STRONG.SM
// accesses; streaming hints, ld/st.global.cs, and 256-byte L2 prefetch
// hints measured 3-5% slower for fp32.)
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
// 8- or 16-byte pieces.
template <int kBytes>
__device__ __forceinline__ void LoadTile(const void* base, uint64_t i,
                                         uint32_t* w) {
  if constexpr (kBytes == 4) {
    const uint4* p =
        reinterpret_cast<const uint4*>(static_cast<const uint32_t*>(base) + i);
    const uint4 a = LoadGlobal(p), b = LoadGlobal(p + kTileElements / 8);
    w[0] = a.x, w[1] = a.y, w[2] = a.z, w[3] = a.w;
    w[4] = b.x, w[5] = b.y, w[6] = b.z, w[7] = b.w;
  } else {
    static_assert(kBytes == 2, "2- or 4-byte elements");
    const uint2* p =
        reinterpret_cast<const uint2*>(static_cast<const uint16_t*>(base) + i);
    const uint2 a = LoadGlobal(p), b = LoadGlobal(p + kTileElements / 8);
    w[0] = a.x, w[1] = a.y, w[2] = b.x, w[3] = b.y;
  }
}

template <int kBytes>
__device__ __forceinline__ void StoreTile(void* base, uint64_t i,
                                          const uint32_t* w) {
  if constexpr (kBytes == 4) {
    uint4* p = reinterpret_cast<uint4*>(static_cast<uint32_t*>(base) + i);
    StoreGlobal(p, make_uint4(w[0], w[1], w[2], w[3]));
    StoreGlobal(p + kTileElements / 8, make_uint4(w[4], w[5], w[6], w[7]));
  } else {
    static_assert(kBytes == 2, "2- or 4-byte elements");
    uint2* p = reinterpret_cast<uint2*>(static_cast<uint16_t*>(base) + i);
    StoreGlobal(p, make_uint2(w[0], w[1]));
    StoreGlobal(p + kTileElements / 8, make_uint2(w[2], w[3]));
  }
}

// Elements of one stream of type X as floats. N == 8: a lane's share of a
// tile (LoadTile). N == 1: element i alone.
template <int N, class X>
__device__ __forceinline__ void LoadF(const void* base, uint64_t i, float* x) {
  if constexpr (N == 1) {
    x[0] = X::Load(static_cast<const typename X::T*>(base)[i]);
  } else {
    static_assert(N == 8, "a tile lane holds 8 elements");
    uint32_t w[X::kTileWords];
    LoadTile<sizeof(typename X::T)>(base, i, w);
    X::Unpack(w, x);
  }
}

// Stores floats rounded to X (X::Round: results of GPU arithmetic only).
template <int N, class X>
__device__ __forceinline__ void StoreF(void* base, uint64_t i, const float* x) {
  if constexpr (N == 1) {
    static_cast<typename X::T*>(base)[i] = X::Round(x[0]);
  } else {
    static_assert(N == 8, "a tile lane holds 8 elements");
    uint32_t w[X::kTileWords];
    X::Pack(x, w);
    StoreTile<sizeof(typename X::T)>(base, i, w);
  }
}

// fp32 masters kept as bfloat16 parameters and 16-bit remainders.
template <int N>
__device__ __forceinline__ void LoadRemainderMasters(const void* param,
                                                     const void* rem,
                                                     uint64_t i, float* x) {
  if constexpr (N == 1) {
    x[0] = ReconstructFromRemainder(static_cast<const uint16_t*>(param)[i],
                                    static_cast<const int16_t*>(rem)[i]);
  } else {
    uint32_t h[4], r[4];
    LoadTile<2>(param, i, h);
    LoadTile<2>(rem, i, r);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      ReconstructFromRemainder2(h[j], r[j], &x[2 * j], &x[2 * j + 1]);
    }
  }
}

template <int N>
__device__ __forceinline__ void StoreRemainderMasters(void* param, void* rem,
                                                      uint64_t i,
                                                      const float* x) {
  if constexpr (N == 1) {
    SplitToRemainder(x[0], static_cast<uint16_t*>(param) + i,
                     static_cast<int16_t*>(rem) + i);
  } else {
    uint32_t h[4], r[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      SplitToRemainder2(x[2 * j], x[2 * j + 1], &h[j], &r[j]);
    }
    StoreTile<2>(param, i, h);
    StoreTile<2>(rem, i, r);
  }
}

// Walks work block blockIdx.x of `work`: its chunk descriptors are copied
// into shared memory once, then the block is one flattened space of tiles
// (one warp each) and one of scalar elements (one thread each), so tensor
// boundaries cost no idle lanes beyond a chunk's last partial tile and no
// dependent loads of descriptors. body.Prepare(chunks, n), run by every
// thread once the descriptors are in shared memory, derives per-chunk
// values for the walk; body.Tile(chunk, k, i) handles a lane's share of the
// tile at i - 4 * lane of the block's chunk k; body.Scalar(chunk, k, i)
// element i.
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
  body.Prepare(cs, n);
  __syncthreads();
  const uint32_t lane = threadIdx.x & 31, warp = threadIdx.x >> 5,
                 warps = blockDim.x >> 5;
  uint32_t k = 0;
  for (uint32_t t = warp; t < block.tiles; t += warps) {
    while (t >= tile_end[k]) ++k;
    const DeviceChunk& c = cs[k];
    const uint32_t first = tile_end[k] - c.tiles;
    body.Tile(
        c, k,
        c.begin + static_cast<uint64_t>(t - first) * kTileElements + 4 * lane);
  }
  k = 0;
  for (uint32_t e = threadIdx.x; e < block.scalars; e += blockDim.x) {
    while (e >= scalar_end[k]) ++k;
    const DeviceChunk& c = cs[k];
    const uint32_t first = k == 0 ? 0 : scalar_end[k - 1];
    body.Scalar(
        c, k,
        c.begin + static_cast<uint64_t>(c.tiles) * kTileElements + (e - first));
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
  template <int N>
  __device__ __forceinline__ void Add(const DeviceChunk& c, uint64_t i) {
    float g[N];
    LoadF<N, G>(c.grad, i, g);
#pragma unroll
    for (int q = 0; q < N; ++q) {
      const double x = g[q];
      acc += x * x;
    }
  }
  __device__ void Prepare(const DeviceChunk*, uint32_t) {}
  __device__ void Tile(const DeviceChunk& c, uint32_t, uint64_t i) {
    Add<8>(c, i);
  }
  __device__ void Scalar(const DeviceChunk& c, uint32_t, uint64_t i) {
    Add<1>(c, i);
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

// The scalars that depend on the step number t (see adamw_cpu.cc's
// MakeAdamWScalars: the same double arithmetic, rounded to float once).
struct BiasScalars {
  float neg_step, bc2, rbc2;
};
__device__ BiasScalars MakeBias(double lr, double beta1, double beta2,
                                bool bias_correction, uint64_t step_number) {
  const double t = static_cast<double>(step_number);
  const double bc1 = bias_correction ? 1.0 - pow(beta1, t) : 1.0;
  const double bc2 = bias_correction ? 1.0 - pow(beta2, t) : 1.0;
  BiasScalars b;
  b.bc2 = static_cast<float>(sqrt(bc2));
  b.rbc2 = __fdiv_rn(1.0f, b.bc2);
  b.neg_step = -static_cast<float>(lr / bc1);
  return b;
}

// The step scalars of one group.
__device__ DeviceScalars MakeScalars(const StepHyper& h, double total,
                                     uint64_t step) {
  DeviceScalars s{};
  s.skip = isfinite(total) ? 0 : 1;
  if (s.skip) return s;
  const double scale = h.grad_scale > 0 ? h.grad_scale : 1.0;
  const double norm = sqrt(total) / scale;
  double clip = 1.0;
  if (h.max_grad_norm > 0) clip = fmin(1.0, h.max_grad_norm / (norm + 1e-6));
  const BiasScalars b =
      MakeBias(h.lr, h.beta1, h.beta2, h.bias_correction, step + 1);
  s.lr = h.lr;
  s.beta1_d = h.beta1;
  s.beta2_d = h.beta2;
  s.t = step + 1;
  s.bias_correction = h.bias_correction;
  s.beta1 = static_cast<float>(h.beta1);
  s.beta2 = static_cast<float>(h.beta2);
  s.omb1 = static_cast<float>(1.0 - h.beta1);
  s.omb2 = static_cast<float>(1.0 - h.beta2);
  s.eps = static_cast<float>(h.eps);
  s.decay = h.adamw ? static_cast<float>(1.0 - h.lr * h.weight_decay) : 1.0f;
  s.l2 = h.adamw ? 0.0f : static_cast<float>(h.weight_decay);
  s.bc2 = b.bc2;
  s.rbc2 = b.rbc2;
  s.neg_step = b.neg_step;
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
  if (skipped) return;
  for (uint32_t g = 0; g < n; ++g) {
    const uint32_t* absent = scratch[g].absent;
    for (uint32_t i = threadIdx.x; i < absent[0]; i += blockDim.x) {
      scratch[g].missed[absent[1 + i]] += 1;
    }
  }
}

template <int N, class P, class G, class M, MasterKind K, bool kAms,
          bool kAdamW>
__device__ __forceinline__ void UpdateN(const DeviceChunk& t, uint64_t i,
                                        const DeviceScalars& s,
                                        const BiasScalars& b) {
  float p[N], g[N], m[N], v[N], x[N];
  // With an fp32 master the old parameter is never read.
  if constexpr (K == MasterKind::kFp32) {
    LoadF<N, F32>(t.master, i, p);
  } else if constexpr (K == MasterKind::kRemainder) {
    LoadRemainderMasters<N>(t.param, t.master, i, p);
  } else {
    LoadF<N, P>(t.param, i, p);
  }
  LoadF<N, G>(t.grad, i, g);
  LoadF<N, M>(t.exp_avg, i, m);
  LoadF<N, M>(t.exp_avg_sq, i, v);
  if constexpr (kAms) LoadF<N, M>(t.max_exp_avg_sq, i, x);
#pragma unroll
  for (int k = 0; k < N; ++k) {
    float gk = g[k] * s.grad_mul;
    float pk = p[k];
    if constexpr (kAdamW) {
      pk = pk * s.decay;
    } else {
      gk = gk + s.l2 * pk;
    }
    m[k] = m[k] * s.beta1 + s.omb1 * gk;
    v[k] = v[k] * s.beta2 + s.omb2 * gk * gk;
    float vd = v[k];
    if constexpr (kAms) {
      vd = fmaxf(x[k], vd);
      x[k] = vd;
    }
    const float denom = DivByRecip(sqrtf(vd), b.bc2, b.rbc2) + s.eps;
    p[k] = pk + b.neg_step * (m[k] / denom);
  }
  StoreF<N, M>(t.exp_avg, i, m);
  StoreF<N, M>(t.exp_avg_sq, i, v);
  if constexpr (kAms) StoreF<N, M>(t.max_exp_avg_sq, i, x);
  if constexpr (K == MasterKind::kFp32) {
    StoreF<N, F32>(t.master, i, p);
    StoreF<N, P>(t.param, i, p);
  } else if constexpr (K == MasterKind::kRemainder) {
    StoreRemainderMasters<N>(t.param, t.master, i, p);
  } else {
    StoreF<N, P>(t.param, i, p);
  }
}

// The update of a work block. Each chunk's bias scalars are the group's,
// or, for a tensor that missed steps without a gradient, those of its own
// step number (torch counts steps per parameter).
template <class P, class G, class M, MasterKind K, bool kAms, bool kAdamW>
struct Update {
  const DeviceScalars& s;
  const uint32_t* missed;
  BiasScalars* bias;  // shared memory, one per chunk of the block
  __device__ void Prepare(const DeviceChunk* cs, uint32_t n) {
    if (threadIdx.x >= n) return;
    const uint32_t m = missed[cs[threadIdx.x].entry];
    bias[threadIdx.x] = m == 0 ? BiasScalars{s.neg_step, s.bc2, s.rbc2}
                               : MakeBias(s.lr, s.beta1_d, s.beta2_d,
                                          s.bias_correction, s.t - m);
  }
  __device__ void Tile(const DeviceChunk& c, uint32_t k, uint64_t i) {
    UpdateN<8, P, G, M, K, kAms, kAdamW>(c, i, s, bias[k]);
  }
  __device__ void Scalar(const DeviceChunk& c, uint32_t k, uint64_t i) {
    UpdateN<1, P, G, M, K, kAms, kAdamW>(c, i, s, bias[k]);
  }
};

// At most 64 registers a thread: four resident blocks per multiprocessor,
// enough bytes in flight to keep HBM busy.
template <class P, class G, class M, MasterKind K, bool kAms, bool kAdamW>
__global__ void __launch_bounds__(kThreadsPerBlock, 4)
    AdamWKernel(const Work work, const DeviceScalars* __restrict__ scalars) {
  const DeviceScalars s = *scalars;
  if (s.skip) return;
  __shared__ BiasScalars bias[kMaxChunksPerBlock];
  Update<P, G, M, K, kAms, kAdamW> body{s, work.missed, bias};
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
  if (l.amsgrad()) {
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

__global__ void WriteProgressKernel(uint32_t* word, uint32_t value) {
  // Kernels before this one in the stream have completed and their writes
  // are visible; the fence orders this store after them for observers
  // outside this context (the trainer's stream).
  __threadfence_system();
  *reinterpret_cast<volatile uint32_t*>(word) = value;
}

}  // namespace

absl::Status LaunchWriteProgress(uint32_t* word, uint32_t value,
                                 Stream stream) {
  WriteProgressKernel<<<1, 1, 0, stream>>>(word, value);
  return Check(cudaGetLastError(), "progress kernel launch");
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
