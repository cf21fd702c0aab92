// The type of the domain model that the step math consumes: one tensor's
// buffer pointers. Here, in core, so that the model (core/group.h) does not
// depend on any kernel; the kernels and backends include this.
#ifndef OPTIMD_CORE_STEP_TYPES_H_
#define OPTIMD_CORE_STEP_TYPES_H_

#include "core/fp8_recipe.h"
#include "core/optimizer.h"

namespace optimd {

// Raw pointers to one tensor's buffers. Unused ones are null.
struct TensorPointers {
  void* param = nullptr;
  const void* grad = nullptr;
  void* master = nullptr;  // float* (kFp32) or int16_t* (kRemainder)
  // The optimizer's state slots (core/optimizer.h names them), in the
  // group's moment dtype.
  void* state[kMaxStateSlots] = {nullptr, nullptr, nullptr};
  // kBlock8 moments: their fp32 scales, [blocks][state slots]
  // (core/block8.h); null for other layouts.
  void* scales = nullptr;
  // FP8 parameters: the trainer's scale-inverse buffer and the tensor's
  // scaling units (core/fp8_recipe.h); null and kNone otherwise.
  void* scale_inv = nullptr;
  Fp8Geometry fp8;
};

}  // namespace optimd

#endif  // OPTIMD_CORE_STEP_TYPES_H_
