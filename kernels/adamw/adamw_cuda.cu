// The fused multi-tensor AdamW (and Adam) update on CUDA. The arithmetic
// follows kernels/adamw/adamw_cpu.h operation by operation (built with
// -fmad=false, IEEE division and square root), so results equal the CPU
// reference bit for bit given the same step scalars.
#include <cstdint>

#include "kernels/adamw/adamw_cuda.h"
#include "kernels/adamw/adamw_math.h"
#include "kernels/adamw/adamw_scalars.cuh"
#include "kernels/cuda_walk.cuh"

namespace optimd {
namespace cuda {
namespace {

// State slots: exp_avg, exp_avg_sq, max_exp_avg_sq (amsgrad).
template <int N, class P, class G, class M, MasterKind K, bool kAms,
          bool kAdamW>
__device__ __forceinline__ void UpdateN(const DeviceChunk& t, uint64_t i,
                                        const DeviceScalars& s,
                                        const BiasScalars& b) {
  float p[N], g[N], m[N], v[N], x[N];
  LoadWeight<N, P, K>(t, i, p);
  LoadF<N, G>(t.grad, i, g);
  LoadF<N, M>(t.state[0], i, m);
  LoadF<N, M>(t.state[1], i, v);
  if constexpr (kAms) LoadF<N, M>(t.state[2], i, x);
  const AdamWElementScalars e{s.grad_mul, s.decay, s.l2,  s.beta1,   s.beta2,
                              s.omb1,     s.omb2,  s.eps, b.neg_step};
  const auto div_bc2 = [&b](float a) { return DivByRecip(a, b.bc2, b.rbc2); };
#pragma unroll
  for (int k = 0; k < N; ++k) {
    p[k] = AdamWElement<kAms, kAdamW>(g[k], p[k], m[k], v[k], x[k], e, div_bc2);
  }
  StoreF<N, M>(t.state[0], i, m);
  StoreF<N, M>(t.state[1], i, v);
  if constexpr (kAms) StoreF<N, M>(t.state[2], i, x);
  StoreWeight<N, P, K>(t, i, p);
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

// The kernel for one layout, with amsgrad and AdamW/Adam as template
// flags.
struct AdamWLaunch {
  const Layout& layout;
  bool adamw;
  const Work& work;
  const DeviceScalars* scalars;
  Stream stream;

  template <bool kAms, bool kAdamW, class P, class G, class M, MasterKind K>
  absl::Status Go() {
    AdamWKernel<P, G, M, K, kAms, kAdamW>
        <<<work.num_blocks, kThreadsPerBlock, 0, stream>>>(work, scalars);
    return LaunchStatus("AdamW kernel launch");
  }
  template <class P, class G, class M, MasterKind K>
  absl::Status Run() {
    if (layout.amsgrad()) {
      return adamw ? Go<true, true, P, G, M, K>()
                   : Go<true, false, P, G, M, K>();
    }
    return adamw ? Go<false, true, P, G, M, K>()
                 : Go<false, false, P, G, M, K>();
  }
};

}  // namespace

absl::Status LaunchAdamW(const Layout& layout, bool adamw, const Work& work,
                         const DeviceScalars* scalars, Stream stream) {
  if (work.num_blocks == 0) return absl::OkStatus();
  AdamWLaunch launch{layout, adamw, work, scalars, stream};
  return DispatchLayout(layout, launch);
}

}  // namespace cuda
}  // namespace optimd
