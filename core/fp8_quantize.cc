#include "core/fp8_quantize.h"

namespace optimd {
namespace {

template <const Fp8Format& F>
void Quantize(const TensorPointers& t, uint64_t begin, uint64_t end) {
  ForEachFp8Unit(t.fp8, begin, end,
                 [&](const Fp8Unit& u) { QuantizeFp8Unit<F>(t, u); });
}

template <const Fp8Format& F>
void Dequantize(const TensorPointers& t, uint64_t begin, uint64_t end) {
  const uint8_t* param = static_cast<const uint8_t*>(t.param);
  float* master = static_cast<float*>(t.master);
  const bool mx = t.fp8.recipe == Fp8Recipe::kMxfp8;
  for (uint64_t i = begin; i < end; ++i) {
    const uint64_t unit = t.fp8.UnitOf(i);
    const float scale_inv =
        mx ? E8M0Value(static_cast<const uint8_t*>(t.scale_inv)[unit])
           : static_cast<const float*>(t.scale_inv)[unit];
    master[i] = DecodeFp8<F>(param[i]) * scale_inv;
  }
}

}  // namespace

void QuantizeFp8Range(DType dtype, const TensorPointers& t, uint64_t begin,
                      uint64_t end) {
  if (dtype == DType::kFloat8E4M3) return Quantize<kE4M3>(t, begin, end);
  if (dtype == DType::kFloat8E5M2) return Quantize<kE5M2>(t, begin, end);
}

void DequantizeFp8Range(DType dtype, const TensorPointers& t, uint64_t begin,
                        uint64_t end) {
  if (dtype == DType::kFloat8E4M3) return Dequantize<kE4M3>(t, begin, end);
  if (dtype == DType::kFloat8E5M2) return Dequantize<kE5M2>(t, begin, end);
}

}  // namespace optimd
