// What the host and the CUDA step kernels of every optimizer share: work
// descriptors (items and work blocks of a plan), per-group step arguments,
// device-resident counters and step scalars. Plain C++: no CUDA headers, so
// that host code including this file builds without nvcc.
#ifndef OPTIMD_KERNELS_CUDA_STEP_TYPES_H_
#define OPTIMD_KERNELS_CUDA_STEP_TYPES_H_

#include <cstdint>

#include "core/fp8_recipe.h"
#include "core/optimizer.h"

struct CUstream_st;

namespace optimd {
namespace cuda {

using Stream = CUstream_st*;

// The most state slots of a tensor (core/optimizer.h), on the device.
constexpr int kDeviceStateSlots = 3;
static_assert(kDeviceStateSlots == kMaxStateSlots, "one slot count");

// Elements [begin, end) of one tensor, with the tensor's stream pointers
// (nullptr where the layout has no such stream; state[k] is the optimizer's
// state slot k, as TensorPointers::state), so that a kernel reaches the
// data through one descriptor. The item's first `tiles` * 256 elements
// form tiles: 256 consecutive elements that one warp updates with fully
// coalesced 8- or 16-byte accesses (an item has tiles only when every
// stream is 16-byte aligned at `begin`). The rest are scalar elements,
// updated one per thread.
struct DeviceItem {
  void* param;
  const void* grad;
  void* master;
  void* state[kDeviceStateSlots];
  uint64_t begin;
  uint64_t end;
  uint32_t tiles;
  uint32_t entry;  // the plan entry (tensor) the item belongs to
  // block8 moments' scales (TensorPointers::scales); for an FP8 parameter
  // its DeviceFp8Tensor in the plan's device table.
  void* scales;
};
static_assert(sizeof(DeviceItem) % 16 == 0, "copied in 16-byte pieces");

constexpr uint32_t kTileElements = 256;

// One work block, one thread block's work: items [first, end) of the
// plan's item table, at most kMaxItemsPerBlock of them, walked as one
// flattened space of `tiles` tiles and one of `scalars` scalar elements.
// Small tensors share a work block, so a launch over 1e5 small tensors
// keeps its threads as busy as over a few large ones.
struct DeviceBlock {
  uint32_t first;
  uint32_t end;
  uint32_t tiles;
  uint32_t scalars;
};
constexpr uint32_t kMaxItemsPerBlock = 32;

// How an FP8 parameter's codes and scale inverses are written
// (kernels/fp8_cuda.h, docs/fp8_parameters.md "Fusion"):
//   kFused: by the update itself, in one pass over the master: every
//     warp block of 256 elements that the update walks holds whole
//     scaling units (1x128 and MXFP8 blocks of rows whose columns are
//     whole blocks, or any block of a one-row tensor, whose last unit the
//     tensor's end clips; every item starting on a unit).
//   kUnitWalk: 128x128 blocks over several rows of whole 128-column
//     blocks: the update walks the tensor unit by unit instead of item by
//     item (a thread block per unit, UnitTask), keeps the unit's new
//     masters in shared memory and requantizes it once its amax is known:
//     one pass too.
//   Otherwise the update takes each unit's amax into `amax` (atomic
//   maxima of the magnitudes' bits) and an encode pass after it reads the
//   masters back: kTensorAmax (per-tensor scaling, one unit), kElementAmax
//   (any other shape: unit by element).
enum class Fp8Pass : uint32_t {
  kFused = 0,
  kTensorAmax = 1,
  kUnitWalk = 2,
  kElementAmax = 3,
};

// Whether parameters of pass `pass` have their units' amax words and an
// encode pass after the update.
OPTIMD_HOST_DEVICE inline bool HasEncodePass(Fp8Pass pass) {
  return pass == Fp8Pass::kTensorAmax || pass == Fp8Pass::kElementAmax;
}

// The rows and columns of a kUnitWalk unit (a 128x128 block).
constexpr uint32_t kWalkUnitSide = 128;

// One unit of a kUnitWalk parameter, one thread block's work: `item` is
// the parameter's first item (its streams, entry and DeviceFp8Tensor;
// without elements while the parameter has no gradient), `unit` the
// unit's index in the parameter (its scale-inverse index).
struct UnitTask {
  uint32_t item;
  uint32_t unit;
};

// The candidates a per-tensor-scaled (kTensorAmax) parameter keeps for
// the next step's amax.
constexpr uint32_t kAmaxCandidates = 64;

// A per-tensor-scaled parameter's predicted amax (AdamW's update only;
// docs/fp8_parameters.md, "Fusion"). Before the update a kernel steps the
// candidates (elements near the last amax) without storing them and takes
// their largest magnitude; the update encodes every element with the scale
// of that prediction, and the encode pass reads the masters back only
// where the true amax (the update's atomic maximum) differs from it. The
// codes are a function of the new masters and the amax's bits alone, so
// the prediction decides only whether the second read happens, never the
// bits. Zeroed with the plan.
struct Fp8Prediction {
  uint32_t amax;       // the predicted amax's bits
  uint32_t predicted;  // 1: the update encodes with `amax`
  // Candidates for the next step, elements whose new magnitude lies near
  // the amax: found by the update [0] (near the prediction) and by the
  // encode pass [1] (near the true amax). A count may pass
  // kAmaxCandidates; only the first kAmaxCandidates are kept.
  uint32_t count[2];
  // Steps whose encode pass read the masters back (the tests' view of
  // how often the prediction missed).
  uint32_t encode_passes;
  // 1 when this step's encode pass read the masters back (set by it, taken
  // by the next prediction), and the steps in a row that did: after two,
  // the update encodes from a prediction only every kRetryEvery steps,
  // since a wrong one costs the codes' write besides the read.
  uint32_t read_back;
  uint32_t misses;
  // The candidates' band, below the amax by amax / 2^(4 + narrow):
  // narrowed while more than kAmaxCandidates elements lie in it (a flat
  // top, as a uniform initialization's), so that the list keeps the
  // largest rather than the first to arrive; widened again below a
  // quarter of that.
  uint32_t narrow;
  uint64_t index[2][kAmaxCandidates];
};

// After two steps in a row whose prediction missed, the update encodes
// from a prediction again every this many steps (Fp8Prediction::misses).
constexpr uint32_t kRetryEvery = 16;
// The narrowest candidate band (Fp8Prediction::narrow).
constexpr uint32_t kMaxNarrow = 20;

// One FP8 parameter: its fp32 master, the trainer's codes and scale
// inverses, its scaling units and how they are written. first_unit: the
// units of the plan's FP8 parameters before it. amax: for the passes with
// an encode pass (kTensorAmax, kElementAmax), one word per unit (the largest
// magnitude's fp32 bits, a NaN's above every number's), zeroed before each
// update; amax_first is its offset in the plan's amax words. prediction:
// kTensorAmax parameters' (else null). first_item: the parameter's first
// item in the plan.
struct DeviceFp8Tensor {
  const float* master;
  uint8_t* param;
  void* scale_inv;
  uint32_t* amax;
  Fp8Prediction* prediction;
  Fp8Geometry geometry;
  uint64_t first_unit;
  uint64_t amax_first;
  uint32_t e5m2;   // 1: float8_e5m2, 0: float8_e4m3fn
  uint32_t entry;  // the plan entry
  Fp8Pass pass;
  uint32_t first_item;
};

// Hyperparameters of a group for one step, passed in pinned memory.
struct StepHyper {
  double lr;
  double beta1;
  double beta2;
  double eps;
  double weight_decay;
  double grad_scale;     // >= 1 effective; <= 0 means 1
  double max_grad_norm;  // <= 0: no clipping
  double momentum;       // SGD
  double dampening;      // SGD
  int32_t optimizer;     // OptimizerKind
  int32_t adamw;
  int32_t bias_correction;
  int32_t maximize;
  int32_t nesterov;  // SGD
  // 1: a non-finite total does not skip the step; it is applied as torch
  // applies it (StepOptions::assume_finite, for a session of its own).
  int32_t apply_nonfinite;
};

// The device-resident per-group counters.
// Also used for a session's totals (step = applied steps).
struct DeviceGroupState {
  uint64_t step;         // applied steps
  uint64_t skipped;      // skipped steps
  double last_sumsq;     // sum of squares of the last step's gradients
  int32_t last_skipped;  // 1 when the last step was skipped
  int32_t pad;
};

// Step scalars derived on the device once per group and step, with the
// same double arithmetic as the CPU reference's Make*Scalars, rounded to
// float once; read by every block of the update. Which fields an update
// reads depends on the optimizer:
//   AdamW: beta1, beta2, omb1, omb2, eps, decay, l2, bc2, rbc2, neg_step
//     (rbc2 is 1/bc2 rounded to nearest: dividing by bc2 then takes three
//     operations and stays correctly rounded, kernels/cuda_math.cuh). The
//     inputs of the bias corrections ride along (lr, beta1_d, beta2_d,
//     bias_correction), so that the update can derive them for a tensor
//     whose own step count is lower (it missed steps without a gradient:
//     Work::missed) with the same arithmetic. The float64 layout reads the
//     unrounded doubles instead: grad_mul_d, eps_d, decay_d, l2_d, beta1_d,
//     beta2_d, and its bias corrections derived from lr and t.
//   SGD: neg_lr, momentum, dampening_mul, l2 (weight decay), nesterov;
//     the float64 layout: lr, l2_d, momentum_d, dampening_mul_d, nesterov.
//   Lion: beta1, beta2, omb1, omb2, decay, neg_lr; the float64 layout: lr,
//     beta1_d, beta2_d, decay_d.
// Every optimizer: grad_mul (grad_mul_d for the float64 layout), skip, t.
struct DeviceScalars {
  float beta1, beta2, omb1, omb2, eps, decay, l2, bc2, rbc2, neg_step, grad_mul;
  float neg_lr, momentum, dampening_mul;
  int32_t skip;
  int32_t nesterov;
  double lr, beta1_d, beta2_d;
  double grad_mul_d, eps_d, decay_d, l2_d;  // the float64 layout's
  double momentum_d, dampening_mul_d;       // SGD's float64 layout's
  uint64_t t;  // the group's step number (applied steps + 1)
  int32_t bias_correction;
  int32_t pad;
};

constexpr int kThreadsPerBlock = 256;

// Work of one launch: one thread block per work block; for the update of
// FP8 parameters, one more per unit task (kUnitWalk parameters, whose
// items no work block of the update holds).
struct Work {
  const DeviceBlock* blocks;
  uint32_t num_blocks;
  uint32_t num_unit_tasks;
  const UnitTask* unit_tasks;
  const DeviceItem* items;
  // Per plan entry, the group's applied steps in which the tensor had no
  // gradient (its own step number is t - missed[entry]).
  const uint32_t* missed;
  // The update's (table 0's) FP8 parameters, num_fp8 of them: the amax
  // prediction's work (Fp8Prediction).
  const DeviceFp8Tensor* fp8;
  uint32_t num_fp8;
};

// The steps of a session that the daemon let through without its trainer
// (backends/cuda/trainer_gone.h): the trainer died before its stream wrote
// their ready flag, so their gradients may be incomplete, and they are
// skipped. Pinned host memory, one per session, written by the host and
// read by the step's kernels: a step is abandoned when its ticket (as 32
// bits) lies in [first, through], the low and high halves of `range`,
// compared cyclically; one word, so that a kernel never reads half of a
// new range. 0: none (no step has ticket 0).
struct AbandonedSteps {
  uint64_t range;
};

// One group's step arguments, written by the host into pinned memory.
struct alignas(16) GroupStep {
  StepHyper hyper;
  const double* partials;  // the group's partial sums of squares
  uint32_t num_partials;
  // The step's sequence on the trainer's step flags (0: none) and its
  // ticket, the session's count of steps launched (never reset), which
  // AbandonedSteps compares, the same in every group.
  uint32_t flag_sequence;
  uint64_t ticket;
  const volatile AbandonedSteps* abandoned;
  DeviceGroupState* state;  // the group's device-resident counters
  DeviceScalars* scalars;   // out: the group's step scalars
  // The plan entries without a gradient this step: absent[0] entries,
  // listed from absent[1]; an applied step adds one to their `missed`.
  const uint32_t* absent;
  uint32_t* missed;
};
static_assert(sizeof(GroupStep) % 16 == 0, "copied in 16-byte pieces");

}  // namespace cuda
}  // namespace optimd

#endif  // OPTIMD_KERNELS_CUDA_STEP_TYPES_H_
