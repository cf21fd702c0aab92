// The fused multi-tensor AdamW (and Adam) update on CUDA. The arithmetic
// follows kernels/adamw/adamw_cpu.h operation by operation (built with
// -fmad=false, IEEE division and square root), so results equal the CPU
// reference bit for bit given the same step scalars; float64 layouts too,
// in double.
#include <atomic>
#include <cstdint>
#include <type_traits>

#include "core/block8.h"
#include "kernels/adamw/adamw_cuda.h"
#include "kernels/adamw/adamw_math.h"
#include "kernels/adamw/adamw_scalars.cuh"
#include "kernels/block8_stage.cuh"
#include "kernels/cuda_walk.cuh"
#include "kernels/fp8_cuda.cuh"

namespace optimd {
namespace cuda {
namespace {

// State slots: exp_avg, exp_avg_sq, max_exp_avg_sq (amsgrad).
// The new weights are left in p[0 .. N). N == 8: a tile lane's elements,
// the second four at i + half (LoadTile). Without kStore nothing is
// written (the FP8 amax prediction's look ahead).
template <int N, class P, class G, class M, MasterKind K, bool kAms,
          bool kAdamW, bool kStore = true>
__device__ __forceinline__ void UpdateN(const DeviceItem& t, uint64_t i,
                                        const DeviceScalars& s,
                                        const BiasScalars& b, float* p,
                                        uint64_t half = kTileHalf) {
  float g[N], m[N], v[N], x[N];
  LoadWeight<N, P, K>(t, i, p, half);
  LoadF<N, G>(t.grad, i, g, half);
  LoadF<N, M>(t.state[0], i, m, half);
  LoadF<N, M>(t.state[1], i, v, half);
  if constexpr (kAms) LoadF<N, M>(t.state[2], i, x, half);
  const AdamWElementScalars e{s.grad_mul, s.decay, s.l2,  s.beta1,   s.beta2,
                              s.omb1,     s.omb2,  s.eps, b.neg_step};
  const auto div_bc2 = [&b](float a) { return DivByRecip(a, b.bc2, b.rbc2); };
#pragma unroll
  for (int k = 0; k < N; ++k) {
    p[k] = AdamWElement<kAms, kAdamW>(g[k], p[k], m[k], v[k], x[k], e, div_bc2);
  }
  if constexpr (!kStore) return;
  StoreF<N, M>(t.state[0], i, m, half);
  StoreF<N, M>(t.state[1], i, v, half);
  if constexpr (kAms) StoreF<N, M>(t.state[2], i, x, half);
  StoreWeight<N, P, K>(t, i, p, half);
}

// The bias scalars of a tensor that missed `missed` of the group's steps
// without a gradient: the group's, or those of its own step number (torch
// counts steps per parameter).
__device__ __forceinline__ BiasScalars BiasOf(const DeviceScalars& s,
                                              uint32_t missed) {
  return missed == 0 ? BiasScalars{s.neg_step, s.bc2, s.rbc2}
                     : MakeBias(s.lr, s.beta1_d, s.beta2_d, s.bias_correction,
                                s.t - missed);
}

// The bias scalars of each item of a work block (BiasOf its tensor). The
// walk's Prepare.
struct ItemBias {
  const DeviceScalars& s;
  const uint32_t* missed;
  BiasScalars* bias;  // shared memory, one per item of the block
  __device__ void Prepare(const DeviceItem* cs, uint32_t n) {
    if (threadIdx.x >= n) return;
    bias[threadIdx.x] = BiasOf(s, missed[cs[threadIdx.x].entry]);
  }
  __device__ void Finish(const DeviceItem* /*cs*/, uint32_t /*n*/) {}
  // WalkBlocks8's request for a block's streams ahead of time: none.
  __device__ void Prefetch(const DeviceItem& /*c*/, uint64_t /*first*/,
                           uint32_t /*n*/) {}
};

// The update of a work block.
template <class P, class G, class M, MasterKind K, bool kAms, bool kAdamW>
struct Update : ItemBias {
  __device__ void Tile(const DeviceItem& c, uint32_t k, uint64_t i) {
    float p[8];
    UpdateN<8, P, G, M, K, kAms, kAdamW>(c, i, s, bias[k], p);
  }
  __device__ void Scalar(const DeviceItem& c, uint32_t k, uint64_t i) {
    float p[1];
    UpdateN<1, P, G, M, K, kAms, kAdamW>(c, i, s, bias[k], p);
  }
};

// The update of FP8 parameters' masters, one warp per 256 elements of a
// item (WalkBlocks8), then their requantization (Fp8AfterUpdate,
// kernels/fp8_cuda.cuh): the warp holds whole scaling units of the
// one-pass recipes, so the master is read once.
template <class P, class G, class M, bool kAms, bool kAdamW>
struct UpdateFp8 : ItemBias {
  uint32_t* item_amax;  // shared memory, one per item of the block
  // Shared memory, one per item: its tensor's predicted amax bits, or
  // kNoPrediction (PredictedAmax).
  uint32_t* item_predicted;
  __device__ void Prepare(const DeviceItem* cs, uint32_t n) {
    ItemBias::Prepare(cs, n);
    if (threadIdx.x >= n) return;
    item_amax[threadIdx.x] = 0;
    item_predicted[threadIdx.x] = PredictedAmax(Fp8Of(cs[threadIdx.x]));
  }
  __device__ void Finish(const DeviceItem* cs, uint32_t n) {
    FinishItemAmax(cs, n, item_amax);
  }
  __device__ void Block(const DeviceItem& c, uint32_t k, uint64_t first,
                        uint32_t n) {
    constexpr MasterKind K = MasterKind::kFp32;
    const bool vector = n == kTileElements && c.tiles > 0;
    float p[8];
    if (vector) {
      UpdateN<8, P, G, M, K, kAms, kAdamW>(c, first + 4 * (threadIdx.x & 31), s,
                                           bias[k], p);
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const uint32_t e = Block8Offset(j);
        p[j] = 0.0f;
        if (e < n) {
          UpdateN<1, P, G, M, K, kAms, kAdamW>(c, first + e, s, bias[k], &p[j]);
        }
      }
    }
    Fp8AfterUpdate<P>(c, first, n, vector, p, item_amax + k, item_predicted[k]);
  }
};

// The block's scale from every lane's largest magnitude bits: one warp
// reduction on the bits. As unsigned integers the magnitudes' bits order
// as the magnitudes do, and a NaN's lie above infinity's, so the largest,
// read back, is Block8Max's result over the block or a NaN where it gives
// one, and Block8Scale makes every NaN canonical: the CPU's scale.
__device__ __forceinline__ float WarpBlock8Scale(uint32_t bits) {
  return Block8Scale(__uint_as_float(__reduce_max_sync(0xffffffffu, bits)));
}

// The weights and gradients of a block8 block's lane read element by
// element from global memory (a block that is not staged: partial or
// unaligned), valid elements only (the others: 0).
template <class P, class G, MasterKind K>
__device__ __forceinline__ void LoadBlock8Lane(const DeviceItem& c,
                                               uint64_t first, uint32_t n,
                                               float* p, float* g) {
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const uint32_t e = Block8Offset(j);
    p[j] = g[j] = 0.0f;
    if (e < n) {
      LoadWeight<1, P, K>(c, first + e, &p[j]);
      LoadF<1, G>(c.grad, first + e, &g[j]);
    }
  }
}

template <class P, MasterKind K>
__device__ __forceinline__ void StoreBlock8Lane(const DeviceItem& c,
                                                uint64_t first, uint32_t n,
                                                bool vector, const float* p) {
  if (vector) {
    StoreWeight<8, P, K>(c, first + 4 * (threadIdx.x & 31), p);
    return;
  }
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const uint32_t e = Block8Offset(j);
    if (e < n) StoreWeight<1, P, K>(c, first + e, &p[j]);
  }
}

// AdamW over block8 moments: the CPU reference's StepBlock8
// (kernels/adamw/adamw_cpu.cc) with one warp per block8 block. Each lane
// reads its elements' moments back (Block8Decode, by DecodeSigned8Times
// and DecodeUnsigned8Times), updates them with AdamWElement, then the warp
// takes the block's new maxima and every lane stores its codes. A whole,
// aligned block is read from the warp's shared-memory stage, which its
// Prefetch filled while the warp computed the block before it
// (kernels/block8_stage.cuh); another block straight from global memory.
template <class P, class G, MasterKind K, bool kAdamW>
struct UpdateBlock8 : ItemBias {
  static constexpr bool kRem = K == MasterKind::kRemainder;
  // The weight as stored: the fp32 master, or the parameter (alone, or
  // the high half beside the remainder).
  using W = std::conditional_t<K == MasterKind::kFp32, F32, P>;
  using Stage = Block8Stage<sizeof(typename W::T), sizeof(typename G::T), kRem>;
  static constexpr uint32_t kStageBytesPerWarp = 2 * Stage::kBytes;

  char* stage;        // shared memory: this warp's two slots
  uint32_t slot = 0;  // the slot the next Prefetch fills

  // What the warp's new second moments show, for the steps after
  // UpdateLane: their largest bits (sign included) over the warp, and
  // whether their codes all lie in the code set's normal range
  // (VCodesNormal).
  struct WarpV {
    uint32_t high;
    bool codes_normal;
  };

  // The lane's elements (with kWhole all 8, else those below n): moments
  // read back with the old scales (Block8Decode: with kFolded by one
  // multiplication, sm and sv then the scales folded with the codes' powers
  // of two, core/block8.h), updated with AdamWElement into p, m and
  // v; the largest magnitude bits of the new exp_avg into mmax (as its new
  // scale needs them). AdamWElement in two halves: the moments of every
  // element first, so that the warp knows whether all its second moments lie
  // where SqrtInRange is IEEE square root; then the weights, by SqrtInRange
  // where they do (one test for the warp instead of IEEE square root's test
  // and branch per element).
  template <bool kWhole, bool kFolded>
  __device__ __forceinline__ WarpV UpdateLane(uint32_t n, const BiasScalars& b,
                                              float sm, float sv,
                                              const uint8_t* mq,
                                              const uint8_t* vq, float* p,
                                              const float* g, float* m,
                                              float* v, uint32_t& mmax) const {
    const AdamWElementScalars e{s.grad_mul, s.decay, s.l2,  s.beta1,   s.beta2,
                                s.omb1,     s.omb2,  s.eps, b.neg_step};
    // The smallest and largest bits of the lane's new v, sign included.
    uint32_t vlow = 0xffffffffu, vhigh = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      if (!kWhole && Block8Offset(j) >= n) continue;
      m[j] = kFolded ? DecodeSigned8Folded(mq[j], sm)
                     : DecodeSigned8Times(mq[j], sm);
      v[j] = kFolded ? DecodeUnsigned8Folded(vq[j], sv)
                     : DecodeUnsigned8Times(vq[j], sv);
      p[j] = AdamWMoments<kAdamW>(g[j], p[j], m[j], v[j], e);
      mmax = max(mmax, __float_as_uint(m[j]) & 0x7fffffffu);
      vlow = min(vlow, __float_as_uint(v[j]));
      vhigh = max(vhigh, __float_as_uint(v[j]));
    }
    vlow = __reduce_min_sync(0xffffffffu, vlow);
    vhigh = __reduce_max_sync(0xffffffffu, vhigh);
    // Zero, subnormal, infinite, NaN and negative v (-0) fail the test.
    const bool in_range = vlow >= kSqrtInRangeLow && vhigh <= kSqrtInRangeHigh;
    // The weights, with square roots by `root` and the division by
    // sqrt(bias_correction2) by `div_bc2`.
    const auto apply = [&](auto root, auto div_bc2) {
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        if (!kWhole && Block8Offset(j) >= n) continue;
        p[j] = AdamWApply(p[j], m[j], root(v[j]), e, div_bc2);
      }
    };
    if (in_range) {
      apply([](float x) { return SqrtInRange(x); },
            [b](float a) { return DivByRecipFinite(a, b.bc2, b.rbc2); });
    } else {
      apply([](float x) { return AdamWSqrt(x); },
            [b](float a) { return DivByRecip(a, b.bc2, b.rbc2); });
    }
    return {vhigh, VCodesNormal(in_range, vlow, vhigh)};
  }

  // The block's new exp_avg_sq scale (WarpBlock8Scale of the magnitudes of
  // v, the lane's elements; those of a partial block's missing elements are
  // 0). Where no v has its sign bit set (the rule: v is a sum of squares),
  // the largest bits are the largest magnitude's, and the warp has them.
  __device__ __forceinline__ static float NewVScale(const WarpV& w,
                                                    const float* v) {
    if ((w.high >> 31) == 0) return Block8Scale(__uint_as_float(w.high));
    uint32_t vmax = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      vmax = max(vmax, __float_as_uint(v[j]) & 0x7fffffffu);
    }
    return WarpBlock8Scale(vmax);
  }

  // Whether every exp_avg_sq code of the block lies in the code set's normal
  // range under a multiplier kv whose pre is 1, so that EncodeUnsigned8Normal
  // gives them, for the warp's smallest and largest bits of v: all v lie
  // where SqrtInRange does (positive, normal, finite) and span at most 29
  // binades. Then with v in [2^a, 2^(b+1)), the scale below 2^(b+1) and
  // kv.mul = RN(1/scale) at least 2^-(b+1), every unit is at least
  // 2^(a-b-1) >= 2^-30.
  __device__ __forceinline__ static bool VCodesNormal(bool in_range,
                                                      uint32_t low,
                                                      uint32_t high) {
    return in_range && (high >> 23) - (low >> 23) <= 29;
  }

  // The codes of the lane's new moments under multipliers km and kv:
  // Block8Encode's, exp_avg's two at a time by one conversion instruction.
  // With kNormal (km.pre = kv.pre = 1, VCodesNormal, and the block's new
  // exp_avg scale finite, so every exp_avg is) exp_avg's by
  // EncodeSigned8x2Finite and exp_avg_sq's by EncodeUnsigned8Normal.
  template <bool kNormal>
  __device__ __forceinline__ static void EncodeLane(const float* m,
                                                    const float* v,
                                                    Block8Multiplier km,
                                                    Block8Multiplier kv,
                                                    uint8_t* mq, uint8_t* vq) {
#pragma unroll
    for (int j = 0; j < 8; j += 2) {
      const uint32_t pair =
          kNormal ? EncodeSigned8x2Finite(m[j], m[j + 1], km.mul)
                  : EncodeSigned8x2(m[j], m[j + 1], km.pre, km.mul);
      mq[j] = static_cast<uint8_t>(pair);
      mq[j + 1] = static_cast<uint8_t>(pair >> 8);
#pragma unroll
      for (int i = j; i < j + 2; ++i) {
        vq[i] = kNormal ? EncodeUnsigned8Normal(__fmul_rn(v[i], kv.mul))
                        : Block8Encode<false>(v[i], kv);
      }
    }
  }

  // Whether Block reads this block from the stage: whole, and every
  // stream 16-byte aligned (the item's tiles say so for its start, and a
  // block lies a multiple of 256 elements further).
  __device__ static bool Staged(const DeviceItem& c, uint32_t n) {
    return n == kBlock8Elements && c.tiles > 0;
  }

  // Copies a staged block's streams into the next slot (nothing for
  // another block), as one group of the lane's copies.
  __device__ void Prefetch(const DeviceItem& c, uint64_t first, uint32_t n) {
    char* to = stage + slot * Stage::kBytes;
    slot ^= 1;
    if (Staged(c, n)) {
      constexpr uint32_t kWeight = sizeof(typename W::T);
      constexpr uint32_t kGrad = sizeof(typename G::T);
      const void* weight = K == MasterKind::kFp32 ? c.master : c.param;
      StageBytes<kBlock8Elements * kWeight>(
          to, static_cast<const char*>(weight) + first * kWeight);
      StageBytes<kBlock8Elements * kGrad>(
          to + Stage::kGradAt,
          static_cast<const char*>(c.grad) + first * kGrad);
      if constexpr (kRem) {
        StageBytes<kBlock8Elements * 2>(
            to + Stage::kRemAt, static_cast<const char*>(c.master) + first * 2);
      }
      StageBytes<kBlock8Elements>(to + Stage::kExpAvgAt,
                                  static_cast<const char*>(c.state[0]) + first);
      StageBytes<kBlock8Elements>(to + Stage::kExpAvgSqAt,
                                  static_cast<const char*>(c.state[1]) + first);
      if ((threadIdx.x & 31) == 0) {
        Stage8Bytes(to + Stage::kScalesAt,
                    static_cast<const char*>(c.scales) +
                        first / kBlock8Elements * kBlock8Slots * sizeof(float));
      }
    }
    CommitStage();
  }

  // A staged block's lane elements: weights, gradients, codes and scales.
  __device__ __forceinline__ static void LoadStagedLane(const char* from,
                                                        float* p, float* g,
                                                        uint8_t* mq,
                                                        uint8_t* vq, float* sm,
                                                        float* sv) {
    uint32_t w[W::kTileWords], gw[G::kTileWords];
    LoadStagedTile<sizeof(typename W::T)>(from, w);
    if constexpr (kRem) {
      uint32_t r[4];
      LoadStagedTile<2>(from + Stage::kRemAt, r);
      ReconstructFromRemainder8(w, r, p);
    } else {
      W::Unpack(w, p);
    }
    LoadStagedTile<sizeof(typename G::T)>(from + Stage::kGradAt, gw);
    G::Unpack(gw, g);
    LoadStagedCodes(from + Stage::kExpAvgAt, mq);
    LoadStagedCodes(from + Stage::kExpAvgSqAt, vq);
    *sm = *reinterpret_cast<const float*>(from + Stage::kScalesAt);
    *sv = *reinterpret_cast<const float*>(from + Stage::kScalesAt + 4);
  }

  __device__ void Block(const DeviceItem& c, uint32_t k, uint64_t first,
                        uint32_t n) {
    // Since this block's Prefetch the walk has made one more (the next
    // block's, into the other slot): this block's slot is the one the
    // Prefetch after that refills.
    const char* from = stage + slot * Stage::kBytes;
    WaitForStageButNewest();
    const bool vector = Staged(c, n);
    float p[8], g[8], m[8] = {}, v[8] = {};
    uint8_t mq[8], vq[8];
    float sm, sv;
    float* scales = static_cast<float*>(c.scales) +
                    (first / kBlock8Elements) * kBlock8Slots;
    if (vector) {
      LoadStagedLane(from, p, g, mq, vq, &sm, &sv);
    } else {
      LoadBlock8Lane<P, G, K>(c, first, n, p, g);
      LoadCodes(static_cast<const uint8_t*>(c.state[0]), first, n, mq);
      LoadCodes(static_cast<const uint8_t*>(c.state[1]), first, n, vq);
      sm = scales[0];
      sv = scales[1];
    }
    // By value: a reference into shared memory was read again for every
    // element.
    const BiasScalars b = bias[k];
    uint32_t mmax = 0;  // magnitude bits (WarpBlock8Scale)
    // A whole block's lanes skip the per-element validity test, whose
    // branches cost more than the element's own update, where its scales
    // fold with the codes' powers of two (those of every block of a training
    // run's moments; the test is the same for the warp, so no lane takes
    // another path); other blocks take the test (n is 256 for a whole one).
    // A third path, whole blocks with unfolded scales, made the compiler
    // spill registers in the others.
    WarpV w;
    if (vector && sm < kSigned8FoldLimit && sv < kUnsigned8FoldLimit) {
      w = UpdateLane<true, true>(n, b, FoldedSigned8Scale(sm),
                                 FoldedUnsigned8Scale(sv), mq, vq, p, g, m, v,
                                 mmax);
    } else {
      w = UpdateLane<false, false>(n, b, sm, sv, mq, vq, p, g, m, v, mmax);
    }
    const float new_sm = WarpBlock8Scale(mmax);
    const float new_sv = NewVScale(w, v);
    const Block8Multiplier km = Block8MultiplierOf(new_sm);
    const Block8Multiplier kv = Block8MultiplierOf(new_sv);
    // Scales of 2^-64 and above (every block of a training run's moments
    // but those of gradients near zero) take the codes without the
    // multiplication by pre = 1, which changes no bit.
    if (km.pre == 1.0f && kv.pre == 1.0f) {
      if (w.codes_normal && isfinite(new_sm)) {
        EncodeLane<true>(m, v, {1.0f, km.mul}, {1.0f, kv.mul}, mq, vq);
      } else {
        EncodeLane<false>(m, v, {1.0f, km.mul}, {1.0f, kv.mul}, mq, vq);
      }
    } else {
      EncodeLane<false>(m, v, km, kv, mq, vq);
    }
    StoreBlock8Lane<P, K>(c, first, n, vector, p);
    StoreCodes(static_cast<uint8_t*>(c.state[0]), first, n, vector, mq);
    StoreCodes(static_cast<uint8_t*>(c.state[1]), first, n, vector, vq);
    // Every lane has read the old scales, and its part of the slot, which
    // the Prefetch after the next one refills.
    __syncwarp();
    if ((threadIdx.x & 31) == 0) {
      scales[0] = new_sm;
      scales[1] = new_sv;
    }
  }
  static constexpr uint64_t kBlock8Slots = 2;  // exp_avg, exp_avg_sq
};

// The float64 layout's bias scalars of each item of a work block, for the
// item's tensor's own step number (the group's, less the steps it
// missed). The walk's Prepare.
struct ItemBias64 {
  const DeviceScalars& s;
  const uint32_t* missed;
  BiasScalars64* bias;  // shared memory, one per item of the block
  __device__ void Prepare(const DeviceItem* cs, uint32_t n) {
    if (threadIdx.x >= n) return;
    bias[threadIdx.x] =
        MakeBias64(s.lr, s.beta1_d, s.beta2_d, s.bias_correction,
                   s.t - missed[cs[threadIdx.x].entry]);
  }
};

// The update of a work block of the float64 layout: the CPU reference's
// double arithmetic (IEEE division and square root, no contraction),
// element by element (a tile lane's: ForEachTileLaneElement).
template <bool kAms, bool kAdamW>
struct Update64 : ItemBias64 {
  __device__ __forceinline__ void One(const DeviceItem& c, uint32_t k,
                                      uint64_t i) {
    double* p = static_cast<double*>(c.param);
    const double* g = static_cast<const double*>(c.grad);
    double* m = static_cast<double*>(c.state[0]);
    double* v = static_cast<double*>(c.state[1]);
    double* x = static_cast<double*>(c.state[2]);
    const BiasScalars64& b = bias[k];
    const AdamWElementScalarsT<double> e{
        s.grad_mul_d,    s.decay_d,       s.l2_d,  s.beta1_d, s.beta2_d,
        1.0 - s.beta1_d, 1.0 - s.beta2_d, s.eps_d, b.neg_step};
    const double bc2 = b.bc2;
    const auto div_bc2 = [bc2](double a) { return a / bc2; };
    double mi = m[i], vi = v[i], xi = kAms ? x[i] : 0.0;
    p[i] = AdamWElement<kAms, kAdamW>(g[i], p[i], mi, vi, xi, e, div_bc2);
    m[i] = mi;
    v[i] = vi;
    if constexpr (kAms) x[i] = xi;
  }
  __device__ void Tile(const DeviceItem& c, uint32_t k, uint64_t i) {
    ForEachTileLaneElement(i, [&](uint64_t e) { One(c, k, e); });
  }
  __device__ void Scalar(const DeviceItem& c, uint32_t k, uint64_t i) {
    One(c, k, i);
  }
};

template <bool kAms, bool kAdamW>
__global__ void __launch_bounds__(kThreadsPerBlock, 4)
    AdamWFloat64Kernel(const Work work,
                       const DeviceScalars* __restrict__ scalars) {
  const DeviceScalars s = *scalars;
  if (s.skip) return;
  __shared__ BiasScalars64 bias[kMaxItemsPerBlock];
  Update64<kAms, kAdamW> body{{s, work.missed, bias}};
  Walk(work, body);
}

template <class P, class G, MasterKind K, bool kAdamW>
__global__ void __launch_bounds__(kThreadsPerBlock, 4)
    AdamWBlock8Kernel(const Work work,
                      const DeviceScalars* __restrict__ scalars) {
  const DeviceScalars s = *scalars;
  if (s.skip) return;
  __shared__ BiasScalars bias[kMaxItemsPerBlock];
  using Body = UpdateBlock8<P, G, K, kAdamW>;
  __shared__ uint4 stage[kThreadsPerBlock / 32 * Body::kStageBytesPerWarp / 16];
  Body body{{s, work.missed, bias},
            reinterpret_cast<char*>(stage) +
                (threadIdx.x >> 5) * Body::kStageBytesPerWarp};
  WalkBlocks8(work, body);
}

template <class P, class G, class M, bool kAms, bool kAdamW>
__global__ void __launch_bounds__(kThreadsPerBlock, 4)
    AdamWFp8Kernel(const Work work, const DeviceScalars* __restrict__ scalars) {
  const DeviceScalars s = *scalars;
  if (s.skip) return;
  __shared__ BiasScalars bias[kMaxItemsPerBlock];
  __shared__ uint32_t item_amax[kMaxItemsPerBlock];
  __shared__ uint32_t item_predicted[kMaxItemsPerBlock];
  UpdateFp8<P, G, M, kAms, kAdamW> body{
      {s, work.missed, bias}, item_amax, item_predicted};
  WalkBlocks8(work, body);
}

// Takes the last step's outcome into pr's miss count and candidate band
// (Fp8Prediction::misses, narrow); whether the update is to encode from
// this step's prediction. By pr's one thread, before its lists are
// emptied.
__device__ __forceinline__ bool KeepsPredicting(Fp8Prediction* pr) {
  pr->misses = pr->read_back ? pr->misses + 1 : 0;
  pr->read_back = 0;
  const uint32_t found = max(pr->count[0], pr->count[1]);
  if (found > kAmaxCandidates && pr->narrow < kMaxNarrow) {
    ++pr->narrow;
  } else if (found < kAmaxCandidates / 4 && pr->narrow > 0) {
    --pr->narrow;
  }
  return pr->misses < 2 || pr->misses % kRetryEvery == 0;
}

// The predicted amax of each per-tensor-scaled FP8 parameter of the
// launch (Fp8Prediction), before its update: a thread block per FP8
// parameter of work.fp8, a thread per candidate, each stepped as the
// update will step it but nothing stored; then the candidate lists are
// emptied for the update and the encode pass to fill again. A parameter
// without a gradient this step is not stepped and keeps its lists.
template <class P, class G, class M, bool kAms, bool kAdamW>
__global__ void __launch_bounds__(2 * kAmaxCandidates)
    AdamWFp8PredictKernel(const Work work,
                          const DeviceScalars* __restrict__ scalars) {
  const DeviceScalars s = *scalars;
  const DeviceFp8Tensor& t = work.fp8[blockIdx.x];
  Fp8Prediction* pr = t.prediction;
  if (s.skip || pr == nullptr) return;
  const DeviceItem& c = work.items[t.first_item];
  if (c.grad == nullptr) return;
  const uint32_t list = threadIdx.x / kAmaxCandidates;
  const uint32_t slot = threadIdx.x % kAmaxCandidates;
  const uint64_t index = pr->index[list][slot];
  uint32_t bits = 0;
  const bool found =
      slot < pr->count[list] && index < t.geometry.rows * t.geometry.cols;
  if (found) {
    float p;
    UpdateN<1, P, G, M, MasterKind::kFp32, kAms, kAdamW, false>(
        c, index, s, BiasOf(s, work.missed[c.entry]), &p);
    bits = MagnitudeBits(p);
  }
  constexpr uint32_t kWarps = 2 * kAmaxCandidates / 32;
  __shared__ uint32_t warp_max[kWarps], warp_found[kWarps];
  const uint32_t m = __reduce_max_sync(0xffffffffu, bits);
  const uint32_t any = __reduce_or_sync(0xffffffffu, found ? 1u : 0u);
  if ((threadIdx.x & 31) == 0) {
    warp_max[threadIdx.x >> 5] = m;
    warp_found[threadIdx.x >> 5] = any;
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  uint32_t amax = 0, found_any = 0;
  for (uint32_t w = 0; w < kWarps; ++w) {
    amax = max(amax, warp_max[w]);
    found_any |= warp_found[w];
  }
  pr->amax = amax;
  pr->predicted = found_any && KeepsPredicting(pr);
  pr->count[0] = pr->count[1] = 0;
}

// The update of one unit of a kUnitWalk FP8 parameter (WalkUnit,
// kernels/fp8_cuda.cuh): UpdateN on a lane's share of two of its rows, or
// on one element.
template <class P, class G, class M, bool kAms, bool kAdamW>
struct UnitUpdate {
  static constexpr MasterKind K = MasterKind::kFp32;
  const DeviceScalars& s;
  const BiasScalars b;  // by value, as UpdateBlock8 keeps it
  __device__ void Tile(const DeviceItem& c, uint64_t i, uint64_t half,
                       float* p) {
    UpdateN<8, P, G, M, K, kAms, kAdamW>(c, i, s, b, p, half);
  }
  __device__ void One(const DeviceItem& c, uint64_t i, float* p) {
    UpdateN<1, P, G, M, K, kAms, kAdamW>(c, i, s, b, p);
  }
};

// One thread block per unit task of `work`: the unit's 64 KB of new
// masters in dynamic shared memory (kUnitMastersBytes), so three resident
// blocks a multiprocessor.
constexpr int kUnitMastersBytes = kWalkUnitSide * kWalkUnitSide * 4;
template <class P, class G, class M, bool kAms, bool kAdamW>
__global__ void __launch_bounds__(kThreadsPerBlock, 3)
    AdamWFp8UnitKernel(const Work work,
                       const DeviceScalars* __restrict__ scalars) {
  const DeviceScalars s = *scalars;
  if (s.skip) return;
  extern __shared__ float4 unit_masters[];
  __shared__ uint4 item[sizeof(DeviceItem) / 16];
  __shared__ BiasScalars bias;
  __shared__ uint32_t unit_amax;
  const UnitTask task = work.unit_tasks[blockIdx.x];
  const uint4* src = reinterpret_cast<const uint4*>(work.items + task.item);
  if (threadIdx.x < sizeof(DeviceItem) / 16)
    item[threadIdx.x] = src[threadIdx.x];
  __syncthreads();
  const DeviceItem& c = *reinterpret_cast<const DeviceItem*>(item);
  if (c.end == c.begin) return;  // no gradient this step: left alone
  if (threadIdx.x == 0) {
    bias = BiasOf(s, work.missed[c.entry]);
    unit_amax = 0;
  }
  __syncthreads();
  UnitUpdate<P, G, M, kAms, kAdamW> body{s, bias};
  WalkUnit<P>(c, task.unit, reinterpret_cast<float*>(unit_masters), &unit_amax,
              body);
}

// At most 64 registers a thread: four resident blocks per multiprocessor,
// enough bytes in flight to keep HBM busy.
template <class P, class G, class M, MasterKind K, bool kAms, bool kAdamW>
__global__ void __launch_bounds__(kThreadsPerBlock, 4)
    AdamWKernel(const Work work, const DeviceScalars* __restrict__ scalars) {
  const DeviceScalars s = *scalars;
  if (s.skip) return;
  __shared__ BiasScalars bias[kMaxItemsPerBlock];
  Update<P, G, M, K, kAms, kAdamW> body{{s, work.missed, bias}};
  Walk(work, body);
}

// Lets `kernel` take `bytes` of dynamic shared memory on the current
// device, once per device (`allowed` holds a bit per device already done;
// devices past 63 are set at every call).
template <class Kernel>
absl::Status AllowDynamicSharedMemory(Kernel kernel, int bytes,
                                      std::atomic<uint64_t>* allowed,
                                      const char* what) {
  int device = 0;
  cudaError_t e = cudaGetDevice(&device);
  const uint64_t bit = device < 64 ? uint64_t{1} << device : 0;
  if (e == cudaSuccess && bit != 0 &&
      (allowed->load(std::memory_order_acquire) & bit) != 0) {
    return absl::OkStatus();
  }
  if (e == cudaSuccess) {
    e = cudaFuncSetAttribute(
        kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  }
  if (e == cudaSuccess) allowed->fetch_or(bit, std::memory_order_release);
  return CudaErrorStatus(e, what);
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
  template <bool kAdamW, class P, class G, MasterKind K>
  absl::Status GoBlock8() {
    AdamWBlock8Kernel<P, G, K, kAdamW>
        <<<work.num_blocks, kThreadsPerBlock, 0, stream>>>(work, scalars);
    return LaunchStatus("AdamW block8 kernel launch");
  }
  // The amax prediction (per-tensor scaling), the item walk, then the
  // unit walk (Fp8Pass::kUnitWalk), each where it has work.
  template <class P, class G, class M, bool kAms, bool kAdamW>
  absl::Status GoFp8() {
    if (layout.fp8_recipe == Fp8Recipe::kTensor && work.num_fp8 > 0) {
      AdamWFp8PredictKernel<P, G, M, kAms, kAdamW>
          <<<work.num_fp8, 2 * kAmaxCandidates, 0, stream>>>(work, scalars);
      const absl::Status launched =
          LaunchStatus("AdamW FP8 amax prediction kernel launch");
      if (!launched.ok()) return launched;
    }
    if (work.num_blocks > 0) {
      AdamWFp8Kernel<P, G, M, kAms, kAdamW>
          <<<work.num_blocks, kThreadsPerBlock, 0, stream>>>(work, scalars);
      const absl::Status launched = LaunchStatus("AdamW FP8 kernel launch");
      if (!launched.ok()) return launched;
    }
    if (work.num_unit_tasks == 0) return absl::OkStatus();
    const auto kernel = AdamWFp8UnitKernel<P, G, M, kAms, kAdamW>;
    // The attribute holds per device: set once on each (bit d: device d).
    static std::atomic<uint64_t> allowed{0};
    if (absl::Status s =
            AllowDynamicSharedMemory(kernel, kUnitMastersBytes, &allowed,
                                     "FP8 unit kernel's shared memory");
        !s.ok()) {
      return s;
    }
    kernel<<<work.num_unit_tasks, kThreadsPerBlock, kUnitMastersBytes,
             stream>>>(work, scalars);
    return LaunchStatus("AdamW FP8 unit kernel launch");
  }
  template <class P, class G, class M>
  absl::Status RunFp8() {
    if (layout.amsgrad()) {
      return adamw ? GoFp8<P, G, M, true, true>()
                   : GoFp8<P, G, M, true, false>();
    }
    return adamw ? GoFp8<P, G, M, false, true>()
                 : GoFp8<P, G, M, false, false>();
  }
  template <bool kAms, bool kAdamW>
  absl::Status GoFloat64() {
    AdamWFloat64Kernel<kAms, kAdamW>
        <<<work.num_blocks, kThreadsPerBlock, 0, stream>>>(work, scalars);
    return LaunchStatus("AdamW float64 kernel launch");
  }
  static constexpr bool kTakesBlock8 = true;
  static constexpr bool kTakesFloat64 = true;
  // FP8 parameters: the update writes their masters and requantizes
  // them, or takes their amax for the encode pass (kernels/fp8_cuda.h).
  static constexpr bool kTakesFp8 = true;
  template <class P, class G, class M, MasterKind K>
  absl::Status Run() {
    if constexpr (IsFp8Param<P>::value) {
      return RunFp8<P, G, M>();
    } else if constexpr (std::is_same_v<P, F64>) {
      if (layout.amsgrad()) {
        return adamw ? GoFloat64<true, true>() : GoFloat64<true, false>();
      }
      return adamw ? GoFloat64<false, true>() : GoFloat64<false, false>();
    } else if constexpr (std::is_same_v<M, Block8>) {
      return adamw ? GoBlock8<true, P, G, K>() : GoBlock8<false, P, G, K>();
    } else if (layout.amsgrad()) {
      return adamw ? Go<true, true, P, G, M, K>()
                   : Go<true, false, P, G, M, K>();
    } else {
      return adamw ? Go<false, true, P, G, M, K>()
                   : Go<false, false, P, G, M, K>();
    }
  }
};

}  // namespace

absl::Status LaunchAdamW(const Layout& layout, bool adamw, const Work& work,
                         const DeviceScalars* scalars, Stream stream) {
  // LaunchUpdate (kernels/step_cuda.cu) never calls with no work at all.
  AdamWLaunch launch{layout, adamw, work, scalars, stream};
  return DispatchLayout(layout, launch);
}

}  // namespace cuda
}  // namespace optimd
