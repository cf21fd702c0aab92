// The fused multi-tensor SGD update on CUDA: torch.optim.SGD's arithmetic
// as kernels/sgd/sgd_cpu.h writes it, operation by operation (built with
// -fmad=false), so results equal the CPU reference bit for bit; float64
// layouts too, in double.
#include <cstdint>
#include <type_traits>

#include "kernels/cuda_walk.cuh"
#include "kernels/sgd/sgd_cuda.h"
#include "kernels/sgd/sgd_math.h"

namespace optimd {
namespace cuda {
namespace {

// State slot 0: the momentum buffer (without momentum there is none).
// `first`: the tensor's first step (the
// buffer starts as the gradient).
template <int N, class P, class G, class M, MasterKind K, bool kMomentum>
__device__ __forceinline__ void UpdateN(const DeviceItem& t, uint64_t i,
                                        const DeviceScalars& s, bool first) {
  float p[N], g[N], b[N];
  LoadWeight<N, P, K>(t, i, p);
  LoadF<N, G>(t.grad, i, g);
  if constexpr (kMomentum) {
    if (!first) LoadF<N, M>(t.state[0], i, b);
  }
  const SgdElementScalars e{s.grad_mul,      s.l2,     s.momentum,
                            s.dampening_mul, s.neg_lr, s.nesterov != 0};
#pragma unroll
  for (int k = 0; k < N; ++k) {
    p[k] = SgdElement<kMomentum>(g[k], p[k], b[k], first, e);
  }
  if constexpr (kMomentum) StoreF<N, M>(t.state[0], i, b);
  StoreWeight<N, P, K>(t, i, p);
}

// Whether each item of a work block takes its tensor's first step, from
// the tensor's own step number (t minus the steps it missed). The walk's
// Prepare.
struct ItemFirst {
  const DeviceScalars& s;
  const uint32_t* missed;
  bool* first;  // shared memory, one per item of the block
  __device__ void Prepare(const DeviceItem* cs, uint32_t n) {
    if (threadIdx.x >= n) return;
    first[threadIdx.x] = s.t - missed[cs[threadIdx.x].entry] == 1;
  }
};

// The update of a work block.
template <class P, class G, class M, MasterKind K, bool kMomentum>
struct Update : ItemFirst {
  __device__ void Tile(const DeviceItem& c, uint32_t k, uint64_t i) {
    UpdateN<8, P, G, M, K, kMomentum>(c, i, s, first[k]);
  }
  __device__ void Scalar(const DeviceItem& c, uint32_t k, uint64_t i) {
    UpdateN<1, P, G, M, K, kMomentum>(c, i, s, first[k]);
  }
};

// The update of a work block of the float64 layout: the CPU reference's
// double arithmetic with the unrounded scalars (no contraction), element
// by element (a tile lane's: ForEachTileLaneElement).
template <bool kMomentum>
struct Update64 : ItemFirst {
  __device__ __forceinline__ void One(const DeviceItem& c, uint32_t k,
                                      uint64_t i) {
    double* p = static_cast<double*>(c.param);
    const double* g = static_cast<const double*>(c.grad);
    double* buf = static_cast<double*>(c.state[0]);
    const SgdElementScalarsT<double> e{s.grad_mul_d, s.l2_d,
                                       s.momentum_d, s.dampening_mul_d,
                                       -s.lr,        s.nesterov != 0};
    double b = 0.0;
    if constexpr (kMomentum) {
      if (!first[k]) b = buf[i];
    }
    p[i] = SgdElement<kMomentum>(g[i], p[i], b, first[k], e);
    if constexpr (kMomentum) buf[i] = b;
  }
  __device__ void Tile(const DeviceItem& c, uint32_t k, uint64_t i) {
    ForEachTileLaneElement(i, [&](uint64_t e) { One(c, k, e); });
  }
  __device__ void Scalar(const DeviceItem& c, uint32_t k, uint64_t i) {
    One(c, k, i);
  }
};

template <class P, class G, class M, MasterKind K, bool kMomentum>
__global__ void __launch_bounds__(kThreadsPerBlock, 4)
    SgdKernel(const Work work, const DeviceScalars* __restrict__ scalars) {
  const DeviceScalars s = *scalars;
  if (s.skip) return;
  __shared__ bool first[kMaxItemsPerBlock];
  Update<P, G, M, K, kMomentum> body{{s, work.missed, first}};
  Walk(work, body);
}

template <bool kMomentum>
__global__ void __launch_bounds__(kThreadsPerBlock, 4)
    SgdFloat64Kernel(const Work work,
                     const DeviceScalars* __restrict__ scalars) {
  const DeviceScalars s = *scalars;
  if (s.skip) return;
  __shared__ bool first[kMaxItemsPerBlock];
  Update64<kMomentum> body{{s, work.missed, first}};
  Walk(work, body);
}

// The kernel for one layout; momentum (a state slot: the layout says) as a
// template flag. Nesterov is read from the step scalars (one uniform
// branch), so a step graph does not depend on it.
struct SgdLaunch {
  const Layout& layout;
  const Work& work;
  const DeviceScalars* scalars;
  Stream stream;

  template <bool kMomentum, class P, class G, class M, MasterKind K>
  absl::Status Go() {
    SgdKernel<P, G, M, K, kMomentum>
        <<<work.num_blocks, kThreadsPerBlock, 0, stream>>>(work, scalars);
    return LaunchStatus("SGD kernel launch");
  }
  template <bool kMomentum>
  absl::Status GoFloat64() {
    SgdFloat64Kernel<kMomentum>
        <<<work.num_blocks, kThreadsPerBlock, 0, stream>>>(work, scalars);
    return LaunchStatus("SGD float64 kernel launch");
  }
  static constexpr bool kTakesFloat64 = true;
  template <class P, class G, class M, MasterKind K>
  absl::Status Run() {
    const bool momentum = layout.state_slots != 0;
    if constexpr (std::is_same_v<P, F64>) {
      return momentum ? GoFloat64<true>() : GoFloat64<false>();
    } else {
      return momentum ? Go<true, P, G, M, K>() : Go<false, P, G, M, K>();
    }
  }
};

}  // namespace

absl::Status LaunchSgd(const Layout& layout, const Work& work,
                       const DeviceScalars* scalars, Stream stream) {
  if (work.num_blocks == 0) return absl::OkStatus();
  SgdLaunch launch{layout, work, scalars, stream};
  return DispatchLayout(layout, launch);
}

}  // namespace cuda
}  // namespace optimd
