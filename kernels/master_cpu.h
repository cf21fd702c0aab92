// The CPU work every optimizer's step shares around its update: a
// gradient's sum of squares (for clipping and the non-finite skip), and a
// master copy's setup from the parameter and write-back into it. The CPU
// backend calls these for every optimizer; each optimizer's own update is
// behind kernels/step_cpu.h.
//
// Functions here are pure and thread-compatible: callers split a tensor into
// disjoint element ranges and may run ranges on different threads.
#ifndef OPTIMD_KERNELS_MASTER_CPU_H_
#define OPTIMD_KERNELS_MASTER_CPU_H_

#include <cstdint>

#include "core/layout.h"
#include "core/step_types.h"

namespace optimd {

// Sum of squares (in double) of gradient elements [begin, end). The result
// is non-finite exactly when some element is non-finite.
double GradSumSquaresRange(DType grad_dtype, const void* grad, uint64_t begin,
                           uint64_t end);

// Sets the master copy of elements [begin, end) from the parameter (at
// registration): exact widening for kFp32 (an FP8 parameter's code value
// times its scale inverse), zero remainders for kRemainder.
void InitMasterRange(const Layout& layout, const TensorPointers& t,
                     uint64_t begin, uint64_t end);

// Writes the parameter of elements [begin, end) from the master copy
// (GetParams); an FP8 parameter is requantized with its scale inverses
// (whole scaling units). No-op for kNone.
void WriteParamFromMasterRange(const Layout& layout, const TensorPointers& t,
                               uint64_t begin, uint64_t end);

// Follows the trainer's writes into a parameter (UpdateBuffers'
// param_written): each element of [begin, end) whose parameter differs, bit
// for bit, from the one its master gives (WriteParamFromMasterRange's
// rounding) was written, and its master becomes the parameter's value
// (exact widening); the others keep their masters, so that a write the
// trainer only may have made costs no precision. kFp32 masters of bf16,
// fp16 and fp32 parameters. A remainder layout (kRemainder: the bf16
// parameter is the master's high half) steps from a written value with its
// old low half, except where that would change what the value is: a
// written +-0 or +-inf gets a zero remainder (with a negative one, +0
// would become a NaN master, +inf a finite one). Anything else is left
// alone.
void AdoptWrittenParamRange(const Layout& layout, const TensorPointers& t,
                            uint64_t begin, uint64_t end);

}  // namespace optimd

#endif  // OPTIMD_KERNELS_MASTER_CPU_H_
