// The fused multi-tensor Lion update on CUDA, as kernels/lion/lion_cpu.h
// writes it, operation by operation (built with -fmad=false), so results
// equal the CPU reference bit for bit; float64 layouts too, in double.
#include <cstdint>
#include <type_traits>

#include "kernels/cuda_walk.cuh"
#include "kernels/lion/lion_cuda.h"
#include "kernels/lion/lion_math.h"

namespace optimd {
namespace cuda {
namespace {

// State slot 0: exp_avg (the momentum).
template <int N, class P, class G, class M, MasterKind K>
__device__ __forceinline__ void UpdateN(const DeviceItem& t, uint64_t i,
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
  __device__ void Prepare(const DeviceItem*, uint32_t) {}
  __device__ void Tile(const DeviceItem& c, uint32_t, uint64_t i) {
    UpdateN<8, P, G, M, K>(c, i, s);
  }
  __device__ void Scalar(const DeviceItem& c, uint32_t, uint64_t i) {
    UpdateN<1, P, G, M, K>(c, i, s);
  }
};

// The update of a work block of the float64 layout: the CPU reference's
// double arithmetic with the unrounded scalars (no contraction), element
// by element (a tile lane's: ForEachTileLaneElement).
struct Update64 {
  const DeviceScalars& s;
  __device__ void Prepare(const DeviceItem*, uint32_t) {}
  __device__ __forceinline__ void One(const DeviceItem& c, uint64_t i) {
    double* p = static_cast<double*>(c.param);
    const double* g = static_cast<const double*>(c.grad);
    double* m = static_cast<double*>(c.state[0]);
    const LionElementScalarsT<double> e{
        s.grad_mul_d,    s.decay_d,       s.beta1_d, s.beta2_d,
        1.0 - s.beta1_d, 1.0 - s.beta2_d, -s.lr};
    double mi = m[i];
    p[i] = LionElement(g[i], p[i], mi, e);
    m[i] = mi;
  }
  __device__ void Tile(const DeviceItem& c, uint32_t, uint64_t i) {
    ForEachTileLaneElement(i, [&](uint64_t e) { One(c, e); });
  }
  __device__ void Scalar(const DeviceItem& c, uint32_t, uint64_t i) {
    One(c, i);
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

__global__ void __launch_bounds__(kThreadsPerBlock, 4)
    LionFloat64Kernel(const Work work,
                      const DeviceScalars* __restrict__ scalars) {
  const DeviceScalars s = *scalars;
  if (s.skip) return;
  Update64 body{s};
  Walk(work, body);
}

struct LionLaunch {
  const Work& work;
  const DeviceScalars* scalars;
  Stream stream;

  static constexpr bool kTakesFloat64 = true;
  template <class P, class G, class M, MasterKind K>
  absl::Status Run() {
    if constexpr (std::is_same_v<P, F64>) {
      LionFloat64Kernel<<<work.num_blocks, kThreadsPerBlock, 0, stream>>>(
          work, scalars);
      return LaunchStatus("Lion float64 kernel launch");
    } else {
      LionKernel<P, G, M, K>
          <<<work.num_blocks, kThreadsPerBlock, 0, stream>>>(work, scalars);
      return LaunchStatus("Lion kernel launch");
    }
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
