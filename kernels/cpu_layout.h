// What every CPU optimizer kernel shares: element codecs, the load and
// store of a tensor's weight (from its master copy, remainder or the
// parameter itself), and the one dispatch from a Layout to a kernel
// instantiation. Each optimizer writes only its per-element math.
#ifndef OPTIMD_KERNELS_CPU_LAYOUT_H_
#define OPTIMD_KERNELS_CPU_LAYOUT_H_

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <type_traits>

#include "core/fp8.h"
#include "core/layout.h"
#include "core/step_types.h"

namespace optimd {
namespace cpu {

// Element codecs: storage type T, compute type C, and exact widen /
// round-to-nearest-even.
struct F32 {
  using T = float;
  using C = float;
  static float Load(T x) { return x; }
  static T Store(float x) { return x; }
};
struct BF16 {
  using T = uint16_t;
  using C = float;
  static float Load(T x) { return BFloat16ToFloat(x); }
  static T Store(float x) { return FloatToBFloat16(x); }
};
struct F16 {
  using T = uint16_t;
  using C = float;
  static float Load(T x) { return HalfToFloat(x); }
  static T Store(float x) { return FloatToHalf(x); }
};
// float64 layouts only: parameter, gradient and moments all F64 and no
// master (ResolveLayout), computed in double. Dispatched only to kernels
// that declare `static constexpr bool kTakesFloat64 = true`
// (TakesFloat64); ResolveLayout refuses float64 for the others.
struct F64 {
  using T = double;
  using C = double;
  static double Load(T x) { return x; }
  static T Store(double x) { return x; }
};

// FP8 parameters (core/fp8.h): no per-element codec either, since the
// scaling unit's elements share a scale. Dispatched only to kernels that
// declare `static constexpr bool kTakesFp8 = true` (TakesFp8), with the
// fp32 master (kFp32); the kernel writes the parameter and its scales
// itself (Weight::Store writes the master only). ResolveFp8Recipe refuses
// FP8 parameters for the others.
template <const Fp8Format& F>
struct Fp8 {
  using T = uint8_t;
  using C = float;  // the fp32 master's type
  static constexpr const Fp8Format& kFormat = F;
};
using E4M3 = Fp8<kE4M3>;
using E5M2 = Fp8<kE5M2>;

template <class P>
struct IsFp8Codec : std::false_type {};
template <const Fp8Format& F>
struct IsFp8Codec<Fp8<F>> : std::true_type {};

template <class Kernel, class = void>
struct TakesFp8 : std::false_type {};
template <class Kernel>
struct TakesFp8<Kernel, std::void_t<decltype(Kernel::kTakesFp8)>>
    : std::bool_constant<Kernel::kTakesFp8> {};

// kBlock8 moments (core/block8.h): no per-element codec, since a block's
// elements share a scale. Dispatched only to kernels that declare
// `static constexpr bool kTakesBlock8 = true` (TakesBlock8) and handle M =
// Block8 themselves; ResolveLayout refuses block8 for the others.
struct Block8 {
  using T = uint8_t;
};

template <class Kernel, class = void>
struct TakesBlock8 : std::false_type {};
template <class Kernel>
struct TakesBlock8<Kernel, std::void_t<decltype(Kernel::kTakesBlock8)>>
    : std::bool_constant<Kernel::kTakesBlock8> {};

template <class Kernel, class = void>
struct TakesFloat64 : std::false_type {};
template <class Kernel>
struct TakesFloat64<Kernel, std::void_t<decltype(Kernel::kTakesFloat64)>>
    : std::bool_constant<Kernel::kTakesFloat64> {};

// A tensor's weight in its compute type: its fp32 master copy (kFp32),
// its bf16 parameter and remainder (kRemainder), or the fp32 or float64
// parameter itself (kNone).
template <class P, MasterKind K>
struct Weight {
  using C = typename P::C;
  typename P::T* __restrict param;
  float* __restrict master;
  int16_t* __restrict rem;

  explicit Weight(const TensorPointers& t)
      : param(static_cast<typename P::T*>(t.param)),
        master(static_cast<float*>(t.master)),
        rem(static_cast<int16_t*>(t.master)) {}

  C Load(uint64_t i) const {
    if constexpr (K == MasterKind::kFp32) {
      return master[i];
    } else if constexpr (K == MasterKind::kRemainder) {
      return ReconstructFromRemainder(param[i], rem[i]);
    } else {
      return P::Load(param[i]);
    }
  }
  // Writes the new weight back: master and rounded parameter, or the
  // parameter and remainder that rebuild `p` exactly.
  void Store(uint64_t i, C p) const {
    if constexpr (K == MasterKind::kFp32) {
      master[i] = p;
      if constexpr (!IsFp8Codec<P>::value) param[i] = P::Store(p);
    } else if constexpr (K == MasterKind::kRemainder) {
      uint16_t hi;
      int16_t r;
      SplitToRemainder(p, &hi, &r);
      param[i] = hi;
      rem[i] = r;
    } else {
      param[i] = P::Store(p);
    }
  }
};

// A layout no instantiation covers. ResolveLayout refuses such layouts at
// registration, so reaching this is a bug: stop rather than skip a step.
[[noreturn]] inline void UnsupportedLayout(const Layout& l) {
  std::fprintf(stderr, "optimd: no CPU kernel for layout %s\n",
               l.DebugString().c_str());
  std::abort();
}

// Calls kernel.template Run<P, G, M, K>() for the layout's parameter,
// gradient and moment dtypes and master kind. Every branch is a template
// parameter, so the kernels' inner loops have no control flow and
// vectorize.
template <class P, class G, class M, class Kernel>
void DispatchMaster(const Layout& l, Kernel& k) {
  switch (l.master) {
    case MasterKind::kNone:
      if constexpr (std::is_same_v<P, F32>) {
        return k.template Run<P, G, M, MasterKind::kNone>();
      }
      break;
    case MasterKind::kFp32:
      if constexpr (!std::is_same_v<M, Block8> || !IsFp8Codec<P>::value) {
        return k.template Run<P, G, M, MasterKind::kFp32>();
      }
      break;
    case MasterKind::kRemainder:
      if constexpr (std::is_same_v<P, BF16>) {
        return k.template Run<P, G, M, MasterKind::kRemainder>();
      }
      break;
  }
  UnsupportedLayout(l);
}

template <class P, class G, class Kernel>
void DispatchMoment(const Layout& l, Kernel& k) {
  switch (l.moment_dtype) {
    case DType::kFloat32:
      return DispatchMaster<P, G, F32>(l, k);
    case DType::kBFloat16:
      return DispatchMaster<P, G, BF16>(l, k);
    case DType::kBlock8:
      if constexpr (TakesBlock8<Kernel>::value) {
        return DispatchMaster<P, G, Block8>(l, k);
      }
      UnsupportedLayout(l);
    default:
      UnsupportedLayout(l);
  }
}

template <class P, class Kernel>
void DispatchGrad(const Layout& l, Kernel& k) {
  switch (l.grad_dtype) {
    case DType::kFloat32:
      return DispatchMoment<P, F32>(l, k);
    case DType::kBFloat16:
      return DispatchMoment<P, BF16>(l, k);
    case DType::kFloat16:
      return DispatchMoment<P, F16>(l, k);
    case DType::kBlock8:      // moments only
    case DType::kFloat64:     // with a float64 parameter only
    case DType::kFloat8E4M3:  // parameters only
    case DType::kFloat8E5M2:
      break;
  }
  UnsupportedLayout(l);
}

// The one float64 layout: parameter, gradient and moments float64, no
// master.
template <class Kernel>
void DispatchFloat64(const Layout& l, Kernel& k) {
  if constexpr (TakesFloat64<Kernel>::value) {
    if (l.grad_dtype == DType::kFloat64 && l.moment_dtype == DType::kFloat64 &&
        l.master == MasterKind::kNone) {
      return k.template Run<F64, F64, F64, MasterKind::kNone>();
    }
  }
  UnsupportedLayout(l);
}

template <class Kernel>
void DispatchLayout(const Layout& l, Kernel& k) {
  switch (l.param_dtype) {
    case DType::kFloat32:
      return DispatchGrad<F32>(l, k);
    case DType::kBFloat16:
      return DispatchGrad<BF16>(l, k);
    case DType::kFloat16:
      return DispatchGrad<F16>(l, k);
    case DType::kFloat64:
      return DispatchFloat64(l, k);
    case DType::kFloat8E4M3:
      if constexpr (TakesFp8<Kernel>::value) return DispatchGrad<E4M3>(l, k);
      break;
    case DType::kFloat8E5M2:
      if constexpr (TakesFp8<Kernel>::value) return DispatchGrad<E5M2>(l, k);
      break;
    case DType::kBlock8:  // moments only
      break;
  }
  UnsupportedLayout(l);
}

}  // namespace cpu
}  // namespace optimd

#endif  // OPTIMD_KERNELS_CPU_LAYOUT_H_
