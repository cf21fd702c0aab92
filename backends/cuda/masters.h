// A group's master weights and the trainer's parameters, converted into
// each other off the step's path: masters from the parameters when a group
// is registered (remainders start at zero), parameters from the masters at
// GetParams. Conversions run on the device's stream; FP8 parameters go
// through host memory and the CPU reference's conversions
// (core/fp8_quantize.h), so that masters and codes are the same on both
// backends. Not thread-safe: the device's worker calls, under the
// session's lock.
#ifndef OPTIMD_BACKENDS_CUDA_MASTERS_H_
#define OPTIMD_BACKENDS_CUDA_MASTERS_H_

#include <cuda_runtime.h>

#include "absl/status/status.h"
#include "core/backend.h"
#include "core/group.h"

namespace optimd {

// Fills the masters of `group`'s tensors that keep one (fp32 masters, FP8
// parameters' masters) from their parameters. `backend` is the group's
// (its host copies order after the conversions on `stream`, its stream);
// the caller waits for `stream` before using the masters.
absl::Status MastersFromParams(Backend& backend, const Group& group,
                               cudaStream_t stream);

// Writes the parameters of `group`'s tensors that keep a master (FP8
// parameters: codes and scale inverses) from their masters, as
// MastersFromParams.
absl::Status ParamsFromMasters(Backend& backend, const Group& group,
                               cudaStream_t stream);

}  // namespace optimd

#endif  // OPTIMD_BACKENDS_CUDA_MASTERS_H_
