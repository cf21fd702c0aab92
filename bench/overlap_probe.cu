// Update kernels for bench/overlap_probe.py: fp32 AdamW over flat p, g, m,
// v buffers (decoupled weight decay, torch's formula), in two forms that
// can run on a chosen number of SMs:
//   probe_adamw_simt: a grid-stride loop, each thread two float4 of every
//     stream in flight (its grid: the SMs it may hold);
//   probe_adamw_simtcs: the same with streaming cache hints;
//   probe_adamw_bulk: one block per SM; a single thread moves 8 KiB chunks
//     of each stream between global and shared memory with the Hopper bulk
//     copy engine (cp.async.bulk, completion on an mbarrier), kStages chunks
//     in flight, and the block computes in shared memory.
// A probe, not the daemon's kernels: it asks how few SMs hold a
// bandwidth-bound update beside a compute-bound forward.
//
//   nvcc -cubin -O3 -gencode arch=compute_90,code=sm_90 \
//       -o overlap_probe.cubin bench/overlap_probe.cu
#include <cstdint>

namespace {

struct Hyper {
  float lr, beta1, beta2, eps, decay, bc1, bc2_sqrt;
};

__device__ __forceinline__ void AdamW(float& p, float g, float& m, float& v,
                                      const Hyper& h) {
  p = p * (1.0f - h.lr * h.decay);
  m = h.beta1 * m + (1.0f - h.beta1) * g;
  v = h.beta2 * v + (1.0f - h.beta2) * g * g;
  const float denom = sqrtf(v) / h.bc2_sqrt + h.eps;
  p = p - (h.lr / h.bc1) * m / denom;
}

__device__ __forceinline__ void AdamW4(float4& p, float4 g, float4& m,
                                       float4& v, const Hyper& h) {
  AdamW(p.x, g.x, m.x, v.x, h);
  AdamW(p.y, g.y, m.y, v.y, h);
  AdamW(p.z, g.z, m.z, v.z, h);
  AdamW(p.w, g.w, m.w, v.w, h);
}

constexpr int kChunk = 2048;  // floats of each stream per stage (8 KiB)
constexpr int kStages = 4;    // 4 stages x 4 streams x 8 KiB = 128 KiB

__device__ __forceinline__ uint32_t Smem(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void BarrierInit(uint64_t* bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(Smem(bar)));
}

__device__ __forceinline__ void ExpectBytes(uint64_t* bar, uint32_t bytes) {
  asm volatile(
      "mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(Smem(bar)),
      "r"(bytes));
}

__device__ __forceinline__ void Wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n"
      "}\n" ::"r"(Smem(bar)),
      "r"(parity));
}

__device__ __forceinline__ void LoadBulk(void* to, const void* from,
                                         uint32_t bytes, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes "
      "[%0], [%1], %2, [%3];" ::"r"(Smem(to)),
      "l"(from), "r"(bytes), "r"(Smem(bar))
      : "memory");
}

__device__ __forceinline__ void StoreBulk(void* to, const void* from,
                                          uint32_t bytes) {
  asm volatile(
      "cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(to),
      "r"(Smem(from)), "r"(bytes)
      : "memory");
}

}  // namespace

// Cache policy of the SIMT form's accesses: default, or streaming
// (ld/st.global.cs: evict first, so the update's 28 bytes a parameter do not
// push the forward's operands out of L2).
template <bool kStreaming>
__device__ __forceinline__ float4 Load(const float4* p) {
  return kStreaming ? __ldcs(p) : *p;
}
template <bool kStreaming>
__device__ __forceinline__ void Store(float4* p, float4 x) {
  if (kStreaming) {
    __stcs(p, x);
  } else {
    *p = x;
  }
}

template <bool kStreaming>
__device__ __forceinline__ void Simt(float4* p, const float4* g, float4* m,
                                     float4* v, uint64_t n4, const Hyper& h) {
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  uint64_t i = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (; i < n4; i += 2 * stride) {
    const bool two = i + stride < n4;
    float4 p0 = Load<kStreaming>(p + i), g0 = Load<kStreaming>(g + i),
           m0 = Load<kStreaming>(m + i), v0 = Load<kStreaming>(v + i);
    float4 p1{}, g1{}, m1{}, v1{};
    if (two) {
      p1 = Load<kStreaming>(p + i + stride);
      g1 = Load<kStreaming>(g + i + stride);
      m1 = Load<kStreaming>(m + i + stride);
      v1 = Load<kStreaming>(v + i + stride);
    }
    AdamW4(p0, g0, m0, v0, h);
    Store<kStreaming>(p + i, p0);
    Store<kStreaming>(m + i, m0);
    Store<kStreaming>(v + i, v0);
    if (two) {
      AdamW4(p1, g1, m1, v1, h);
      Store<kStreaming>(p + i + stride, p1);
      Store<kStreaming>(m + i + stride, m1);
      Store<kStreaming>(v + i + stride, v1);
    }
  }
}

extern "C" __global__ void __launch_bounds__(1024)
    probe_adamw_simt(float4* p, const float4* g, float4* m, float4* v,
                     uint64_t n4, Hyper h) {
  Simt<false>(p, g, m, v, n4, h);
}

extern "C" __global__ void __launch_bounds__(1024)
    probe_adamw_simtcs(float4* p, const float4* g, float4* m, float4* v,
                       uint64_t n4, Hyper h) {
  Simt<true>(p, g, m, v, n4, h);
}

// n: a multiple of kChunk. Dynamic shared memory: kStages * 4 * 8 KiB.
extern "C" __global__ void __launch_bounds__(512)
    probe_adamw_bulk(float* p, const float* g, float* m, float* v, uint64_t n,
                     Hyper h) {
  extern __shared__ __align__(128) float stage[];
  __shared__ __align__(8) uint64_t full[kStages];
  constexpr uint32_t kBytes = kChunk * sizeof(float);
  const uint64_t chunks = n / kChunk;
  float* const streams[4] = {p, const_cast<float*>(g), m, v};
  auto slot = [&](int s, int k) { return stage + (s * 4 + k) * kChunk; };
  auto load = [&](int s, uint64_t c) {
    ExpectBytes(&full[s], 4 * kBytes);
    for (int k = 0; k < 4; ++k) {
      LoadBulk(slot(s, k), streams[k] + c * kChunk, kBytes, &full[s]);
    }
  };
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) BarrierInit(&full[s]);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    for (int s = 0; s < kStages; ++s) {
      const uint64_t c = blockIdx.x + static_cast<uint64_t>(s) * gridDim.x;
      if (c < chunks) load(s, c);
    }
  }
  __syncthreads();
  for (uint64_t it = 0;; ++it) {
    const uint64_t c = blockIdx.x + it * gridDim.x;
    if (c >= chunks) break;
    const int s = static_cast<int>(it % kStages);
    Wait(&full[s], static_cast<uint32_t>((it / kStages) & 1));
    float4* ps = reinterpret_cast<float4*>(slot(s, 0));
    const float4* gs = reinterpret_cast<const float4*>(slot(s, 1));
    float4* ms = reinterpret_cast<float4*>(slot(s, 2));
    float4* vs = reinterpret_cast<float4*>(slot(s, 3));
    for (int j = threadIdx.x; j < kChunk / 4; j += blockDim.x) {
      float4 pj = ps[j], mj = ms[j], vj = vs[j];
      AdamW4(pj, gs[j], mj, vj, h);
      ps[j] = pj;
      ms[j] = mj;
      vs[j] = vj;
    }
    // The generic-proxy writes above, seen by the bulk copy's reads.
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncthreads();
    if (threadIdx.x == 0) {
      for (int k : {0, 2, 3}) {
        StoreBulk(streams[k] + c * kChunk, slot(s, k), kBytes);
      }
      asm volatile("cp.async.bulk.commit_group;" ::: "memory");
      // This stage is loaded again once its stores have read it.
      const uint64_t next = c + static_cast<uint64_t>(kStages) * gridDim.x;
      if (next < chunks) {
        asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
        load(s, next);
      }
    }
  }
  if (threadIdx.x == 0) {
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
  }
}
