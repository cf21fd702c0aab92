// FP8 parameters on the host (core/fp8.h, core/fp8_recipe.h): the walk
// over the scaling units of an element range, the requantization of one
// unit from the fp32 master into the parameter and its scale inverse, and
// the whole-range conversions of registration, GetParams and state writes.
// Every CPU optimizer kernel that takes FP8 parameters (cpu::TakesFp8)
// updates a unit's masters and then calls QuantizeFp8Unit while they are
// in cache; the CUDA kernel follows the same rules.
//
// Pure functions over the caller's buffers; thread-compatible (disjoint
// ranges of whole units may run on different threads).
#ifndef OPTIMD_CORE_FP8_QUANTIZE_H_
#define OPTIMD_CORE_FP8_QUANTIZE_H_

#include <algorithm>
#include <cstdint>

#include "core/dtype.h"
#include "core/fp8.h"
#include "core/step_types.h"

namespace optimd {

// One scaling unit: rows [row, row + num_rows) x columns [col, col +
// num_cols) of the tensor's 2-D view, and its index in the scale buffer.
struct Fp8Unit {
  uint64_t row, num_rows, col, num_cols;
  uint64_t index;
};

// Calls fn(unit) for each unit of elements [begin, end), in memory order
// of their first elements. begin and end lie on the geometry's item
// alignment (or end at the tensor's end), as BuildPlan cuts items.
template <class Fn>
void ForEachFp8Unit(const Fp8Geometry& g, uint64_t begin, uint64_t end, Fn fn) {
  if (g.block_rows == 1) {
    for (uint64_t p = begin; p < end;) {
      const uint64_t row = p / g.cols, col = p % g.cols;
      const uint64_t n = std::min(g.block_cols, g.cols - col);
      fn(Fp8Unit{row, 1, col, n, g.UnitOf(p)});
      p += n;
    }
    return;
  }
  const uint64_t last_row = (end + g.cols - 1) / g.cols;
  for (uint64_t row = begin / g.cols; row < last_row; row += g.block_rows) {
    const uint64_t num_rows = std::min(g.block_rows, last_row - row);
    for (uint64_t col = 0; col < g.cols; col += g.block_cols) {
      const uint64_t n = std::min(g.block_cols, g.cols - col);
      fn(Fp8Unit{row, num_rows, col, n, g.UnitOf(row * g.cols + col)});
    }
  }
}

// Calls fn(first, last) for each row span [first, last) of unit `u`: the
// unit's elements that lie in one row of the tensor.
template <class Fn>
void ForEachFp8RowSpan(const Fp8Geometry& g, const Fp8Unit& u, Fn fn) {
  for (uint64_t r = u.row; r < u.row + u.num_rows; ++r) {
    const uint64_t first = r * g.cols + u.col;
    fn(first, first + u.num_cols);
  }
}

// Requantizes unit `u` of tensor `t` in format F from its fp32 master:
// the unit's amax, its scale (per-tensor: max / amax; blocks: the same
// rounded down to a power of two; MXFP8: an e8m0 exponent), the codes of
// master * scale, saturating, and the scale inverse (1 / scale, or the
// e8m0 code).
template <const Fp8Format& F>
void QuantizeFp8Unit(const TensorPointers& t, const Fp8Unit& u) {
  const Fp8Geometry& g = t.fp8;
  const float* __restrict master = static_cast<const float*>(t.master);
  uint8_t* __restrict param = static_cast<uint8_t*>(t.param);
  float amax = 0.0f;
  ForEachFp8RowSpan(g, u, [&](uint64_t a, uint64_t b) {
    for (uint64_t i = a; i < b; ++i) amax = Fp8Amax(amax, master[i]);
  });
  float mul;
  if (g.recipe == Fp8Recipe::kMxfp8) {
    const uint8_t code = Fp8E8M0(amax, F.max_value);
    static_cast<uint8_t*>(t.scale_inv)[u.index] = code;
    mul = E8M0Multiplier(code);
  } else {
    mul = Fp8Scale(amax, F.max_value, g.recipe != Fp8Recipe::kTensor);
    static_cast<float*>(t.scale_inv)[u.index] = 1.0f / mul;
  }
  ForEachFp8RowSpan(g, u, [&](uint64_t a, uint64_t b) {
    for (uint64_t i = a; i < b; ++i) param[i] = EncodeFp8<F>(master[i] * mul);
  });
}

// Requantizes every unit of elements [begin, end) (whole units) of an FP8
// parameter of dtype `dtype` from its master (GetParams, state writes).
void QuantizeFp8Range(DType dtype, const TensorPointers& t, uint64_t begin,
                      uint64_t end);

// Sets the fp32 master of elements [begin, end) from the FP8 parameter and
// its scale inverses (registration): code value times scale inverse.
void DequantizeFp8Range(DType dtype, const TensorPointers& t, uint64_t begin,
                        uint64_t end);

}  // namespace optimd

#endif  // OPTIMD_CORE_FP8_QUANTIZE_H_
