#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "core/block8.h"
#include "kernels/cuda_math.cuh"
#include "tests/cuda_math_check.h"

namespace optimd {
namespace testing {
namespace {

constexpr uint32_t kLast = 0x7fc00000u;  // the first quiet NaN

// Calls check(u) for every 32-bit pattern u from 0 to `last`; counts those
// for which it returns false, and the smallest of them.
template <class Check>
__global__ void ForEachBits(uint64_t last, Check check,
                            unsigned long long* mismatches,
                            uint32_t* first_bad) {
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  unsigned long long bad = 0;
  uint32_t first = 0xffffffffu;
  for (uint64_t v =
           static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       v <= last; v += stride) {
    const uint32_t u = static_cast<uint32_t>(v);
    if (!check(u)) {
      ++bad;
      first = min(first, u);
    }
  }
  if (bad != 0) {
    atomicAdd(mismatches, bad);
    atomicMin(first_bad, first);
  }
}

__device__ bool SameOrBothNan(float x, float y) {
  return __float_as_uint(x) == __float_as_uint(y) || (isnan(x) && isnan(y));
}

// The dividends of the step kernels are square roots of floats.
struct DivisionCheck {
  float b, rb;
  __device__ bool operator()(uint32_t u) const {
    const float a = __fsqrt_rn(__uint_as_float(u));
    return SameOrBothNan(cuda::DivByRecip(a, b, rb), __fdiv_rn(a, b));
  }
};

// SqrtInRange against IEEE square root: x runs over every float from 0
// (ForEachBits' start) and is shifted into SqrtInRange's range.
struct SqrtInRangeCheck {
  __device__ bool operator()(uint32_t u) const {
    const float x = __uint_as_float(u + cuda::kSqrtInRangeLow);
    return __float_as_uint(cuda::SqrtInRange(x)) ==
           __float_as_uint(__fsqrt_rn(x));
  }
};

struct Bf16Check {
  __device__ bool operator()(uint32_t bits) const {
    const float x = __uint_as_float(bits);
    if (isnan(x) && bits != 0x7fffffffu) return true;
    return __bfloat16_as_ushort(__float2bfloat16_rn(x)) ==
           cuda::Bf16FromFloat(x);
  }
};

// The remainder split as kernels/adamw/adamw_cpu.h defines it.
struct RemainderCheck {
  __device__ bool operator()(uint32_t u) const {
    const int16_t r = static_cast<int16_t>(static_cast<uint16_t>(u & 0xffffu));
    const uint16_t hi =
        static_cast<uint16_t>(((u >> 16) + (r < 0 ? 1u : 0u)) & 0xffffu);
    uint16_t got_hi;
    int16_t got_r;
    cuda::SplitToRemainder(__uint_as_float(u), &got_hi, &got_r);
    const float back = cuda::ReconstructFromRemainder(hi, r);
    return got_hi == hi && got_r == r && __float_as_uint(back) == u;
  }
};

// A partner for u in a packed pair: another float of every class as u
// runs over all of them.
__device__ uint32_t Partner(uint32_t u) { return __brev(u) ^ 0x5a5a5a5au; }

// The hardware's pair of block8 exp_avg codes against Block8Encode<true>,
// the CPU's, for every float x paired with another (Partner(x)), in blocks
// of three multipliers: the identity (x itself is the unit), one that
// scales by less than 1, and a subnormal scale's (pre 2^64); and
// EncodeSigned8x2Finite's for the finite pairs.
struct Signed8Check {
  __device__ bool operator()(uint32_t u) const {
    const float x = __uint_as_float(u), y = __uint_as_float(Partner(u));
    // Both bytes of `pair` are the CPU's codes of x and y under k.
    const auto same = [x, y](uint32_t pair, const Block8Multiplier& k) {
      return (pair & 0xffu) == Block8Encode<true>(x, k) &&
             (pair >> 8) == Block8Encode<true>(y, k);
    };
    const Block8Multiplier ks[3] = {
        {1.0f, 1.0f}, Block8MultiplierOf(1.3f), Block8MultiplierOf(3e-39f)};
    for (const Block8Multiplier& k : ks) {
      if (!same(cuda::EncodeSigned8x2(x, y, k.pre, k.mul), k)) return false;
    }
    // The finite form, for finite x and y in blocks of finite scales of
    // 2^-64 and above (pre 1): the identity, 1.3's, and one whose
    // multiplier sends most floats past 1.
    if (!isfinite(x) || !isfinite(y)) return true;
    const Block8Multiplier finite[3] = {
        {1.0f, 1.0f}, Block8MultiplierOf(1.3f), Block8MultiplierOf(1e-19f)};
    for (const Block8Multiplier& k : finite) {
      if (k.pre != 1.0f || !same(cuda::EncodeSigned8x2Finite(x, y, k.mul), k)) {
        return false;
      }
    }
    return true;
  }
};

// The arithmetic block8 decodes against Block8Decode, the CPU's: code u's
// low byte under a scale made of u's other bits (every exponent, zero,
// subnormal, infinite and NaN scales among them).
struct Decode8Check {
  __device__ bool operator()(uint32_t u) const {
    const uint8_t c = static_cast<uint8_t>(u);
    const float scale =
        __uint_as_float((__brev(u) ^ 0x5a5a5a5au) & 0x7fffffffu);
    return SameOrBothNan(cuda::DecodeSigned8Times(c, scale),
                         Block8Decode<true>(c, scale)) &&
           SameOrBothNan(cuda::DecodeUnsigned8Times(c, scale),
                         Block8Decode<false>(c, scale));
  }
};

// The folded block8 decodes against Block8Decode, the CPU's: code u's low
// byte under a scale below the fold limits made of u's other bits (zero and
// subnormal scales among them).
struct FoldedDecode8Check {
  __device__ bool operator()(uint32_t u) const {
    const uint8_t c = static_cast<uint8_t>(u);
    const uint32_t bits = __brev(u) ^ 0x5a5a5a5au;
    const float sm = __uint_as_float(bits % __float_as_uint(kSigned8FoldLimit));
    const float sv =
        __uint_as_float(bits % __float_as_uint(kUnsigned8FoldLimit));
    return SameOrBothNan(DecodeSigned8Folded(c, FoldedSigned8Scale(sm)),
                         Block8Decode<true>(c, sm)) &&
           SameOrBothNan(DecodeUnsigned8Folded(c, FoldedUnsigned8Scale(sv)),
                         Block8Decode<false>(c, sv));
  }
};

// EncodeUnsigned8Normal against the CPU's code on its whole range: x runs
// over every float from 0 (ForEachBits' start), shifted up to 2^-30.
struct Unsigned8NormalCheck {
  __device__ bool operator()(uint32_t u) const {
    const float x = __uint_as_float(u + kUnsigned8NormalLow);
    return EncodeUnsigned8Normal(x) == EncodeUnsigned8(x);
  }
};

// Two elements packed into one word equal the single-element operations.
struct PackedCheck {
  __device__ bool operator()(uint32_t u) const {
    const uint32_t w = Partner(u);
    const float x = __uint_as_float(u), y = __uint_as_float(w);
    float lo, hi;
    // bfloat16: the packed conversion against one at a time.
    const uint32_t b = cuda::PackBf16x2(x, y);
    cuda::UnpackBf16x2(b, &lo, &hi);
    if (!SameOrBothNan(lo, __bfloat162float(__float2bfloat16_rn(x))) ||
        !SameOrBothNan(hi, __bfloat162float(__float2bfloat16_rn(y)))) {
      return false;
    }
    if (!isnan(x) && (b & 0xffffu) != cuda::Bf16FromFloat(x)) return false;
    // Half precision.
    const uint32_t h = cuda::PackF16x2(x, y);
    cuda::UnpackF16x2(h, &lo, &hi);
    if (!SameOrBothNan(lo, __half2float(__float2half_rn(x))) ||
        !SameOrBothNan(hi, __half2float(__float2half_rn(y)))) {
      return false;
    }
    // Remainders: the pair split and rebuilt as the single ones.
    uint32_t hs, rs;
    cuda::SplitToRemainder2(x, y, &hs, &rs);
    uint16_t hx, hy;
    int16_t rx, ry;
    cuda::SplitToRemainder(x, &hx, &rx);
    cuda::SplitToRemainder(y, &hy, &ry);
    if (hs != (hx | static_cast<uint32_t>(hy) << 16) ||
        rs != (static_cast<uint16_t>(rx) |
               static_cast<uint32_t>(static_cast<uint16_t>(ry)) << 16)) {
      return false;
    }
    cuda::ReconstructFromRemainder2(hs, rs, &lo, &hi);
    return __float_as_uint(lo) == u && __float_as_uint(hi) == w;
  }
};

std::string Failed(const char* what, cudaError_t e) {
  return std::string(what) + ": " + cudaGetErrorName(e) + ": " +
         cudaGetErrorString(e);
}

template <class LaunchFn>
MathCheck RunCheck(uint64_t compared, LaunchFn launch) {
  MathCheck out;
  unsigned long long* mismatches = nullptr;
  uint32_t* first_bad = nullptr;
  cudaError_t e = cudaMalloc(&mismatches, sizeof(*mismatches));
  if (e != cudaSuccess) return out.error = Failed("cudaMalloc", e), out;
  e = cudaMalloc(&first_bad, sizeof(*first_bad));
  if (e == cudaSuccess) e = cudaMemset(mismatches, 0, sizeof(*mismatches));
  if (e == cudaSuccess) e = cudaMemset(first_bad, 0xff, sizeof(*first_bad));
  if (e == cudaSuccess) {
    launch(mismatches, first_bad);
    e = cudaGetLastError();
  }
  if (e == cudaSuccess) e = cudaDeviceSynchronize();
  unsigned long long count = 0;
  if (e == cudaSuccess) {
    e = cudaMemcpy(&count, mismatches, sizeof(count), cudaMemcpyDeviceToHost);
  }
  if (e == cudaSuccess) {
    e = cudaMemcpy(&out.first_bad_bits, first_bad, sizeof(uint32_t),
                   cudaMemcpyDeviceToHost);
  }
  if (e != cudaSuccess) out.error = Failed("math check", e);
  out.mismatches = count;
  out.compared = compared;
  cudaFree(mismatches);
  cudaFree(first_bad);
  return out;
}

}  // namespace

MathCheck CheckDivisionByRecip(float b) {
  const float rb = 1.0f / b;  // IEEE single division on the host: RN(1/b)
  return RunCheck(static_cast<uint64_t>(kLast) + 1, [&](unsigned long long* m,
                                                        uint32_t* f) {
    ForEachBits<<<4096, 256>>>(kLast, DivisionCheck{b, rb}, m, f);
  });
}

MathCheck CheckSqrtInRange() {
  constexpr uint64_t kLastOffset =
      cuda::kSqrtInRangeHigh - cuda::kSqrtInRangeLow;
  return RunCheck(kLastOffset + 1, [](unsigned long long* m, uint32_t* f) {
    ForEachBits<<<4096, 256>>>(kLastOffset, SqrtInRangeCheck{}, m, f);
  });
}

MathCheck CheckDecode8() {
  return RunCheck(uint64_t{1} << 32, [](unsigned long long* m, uint32_t* f) {
    ForEachBits<<<4096, 256>>>(0xffffffffull, Decode8Check{}, m, f);
  });
}

MathCheck CheckFoldedDecode8() {
  return RunCheck(uint64_t{1} << 32, [](unsigned long long* m, uint32_t* f) {
    ForEachBits<<<4096, 256>>>(0xffffffffull, FoldedDecode8Check{}, m, f);
  });
}

MathCheck CheckUnsigned8Normal() {
  // Up to +infinity, which a unit never is but the encode clamps as it
  // clamps every value above 1.
  constexpr uint64_t kLastOffset = 0x7f800000u - kUnsigned8NormalLow;
  return RunCheck(kLastOffset + 1, [](unsigned long long* m, uint32_t* f) {
    ForEachBits<<<4096, 256>>>(kLastOffset, Unsigned8NormalCheck{}, m, f);
  });
}

MathCheck CheckBf16Rounding() {
  return RunCheck(uint64_t{1} << 32, [](unsigned long long* m, uint32_t* f) {
    ForEachBits<<<4096, 256>>>(0xffffffffull, Bf16Check{}, m, f);
  });
}

MathCheck CheckRemainderSplit() {
  return RunCheck(uint64_t{1} << 32, [](unsigned long long* m, uint32_t* f) {
    ForEachBits<<<4096, 256>>>(0xffffffffull, RemainderCheck{}, m, f);
  });
}

MathCheck CheckSigned8Pairs() {
  return RunCheck(uint64_t{1} << 32, [](unsigned long long* m, uint32_t* f) {
    ForEachBits<<<4096, 256>>>(0xffffffffull, Signed8Check{}, m, f);
  });
}

MathCheck CheckPackedPairs() {
  return RunCheck(uint64_t{1} << 32, [](unsigned long long* m, uint32_t* f) {
    ForEachBits<<<4096, 256>>>(0xffffffffull, PackedCheck{}, m, f);
  });
}

}  // namespace testing
}  // namespace optimd
