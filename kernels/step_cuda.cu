// The step kernels every optimizer shares: gradient statistics, the
// prepare and commit kernels around the updates, progress words and dtype
// conversion; and the dispatch to each optimizer's update kernel.
#include <algorithm>
#include <cstdint>

#include "core/step_math.h"
#include "kernels/adamw/adamw_scalars.cuh"
#include "kernels/cuda_walk.cuh"
#include "kernels/lion/lion_scalars.cuh"
#include "kernels/sgd/sgd_scalars.cuh"
#include "kernels/step_cuda.h"

namespace optimd {
namespace cuda {
namespace {

// The optimizers `O...`, each one's part of the CUDA step
// (kernels/<optimizer>/<optimizer>_scalars.cuh: kKind, MakeScalars,
// Update), picked by kind.
template <class... O>
struct CudaOptimizerList {
  // The optimizer's own fields of `s`; none for an unknown kind.
  __device__ static void MakeScalars(OptimizerKind kind, const StepHyper& h,
                                     DeviceScalars* s) {
    ((kind == O::kKind ? O::MakeScalars(h, s) : void()), ...);
  }
  // The update of `hyper.kind`; INVALID_ARGUMENT for an unknown kind.
  static absl::Status Update(const OptimizerHyper& hyper, const Layout& layout,
                             const Work& work, const DeviceScalars* scalars,
                             Stream stream) {
    absl::Status out = absl::InvalidArgumentError("unknown optimizer");
    ((hyper.kind == O::kKind
          ? (void)(out = O::Update(hyper, layout, work, scalars, stream))
          : void()),
     ...);
    return out;
  }
};

// Every optimizer's part of the CUDA step, one entry each.
using CudaOptimizers = CudaOptimizerList<AdamWCuda, SgdCuda, LionCuda>;

template <class G>
struct SumSquares {
  double acc = 0;
  template <int N>
  __device__ __forceinline__ void Add(const DeviceItem& c, uint64_t i) {
    if constexpr (std::is_same_v<G, F64>) {
      // A lane's share of a tile (LoadTile's order) or one element.
      const double* g = static_cast<const double*>(c.grad) + i;
#pragma unroll
      for (int q = 0; q < N; ++q) {
        const double x = g[q < 4 ? q : kTileElements / 2 - 4 + q];
        acc += x * x;
      }
      return;
    } else {
      float g[N];
      LoadF<N, G>(c.grad, i, g);
#pragma unroll
      for (int q = 0; q < N; ++q) {
        const double x = g[q];
        acc += x * x;
      }
    }
  }
  __device__ void Prepare(const DeviceItem*, uint32_t) {}
  __device__ void Tile(const DeviceItem& c, uint32_t, uint64_t i) {
    Add<8>(c, i);
  }
  __device__ void Scalar(const DeviceItem& c, uint32_t, uint64_t i) {
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

__device__ inline uint32_t BitsOf(float x) { return __float_as_uint(x); }
__device__ inline uint32_t BitsOf(uint16_t x) { return x; }

// Whether step `ticket` lies in the abandoned range (AbandonedSteps),
// compared cyclically as 32 bits.
__device__ __forceinline__ bool InAbandonedRange(
    const volatile AbandonedSteps* abandoned, uint64_t ticket) {
  if (abandoned == nullptr) return false;
  const uint64_t range = abandoned->range;
  const uint32_t t = static_cast<uint32_t>(ticket);
  const uint32_t first = static_cast<uint32_t>(range);
  const uint32_t through = static_cast<uint32_t>(range >> 32);
  return static_cast<int32_t>(t - first) >= 0 &&
         static_cast<int32_t>(through - t) >= 0;
}

__global__ void NoteAbandonedKernel(const volatile AbandonedSteps* abandoned,
                                    uint64_t ticket, uint32_t* skip) {
  *skip = InAbandonedRange(abandoned, ticket) ? 1u : 0u;
}

// Blocks of an adopt kernel (grid-stride loops).
unsigned AdoptBlocks(uint64_t n) {
  return static_cast<unsigned>(
      std::min<uint64_t>((n + kThreadsPerBlock - 1) / kThreadsPerBlock, 65536));
}

// AdoptWrittenParamRange's rule for a remainder layout: a written +-0 or
// +-inf gets a zero remainder.
__global__ void AdoptWrittenRemainderKernel(const uint16_t* __restrict__ param,
                                            int16_t* __restrict__ rem,
                                            uint64_t n,
                                            const uint32_t* __restrict__ skip) {
  if (skip != nullptr && *skip != 0) return;
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  for (uint64_t i =
           static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       i < n; i += stride) {
    if (WrittenBf16ClearsRemainder(param[i])) rem[i] = 0;
  }
}

template <class P>
__global__ void AdoptWrittenKernel(const void* __restrict__ param,
                                   float* __restrict__ master, uint64_t n,
                                   const uint32_t* __restrict__ skip) {
  if (skip != nullptr && *skip != 0) return;
  const auto* p = static_cast<const typename P::T*>(param);
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  for (uint64_t i =
           static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       i < n; i += stride) {
    const typename P::T written = p[i];
    const float m = master[i];
    const float w = P::Load(written);
    // As AdoptWrittenParamRange: a NaN master stays under a NaN parameter.
    if (BitsOf(P::Store(m)) != BitsOf(written) && !(isnan(w) && isnan(m))) {
      master[i] = w;
    }
  }
}

// The step scalars of one group: skipped when the total sum of squares is
// not finite, unless the step applies non-finite gradients; else the
// gradient multiplier (loss scale, clip coefficient, maximize:
// core/step_math.h; NaN or 0 for a non-finite norm, as torch's
// clip_grad_norm_) and the optimizer's own.
__device__ DeviceScalars MakeScalars(const StepHyper& h, double total,
                                     uint64_t step) {
  DeviceScalars s{};
  s.skip = isfinite(total) || h.apply_nonfinite ? 0 : 1;
  if (s.skip) return s;
  const double norm = sqrt(total) / EffectiveGradScale(h.grad_scale);
  const double clip = ClipCoefficient(h.max_grad_norm, norm);
  s.grad_mul_d = GradMultiplier(h.grad_scale, clip, h.maximize != 0);
  s.grad_mul = static_cast<float>(s.grad_mul_d);
  s.t = step + 1;
  CudaOptimizers::MakeScalars(static_cast<OptimizerKind>(h.optimizer), h, &s);
  return s;
}

// The job's sum of squares from sums[n] (this session's share, or the
// ranks' all-reduced), sums[n + 1] (how many ranks' gradients were not
// finite) and sums[n + 2] (how many ranks contributed): NaN when any
// rank's gradients were not finite, or when not every rank's values are
// in (an all-reduce ended part-way: the step is skipped).
__device__ __forceinline__ double JobTotal(const double* sums, uint32_t n,
                                           uint32_t ranks) {
  const bool whole = sums[n + 2] == static_cast<double>(ranks);
  return sums[n + 1] != 0 || !whole ? __longlong_as_double(0x7ff8000000000000ll)
                                    : sums[n];
}

// The total a step goes by: the job's (JobTotal), or, for a session of its
// own whose step applies non-finite gradients (StepHyper.apply_nonfinite,
// the same in every group), its own sum of squares whatever it is, so that
// a NaN and an infinite norm clip as torch's clip_grad_norm_ does.
__device__ __forceinline__ double AppliedTotal(const GroupStep* scratch,
                                               const double* sums, uint32_t n,
                                               uint32_t ranks) {
  if (ranks == 1 && n > 0 && scratch[0].hyper.apply_nonfinite) {
    return SessionTotal(sums, n);
  }
  return JobTotal(sums, n, ranks);
}

// True when the daemon let this step through without its trainer
// (AbandonedSteps): the step is skipped, whatever the trainer asked for
// non-finite gradients.
__device__ __forceinline__ bool Abandoned(const GroupStep& a) {
  return a.flag_sequence != 0 && InAbandonedRange(a.abandoned, a.ticket);
}

__global__ void __launch_bounds__(kThreadsPerBlock)
    ReduceSumsKernel(const GroupStep* __restrict__ args,
                     GroupStep* __restrict__ scratch, uint32_t n,
                     int statistics, int contributes,
                     double* __restrict__ sums) {
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
  if (threadIdx.x == 0) {
    const bool abandoned = n > 0 && Abandoned(scratch[0]);
    if (abandoned) {
      // Read by the kernels after this one: the step is skipped.
      for (uint32_t g = 0; g < n; ++g) scratch[g].hyper.apply_nonfinite = 0;
    }
    const double total = SessionTotal(sums, n);
    const bool finite = isfinite(total) && !abandoned;
    sums[n] = contributes && finite ? total : 0.0;
    sums[n + 1] = finite ? 0.0 : 1.0;
    sums[n + 2] = 1.0;
  }
}

__global__ void __launch_bounds__(kThreadsPerBlock)
    MakeScalarsKernel(const GroupStep* __restrict__ scratch, uint32_t n,
                      const double* __restrict__ sums, uint32_t ranks) {
  const double total = AppliedTotal(scratch, sums, n, ranks);
  for (uint32_t g = threadIdx.x; g < n; g += blockDim.x) {
    const GroupStep& a = scratch[g];
    *a.scalars = MakeScalars(a.hyper, total, a.state->step);
  }
}

__global__ void CommitStepsKernel(const GroupStep* __restrict__ scratch,
                                  uint32_t n, const double* __restrict__ sums,
                                  uint32_t ranks,
                                  DeviceGroupState* __restrict__ totals,
                                  DeviceGroupState* __restrict__ report) {
  const double total = AppliedTotal(scratch, sums, n, ranks);
  const bool skipped =
      !isfinite(total) && !(n > 0 && scratch[0].hyper.apply_nonfinite);
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

__global__ void WriteProgressKernel(uint32_t* word, uint32_t value) {
  // Kernels before this one in the stream have completed and their writes
  // are visible; the fence orders this store after them for observers
  // outside this context (the trainer's stream).
  __threadfence_system();
  *reinterpret_cast<volatile uint32_t*>(word) = value;
}

__global__ void StampGlobalTimerKernel(uint64_t* where) {
  uint64_t now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  *reinterpret_cast<volatile uint64_t*>(where) = now;
}

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
    case DType::kBlock8:  // blockwise: core/session_state.cc converts it
      return absl::InvalidArgumentError("no element conversion to block8");
    case DType::kFloat64:  // a float64 layout has no master to convert
      return absl::InvalidArgumentError("no element conversion to float64");
  }
  return LaunchStatus("convert kernel launch");
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
    case DType::kFloat64:
      GradSumSquaresKernel<F64>
          <<<work.num_blocks, kThreadsPerBlock, 0, stream>>>(work, partials);
      break;
    case DType::kBlock8:  // never a gradient's dtype (server/convert.cc)
      return absl::InvalidArgumentError("a block8 gradient");
  }
  return LaunchStatus("gradient statistics kernel launch");
}

absl::Status LaunchReduceSums(const GroupStep* args, GroupStep* scratch,
                              uint32_t n, bool statistics, bool contributes,
                              double* sums, Stream stream) {
  ReduceSumsKernel<<<1, kThreadsPerBlock, 0, stream>>>(
      args, scratch, n, statistics ? 1 : 0, contributes ? 1 : 0, sums);
  return LaunchStatus("gradient sums kernel launch");
}

absl::Status LaunchMakeScalars(const GroupStep* scratch, uint32_t n,
                               const double* sums, uint32_t ranks,
                               Stream stream) {
  if (n == 0) return absl::OkStatus();
  MakeScalarsKernel<<<1, kThreadsPerBlock, 0, stream>>>(scratch, n, sums,
                                                        ranks);
  return LaunchStatus("step scalars kernel launch");
}

absl::Status LaunchUpdate(const OptimizerHyper& hyper, const Layout& layout,
                          const Work& work, const DeviceScalars* scalars,
                          Stream stream) {
  // A launch of kUnitWalk FP8 parameters alone has unit tasks only.
  if (work.num_blocks == 0 && work.num_unit_tasks == 0) {
    return absl::OkStatus();
  }
  return CudaOptimizers::Update(hyper, layout, work, scalars, stream);
}

absl::Status LaunchCommitSteps(const GroupStep* scratch, uint32_t n,
                               const double* sums, uint32_t ranks,
                               DeviceGroupState* totals,
                               DeviceGroupState* report, Stream stream) {
  CommitStepsKernel<<<1, kThreadsPerBlock, 0, stream>>>(scratch, n, sums, ranks,
                                                        totals, report);
  return LaunchStatus("commit kernel launch");
}

absl::Status LaunchWriteProgress(uint32_t* word, uint32_t value,
                                 Stream stream) {
  WriteProgressKernel<<<1, 1, 0, stream>>>(word, value);
  return LaunchStatus("progress kernel launch");
}

absl::Status LaunchStampGlobalTimer(uint64_t* where, Stream stream) {
  StampGlobalTimerKernel<<<1, 1, 0, stream>>>(where);
  return LaunchStatus("timer stamp kernel launch");
}

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
    case DType::kBlock8:
    case DType::kFloat64:  // a float64 layout has no master to convert
      break;
  }
  return absl::InvalidArgumentError("unknown dtype");
}

absl::Status LaunchNoteAbandoned(const volatile AbandonedSteps* abandoned,
                                 uint64_t ticket, uint32_t* skip,
                                 Stream stream) {
  NoteAbandonedKernel<<<1, 1, 0, stream>>>(abandoned, ticket, skip);
  return LaunchStatus("abandoned-step kernel launch");
}

absl::Status LaunchAdoptWrittenRemainder(const void* param, void* remainder,
                                         uint64_t n, Stream stream,
                                         const uint32_t* skip) {
  if (n == 0) return absl::OkStatus();
  const unsigned blocks = AdoptBlocks(n);
  AdoptWrittenRemainderKernel<<<blocks, kThreadsPerBlock, 0, stream>>>(
      static_cast<const uint16_t*>(param), static_cast<int16_t*>(remainder), n,
      skip);
  return LaunchStatus("written-remainder kernel launch");
}

absl::Status LaunchAdoptWritten(DType param_dtype, const void* param,
                                float* master, uint64_t n, Stream stream,
                                const uint32_t* skip) {
  if (n == 0) return absl::OkStatus();
  const unsigned blocks = AdoptBlocks(n);
  switch (param_dtype) {
    case DType::kFloat32:
      AdoptWrittenKernel<F32>
          <<<blocks, kThreadsPerBlock, 0, stream>>>(param, master, n, skip);
      break;
    case DType::kBFloat16:
      AdoptWrittenKernel<BF16>
          <<<blocks, kThreadsPerBlock, 0, stream>>>(param, master, n, skip);
      break;
    case DType::kFloat16:
      AdoptWrittenKernel<F16>
          <<<blocks, kThreadsPerBlock, 0, stream>>>(param, master, n, skip);
      break;
    case DType::kBlock8:      // state only, never a parameter
    case DType::kFloat64:     // never has a master (ResolveLayout)
    case DType::kFloat8E4M3:  // scaled codes: param_written is refused
    case DType::kFloat8E5M2:
      return absl::InvalidArgumentError(
          "written parameters are followed for bf16, fp16 and fp32 only");
  }
  return LaunchStatus("written-parameter kernel launch");
}

}  // namespace cuda
}  // namespace optimd
