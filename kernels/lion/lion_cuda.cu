// The fused multi-tensor Lion update on CUDA, as kernels/lion/lion_cpu.h
// writes it, operation by operation (built with -fmad=false), so results
// equal the CPU reference bit for bit.
#include <cstdint>

#include "kernels/cuda_walk.cuh"
#include "kernels/lion/lion_cuda.h"
#include "kernels/lion/lion_math.h"

namespace optimd {
namespace cuda {
namespace {

// State slot 0: exp_avg (the momentum).
template <int N, class P, class G, class M, MasterKind K>
__device__ __forceinline__ void UpdateN(const DeviceChunk& t, uint64_t i,
                                        const DeviceScalars& s) {
  float p[N], g[N], m[N];
  LoadWeight<N, P, K>(t, i, p);
  LoadF<N, G>(t.grad, i, g);
  LoadF<N, M>(t.state[0], i, m);
  const LionElementScalars e{s.grad_mul, s.decay, s.beta1, s.beta2,
                             s.omb1,     s.omb2,  s.neg_lr};
#pragma unroll
  for (int k = 0; k < N; ++k) p[k] = LionElement(g[k], p[k], m[k], e);
  StoreF<N, M>(t.state[0], i, m);
  StoreWeight<N, P, K>(t, i, p);
}

template <class P, class G, class M, MasterKind K>
struct Update {
  const DeviceScalars& s;
  __device__ void Prepare(const DeviceChunk*, uint32_t) {}
  __device__ void Tile(const DeviceChunk& c, uint32_t, uint64_t i) {
    UpdateN<8, P, G, M, K>(c, i, s);
  }
  __device__ void Scalar(const DeviceChunk& c, uint32_t, uint64_t i) {
    UpdateN<1, P, G, M, K>(c, i, s);
  }
};

template <class P, class G, class M, MasterKind K>
__global__ void __launch_bounds__(kThreadsPerBlock, 4)
    LionKernel(const Work work, const DeviceScalars* __restrict__ scalars) {
  const DeviceScalars s = *scalars;
  if (s.skip) return;
  Update<P, G, M, K> body{s};
  Walk(work, body);
}

struct LionLaunch {
  const Work& work;
  const DeviceScalars* scalars;
  Stream stream;

  template <class P, class G, class M, MasterKind K>
  absl::Status Run() {
    LionKernel<P, G, M, K>
        <<<work.num_blocks, kThreadsPerBlock, 0, stream>>>(work, scalars);
    return LaunchStatus("Lion kernel launch");
  }
};

}  // namespace

absl::Status LaunchLion(const Layout& layout, const Work& work,
                        const DeviceScalars* scalars, Stream stream) {
  if (work.num_blocks == 0) return absl::OkStatus();
  LionLaunch launch{work, scalars, stream};
  return DispatchLayout(layout, launch);
}

}  // namespace cuda
}  // namespace optimd
