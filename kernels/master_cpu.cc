#include "kernels/master_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/dtype.h"
#include "core/fp8_quantize.h"
#include "core/step_math.h"
#include "kernels/cpu_layout.h"

namespace optimd {
namespace {

using cpu::BF16;
using cpu::F16;
using cpu::F32;
using cpu::F64;

template <class G>
double SumSquares(const void* grad, uint64_t begin, uint64_t end) {
  const auto* g = static_cast<const typename G::T*>(grad);
  // Eight independent accumulators: the sum stays deterministic for a given
  // range and the loop vectorizes without reassociation flags.
  double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  uint64_t i = begin;
  for (; i + 8 <= end; i += 8) {
    for (int k = 0; k < 8; ++k) {
      const double x = G::Load(g[i + k]);
      acc[k] += x * x;
    }
  }
  for (; i < end; ++i) {
    const double x = G::Load(g[i]);
    acc[0] += x * x;
  }
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) +
         ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

float LoadParam(DType d, const void* p, uint64_t i) {
  switch (d) {
    case DType::kFloat32:
      return static_cast<const float*>(p)[i];
    case DType::kBFloat16:
      return BFloat16ToFloat(static_cast<const uint16_t*>(p)[i]);
    case DType::kFloat16:
      return HalfToFloat(static_cast<const uint16_t*>(p)[i]);
    case DType::kBlock8:      // state only, never a parameter
    case DType::kFloat64:     // never has a master (ResolveLayout)
    case DType::kFloat8E4M3:  // scaled: DequantizeFp8Range
    case DType::kFloat8E5M2:
      break;
  }
  return 0;
}

void StoreParam(DType d, void* p, uint64_t i, float x) {
  switch (d) {
    case DType::kFloat32:
      static_cast<float*>(p)[i] = x;
      return;
    case DType::kBFloat16:
      static_cast<uint16_t*>(p)[i] = FloatToBFloat16(x);
      return;
    case DType::kFloat16:
      static_cast<uint16_t*>(p)[i] = FloatToHalf(x);
      return;
    case DType::kBlock8:      // state only, never a parameter
    case DType::kFloat64:     // never has a master (ResolveLayout)
    case DType::kFloat8E4M3:  // scaled: QuantizeFp8Range
    case DType::kFloat8E5M2:
      return;
  }
}

// A parameter element's bits (zero-extended), as the trainer's memory
// holds them.
uint32_t ParamBits(DType d, const void* p, uint64_t i) {
  if (d == DType::kFloat32) {
    uint32_t bits;
    std::memcpy(&bits, static_cast<const float*>(p) + i, sizeof(bits));
    return bits;
  }
  return static_cast<const uint16_t*>(p)[i];
}

// The bits of the parameter that `x` gives (StoreParam's rounding).
uint32_t GivenBits(DType d, float x) {
  if (d == DType::kBFloat16) return FloatToBFloat16(x);
  if (d == DType::kFloat16) return FloatToHalf(x);
  return ParamBits(DType::kFloat32, &x, 0);  // AdoptWrittenParamRange's rest
}

}  // namespace

double GradSumSquaresRange(DType grad_dtype, const void* grad, uint64_t begin,
                           uint64_t end) {
  switch (grad_dtype) {
    case DType::kFloat32:
      return SumSquares<F32>(grad, begin, end);
    case DType::kBFloat16:
      return SumSquares<BF16>(grad, begin, end);
    case DType::kFloat16:
      return SumSquares<F16>(grad, begin, end);
    case DType::kFloat64:
      return SumSquares<F64>(grad, begin, end);
    case DType::kBlock8:      // state only, never a gradient
    case DType::kFloat8E4M3:  // parameters only (ResolveFp8Recipe)
    case DType::kFloat8E5M2:
      break;
  }
  return 0;
}

void InitMasterRange(const Layout& layout, const TensorPointers& t,
                     uint64_t begin, uint64_t end) {
  switch (layout.master) {
    case MasterKind::kNone:
      return;
    case MasterKind::kFp32: {
      if (IsFp8(layout.param_dtype)) {
        return DequantizeFp8Range(layout.param_dtype, t, begin, end);
      }
      float* master = static_cast<float*>(t.master);
      for (uint64_t i = begin; i < end; ++i) {
        master[i] = LoadParam(layout.param_dtype, t.param, i);
      }
      return;
    }
    case MasterKind::kRemainder:
      std::fill(static_cast<int16_t*>(t.master) + begin,
                static_cast<int16_t*>(t.master) + end, int16_t{0});
      return;
  }
}

void WriteParamFromMasterRange(const Layout& layout, const TensorPointers& t,
                               uint64_t begin, uint64_t end) {
  if (layout.master != MasterKind::kFp32) return;
  if (IsFp8(layout.param_dtype)) {
    return QuantizeFp8Range(layout.param_dtype, t, begin, end);
  }
  const float* master = static_cast<const float*>(t.master);
  for (uint64_t i = begin; i < end; ++i) {
    StoreParam(layout.param_dtype, t.param, i, master[i]);
  }
}

void AdoptWrittenParamRange(const Layout& layout, const TensorPointers& t,
                            uint64_t begin, uint64_t end) {
  const DType d = layout.param_dtype;
  if (layout.master == MasterKind::kRemainder && d == DType::kBFloat16) {
    const uint16_t* param = static_cast<const uint16_t*>(t.param);
    int16_t* rem = static_cast<int16_t*>(t.master);
    for (uint64_t i = begin; i < end; ++i) {
      if (WrittenBf16ClearsRemainder(param[i])) rem[i] = 0;
    }
    return;
  }
  if (layout.master != MasterKind::kFp32 ||
      (d != DType::kFloat32 && d != DType::kBFloat16 && d != DType::kFloat16)) {
    return;
  }
  float* master = static_cast<float*>(t.master);
  for (uint64_t i = begin; i < end; ++i) {
    if (GivenBits(d, master[i]) == ParamBits(d, t.param, i)) continue;
    const float written = LoadParam(d, t.param, i);
    // A NaN master stays what it is under a NaN parameter: fp16's NaN
    // rounding differs between the CPU and CUDA in its payload.
    if (std::isnan(written) && std::isnan(master[i])) continue;
    master[i] = written;
  }
}

}  // namespace optimd
