#include "core/dtype.h"

namespace optimd {

absl::string_view DTypeName(DType t) {
  switch (t) {
    case DType::kFloat32:
      return "float32";
    case DType::kBFloat16:
      return "bfloat16";
    case DType::kFloat16:
      return "float16";
    case DType::kBlock8:
      return "block8";
    case DType::kFloat64:
      return "float64";
    case DType::kFloat8E4M3:
      return "float8_e4m3fn";
    case DType::kFloat8E5M2:
      return "float8_e5m2";
  }
  return "unknown";
}

}  // namespace optimd
