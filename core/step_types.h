// The types of the domain model that the step math consumes: a group's
// AdamW hyperparameters and one tensor's buffer pointers. Here, in core,
// so that the model (core/group.h) does not depend on any kernel; the
// kernels (kernels/adamw_cpu.h, the CUDA backend) include this.
#ifndef OPTIMD_CORE_STEP_TYPES_H_
#define OPTIMD_CORE_STEP_TYPES_H_

namespace optimd {

// Hyperparameters needed to fold StepScalars.
struct AdamWHyper {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 1e-2;
  bool adamw = true;
  bool bias_correction = true;
  bool maximize = false;
  bool amsgrad = false;
};

// Raw pointers to one tensor's buffers. Unused ones are null.
struct TensorPointers {
  void* param = nullptr;
  const void* grad = nullptr;
  void* master = nullptr;  // float* (kFp32) or int16_t* (kRemainder)
  void* exp_avg = nullptr;
  void* exp_avg_sq = nullptr;
  void* max_exp_avg_sq = nullptr;
};

}  // namespace optimd

#endif  // OPTIMD_CORE_STEP_TYPES_H_
