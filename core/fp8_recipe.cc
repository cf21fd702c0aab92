#include "core/fp8_recipe.h"

namespace optimd {

absl::string_view Fp8RecipeName(Fp8Recipe r) {
  switch (r) {
    case Fp8Recipe::kNone:
      return "none";
    case Fp8Recipe::kTensor:
      return "tensor";
    case Fp8Recipe::kBlock1x128:
      return "block_1x128";
    case Fp8Recipe::kBlock128x128:
      return "block_128x128";
    case Fp8Recipe::kMxfp8:
      return "mxfp8";
  }
  return "unknown";
}

Fp8Geometry Fp8Geometry::Of(Fp8Recipe recipe, uint64_t numel,
                            const std::vector<uint64_t>& shape) {
  Fp8Geometry g;
  g.recipe = recipe;
  g.cols = shape.empty() ? numel : shape.back();
  if (g.cols == 0) {
    // No elements: one empty row, and units of one element so that the
    // counts below stay defined (zero units).
    g.rows = 0;
    g.cols = 1;
    g.block_rows = g.block_cols = 1;
    return g;
  }
  g.rows = numel / g.cols;
  switch (recipe) {
    case Fp8Recipe::kNone:
    case Fp8Recipe::kTensor:
      g.block_rows = g.rows;
      g.block_cols = g.cols;
      break;
    case Fp8Recipe::kBlock1x128:
      g.block_rows = 1;
      g.block_cols = 128;
      break;
    case Fp8Recipe::kBlock128x128:
      g.block_rows = 128;
      g.block_cols = 128;
      break;
    case Fp8Recipe::kMxfp8:
      g.block_rows = 1;
      g.block_cols = 32;
      break;
  }
  if (g.block_rows == 0) g.block_rows = 1;
  return g;
}

}  // namespace optimd
