// FP8 parameters' scaling recipes and their scaling units: which elements
// of a tensor share one scale, where that scale lives in the trainer's
// scale-inverse buffer, and how plans split a tensor so that one unit of
// work holds whole scaling units. docs/fp8_parameters.md has the design.
//
// A tensor is seen as a 2-D array [rows, cols]: cols is the last dimension
// of its shape (its element count when 1-D), rows the product of the
// others, in memory order.
//
// Plain data and pure functions; thread-compatible.
#ifndef OPTIMD_CORE_FP8_RECIPE_H_
#define OPTIMD_CORE_FP8_RECIPE_H_

#include <cstdint>
#include <vector>

#include "absl/strings/string_view.h"
#include "core/step_math.h"

namespace optimd {

enum class Fp8Recipe : uint8_t {
  kNone = 0,
  // Per-tensor current scaling: one fp32 scale inverse.
  kTensor = 1,
  // One fp32 scale inverse per 1x128 block of a row: [rows, ceil(cols/128)].
  kBlock1x128 = 2,
  // One fp32 scale inverse per 128x128 block: [ceil(rows/128),
  // ceil(cols/128)].
  kBlock128x128 = 3,
  // MXFP8: one e8m0 byte per 1x32 block of a row: [rows, ceil(cols/32)].
  kMxfp8 = 4,
};

// "tensor", "block_1x128", "block_128x128", "mxfp8" ("none").
absl::string_view Fp8RecipeName(Fp8Recipe r);

// The scaling units of one tensor under one recipe.
struct Fp8Geometry {
  Fp8Recipe recipe = Fp8Recipe::kNone;
  uint64_t rows = 0;
  uint64_t cols = 0;
  // A unit's extent: block_rows x block_cols elements, clipped at the
  // tensor's edges (per-tensor: the whole tensor).
  uint64_t block_rows = 0;
  uint64_t block_cols = 0;

  static Fp8Geometry Of(Fp8Recipe recipe, uint64_t numel,
                        const std::vector<uint64_t>& shape);

  OPTIMD_HOST_DEVICE uint64_t UnitColumns() const {
    return (cols + block_cols - 1) / block_cols;
  }
  OPTIMD_HOST_DEVICE uint64_t Units() const {
    return (rows + block_rows - 1) / block_rows * UnitColumns();
  }
  // Bytes of the trainer's scale-inverse buffer: 4 per unit (fp32), 1 for
  // MXFP8 (e8m0).
  uint64_t ScaleBytes() const {
    return Units() * (recipe == Fp8Recipe::kMxfp8 ? 1 : 4);
  }
  // The unit (scale index) of element i.
  OPTIMD_HOST_DEVICE uint64_t UnitOf(uint64_t i) const {
    const uint64_t row = i / cols, col = i % cols;
    return row / block_rows * UnitColumns() + col / block_cols;
  }
  // Plans cut the tensor only at multiples of this many elements, so that
  // a unit of work holds whole units: a block row (128 rows) for 128x128,
  // a block of a row when rows are whole blocks, else a whole row, and the
  // whole tensor for per-tensor scaling (its amax needs every element).
  uint64_t ItemAlignment() const {
    if (recipe == Fp8Recipe::kTensor) return rows * cols;
    if (block_rows > 1) return block_rows * cols;
    return cols % block_cols == 0 ? block_cols : cols;
  }
};

}  // namespace optimd

#endif  // OPTIMD_CORE_FP8_RECIPE_H_
