// GPU step benchmark of the CUDA backend, through real CUDA IPC buffers of a
// trainer process, beside a device-to-device copy of the same bytes in the
// same run. bench/gpu_bench.py runs it next to torch.optim.AdamW(fused=True).
//
// Prints one "RESULT" line per configuration, step mode, item size and
// graph setting:
//   RESULT <name> <tensors> <params> <bytes/param> <gpu ms/step>
//          <median host us/step> <copy ms for the same bytes> <mode>
//          <item elements> <graphs 0|1> <median host CPU us/step>
// Gradients: every byte 0x3c by default (--grad_byte), 0.0115 in fp32 and
// bf16: moments are then normal numbers, as in training. All-zero
// gradients (--grad_byte=0) leave every second moment zero, which sends
// every square root through the slow path of IEEE sqrt (its fast path
// covers 2^-101 <= x <= FLT_MAX): about 8% more time for bf16 moments.
// Modes: "default" (every step checks the gradients for inf/NaN and
// computes their norm), "assume_finite" (no statistics pass), "clip"
// (max_grad_norm = 1: the statistics pass plus the clip coefficient).
// FP8 parameters: the rows fp8_tensor, fp8_1x128, fp8_128x128, fp8_mxfp8
// and fp8_mxfp8_bf16m (e4m3 weights, bf16 gradients), e.g.
//   cuda_step_bench --only=fp8_tensor,fp8_1x128,fp8_128x128,fp8_mxfp8
// whose bytes per parameter count the codes written once (the master is
// read and written once; a second read of the master, where per-tensor
// scaling's predicted amax misses, is not counted). Their weights are
// normal (sigma 1, e4m3 codes, scale inverses 1) and their gradients
// normal (sigma 0.01), element by element, as a model's (--fp8_random=false:
// the constant bytes above, every element alike, which no amax prediction can
// miss).
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "backends/cuda/cuda_backend.h"
#include "core/fp8.h"
#include "core/layout.h"
#include "core/session.h"
#include "testing/fp8_predictions.h"
#include "testing/ipc_trainer.h"

ABSL_FLAG(double, params, 1e9, "Parameters per configuration.");
ABSL_FLAG(int, steps, 20, "Timed steps per configuration.");
ABSL_FLAG(int, grad_byte, 0x3c,
          "Every byte of the gradients (0x3c: 0.0115 in fp32 and bf16, so "
          "that moments are normal numbers as in training; 0 makes every "
          "square root take its slow path).");
ABSL_FLAG(std::vector<std::string>, only, {},
          "Run only the configurations of these names.");
ABSL_FLAG(std::vector<std::string>, modes, {"default"},
          "Step modes to time: default, assume_finite, clip.");
ABSL_FLAG(std::vector<std::string>, item_elements, {"0"},
          "Elements per plan item to time (0: the backend's default).");
ABSL_FLAG(std::string, optimizer, "adamw",
          "The groups' optimizer: adamw, sgd (momentum 0.9) or lion.");
ABSL_FLAG(bool, fp8_random, true,
          "FP8 configurations: normal weights and gradients, element by "
          "element (false: --grad_byte gradients and zero weights).");
ABSL_FLAG(bool, fp8_uniform, false,
          "With --fp8_random: weights uniform in [-1, 1] (a flat top, as "
          "torch's default initialization of a Linear layer) instead of "
          "normal.");
ABSL_FLAG(std::vector<std::string>, graphs, {"1"},
          "CudaBackendOptions::use_graphs values to time (0, 1).");

namespace optimd {
namespace {

struct Config {
  const char* name;
  uint64_t tensors;
  DType param, grad, moment;
  MasterRequest master;
  uint64_t params_override = 0;
  // FP8 parameters: the recipe (their tensors are [numel / 4096, 4096]).
  Fp8Recipe recipe = Fp8Recipe::kNone;
};

double ThreadCpu() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return t.tv_sec + 1e-9 * t.tv_nsec;
}

double Now() {
  return std::chrono::duration<double>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// A step whose failure ends the benchmark.
void MustStep(Session& s, const StepRequestSpec& spec) {
  auto r = s.Step(spec);
  if (!r.ok()) {
    std::fprintf(stderr, "step failed: %s\n", r.status().ToString().c_str());
    std::exit(1);
  }
}

double CopyMs(uint64_t bytes, int repeats) {
  void *a = nullptr, *b = nullptr;
  if (cudaMalloc(&a, bytes) != cudaSuccess ||
      cudaMalloc(&b, bytes) != cudaSuccess) {
    std::fprintf(stderr, "copy baseline: cannot allocate 2 x %llu bytes\n",
                 static_cast<unsigned long long>(bytes));
    return -1;
  }
  bool ok = cudaMemset(a, 1, bytes) == cudaSuccess;
  cudaEvent_t e0, e1;
  ok = ok && cudaEventCreate(&e0) == cudaSuccess;
  ok = ok && cudaEventCreate(&e1) == cudaSuccess;
  ok = ok && cudaMemcpy(b, a, bytes, cudaMemcpyDeviceToDevice) == cudaSuccess;
  ok = ok && cudaEventRecord(e0) == cudaSuccess;
  for (int i = 0; ok && i < repeats; ++i) {
    ok = cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice) == cudaSuccess;
  }
  ok = ok && cudaEventRecord(e1) == cudaSuccess;
  ok = ok && cudaEventSynchronize(e1) == cudaSuccess;
  float ms = 0;
  ok = ok && cudaEventElapsedTime(&ms, e0, e1) == cudaSuccess;
  cudaFree(a);
  cudaFree(b);
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  if (!ok) {
    std::fprintf(stderr, "copy baseline: a CUDA call failed: %s\n",
                 cudaGetErrorString(cudaGetLastError()));
    return -1;
  }
  return ms / repeats;
}

// Every configuration the benchmark knows, in the order it times them.
std::vector<Config> Configs() {
  return {
      {"fp32", 16, DType::kFloat32, DType::kFloat32, DType::kFloat32,
       MasterRequest::kNone},
      {"fp32", 1000, DType::kFloat32, DType::kFloat32, DType::kFloat32,
       MasterRequest::kNone},
      {"fp32", 10000, DType::kFloat32, DType::kFloat32, DType::kFloat32,
       MasterRequest::kNone},
      {"fp32_small", 100000, DType::kFloat32, DType::kFloat32, DType::kFloat32,
       MasterRequest::kNone, 100000ull * 10000},
      {"bf16_rem_fp32m", 1000, DType::kBFloat16, DType::kBFloat16,
       DType::kFloat32, MasterRequest::kRemainder},
      {"bf16_rem_bf16m", 1000, DType::kBFloat16, DType::kBFloat16,
       DType::kBFloat16, MasterRequest::kRemainder},
      {"bf16_fp32master", 1000, DType::kBFloat16, DType::kBFloat16,
       DType::kFloat32, MasterRequest::kFp32},
      {"fp32_block8m", 1000, DType::kFloat32, DType::kFloat32, DType::kBlock8,
       MasterRequest::kNone},
      {"bf16_rem_block8m", 1000, DType::kBFloat16, DType::kBFloat16,
       DType::kBlock8, MasterRequest::kRemainder},
      // FP8 parameters with bf16 gradients: each recipe's step against the
      // copy of its own bytes (the master read and written, moments,
      // gradient, the FP8 codes written).
      {"fp8_tensor", 1000, DType::kFloat8E4M3, DType::kBFloat16,
       DType::kFloat32, MasterRequest::kFp32, 0, Fp8Recipe::kTensor},
      {"fp8_1x128", 1000, DType::kFloat8E4M3, DType::kBFloat16, DType::kFloat32,
       MasterRequest::kFp32, 0, Fp8Recipe::kBlock1x128},
      {"fp8_128x128", 1000, DType::kFloat8E4M3, DType::kBFloat16,
       DType::kFloat32, MasterRequest::kFp32, 0, Fp8Recipe::kBlock128x128},
      {"fp8_mxfp8", 1000, DType::kFloat8E4M3, DType::kBFloat16, DType::kFloat32,
       MasterRequest::kFp32, 0, Fp8Recipe::kMxfp8},
      {"fp8_mxfp8_bf16m", 1000, DType::kFloat8E4M3, DType::kBFloat16,
       DType::kBFloat16, MasterRequest::kFp32, 0, Fp8Recipe::kMxfp8},
  };
}

// One CUDA backend of the options it was made with.
struct BackendVariant {
  std::unique_ptr<Backend> backend;
  CudaBackendOptions options;
};

// A backend for every pair of --item_elements and --graphs values, item
// size outermost. False, with the reason on stderr, for a bad flag value
// or a backend that cannot be made.
bool CreateBackendVariants(std::vector<BackendVariant>* variants) {
  for (const std::string& v : absl::GetFlag(FLAGS_item_elements)) {
    for (const std::string& g : absl::GetFlag(FLAGS_graphs)) {
      CudaBackendOptions options;
      uint64_t item = 0;
      if (!absl::SimpleAtoi(v, &item) || (g != "0" && g != "1")) {
        std::fprintf(stderr, "bad --item_elements or --graphs value\n");
        return false;
      }
      if (item > 0) options.item_elements = item;
      options.use_graphs = g == "1";
      auto backend = CreateCudaBackend(0, options);
      if (!backend.ok()) {
        std::fprintf(stderr, "%s\n", backend.status().ToString().c_str());
        return false;
      }
      variants->push_back({*std::move(backend), options});
    }
  }
  return true;
}

// The groups' hyperparameters for --optimizer (the defaults are AdamW's).
// False, with the reason on stderr, for an unknown optimizer.
bool ParseOptimizer(OptimizerHyper* hyper) {
  const std::string optimizer = absl::GetFlag(FLAGS_optimizer);
  if (optimizer == "sgd") {
    hyper->kind = OptimizerKind::kSgd;
    hyper->momentum = 0.9;
  } else if (optimizer == "lion") {
    hyper->kind = OptimizerKind::kLion;
    hyper->beta2 = 0.99;
  } else if (optimizer != "adamw") {
    std::fprintf(stderr, "unknown --optimizer %s\n", optimizer.c_str());
    return false;
  }
  return true;
}

// Whether every --modes value is a mode the benchmark knows; the first
// unknown one is named on stderr.
bool ModesAreKnown() {
  for (const std::string& m : absl::GetFlag(FLAGS_modes)) {
    if (m != "default" && m != "assume_finite" && m != "clip") {
      std::fprintf(stderr, "unknown mode %s\n", m.c_str());
      return false;
    }
  }
  return true;
}

// Whether --only leaves configuration `c` in.
bool Selected(const Config& c) {
  const std::vector<std::string> only = absl::GetFlag(FLAGS_only);
  return only.empty() ||
         std::find(only.begin(), only.end(), c.name) != only.end();
}

// One configuration's buffers in the trainer process, and the geometry
// they were sized for: `tensors` tensors of `per` elements each.
struct ConfigBuffers {
  uint64_t per = 0;
  std::vector<uint64_t> shape;  // of every tensor
  uint64_t scale_bytes = 0;     // FP8 scales of one tensor
  IpcTrainer::Allocation params, grads, scales;
};

// Allocates configuration `c`'s parameters, gradients (every byte
// `grad_byte`) and FP8 scales over `total` parameters (unless the
// configuration sets its own count). False, said on stderr, when the
// trainer cannot allocate them.
bool AllocateBuffers(IpcTrainer* trainer, const Config& c, uint64_t total,
                     int grad_byte, ConfigBuffers* b) {
  const uint64_t n = c.params_override ? c.params_override : total;
  const uint64_t per = n / c.tensors;
  const uint64_t ps = DTypeSize(c.param), gs = DTypeSize(c.grad);
  auto params = trainer->Alloc(per * c.tensors * ps + 256);
  auto grads = trainer->Alloc(per * c.tensors * gs + 256,
                              static_cast<uint8_t>(grad_byte));
  const std::vector<uint64_t> shape =
      per % 4096 == 0 ? std::vector<uint64_t>{per / 4096, 4096}
                      : std::vector<uint64_t>{per};
  const uint64_t scale_bytes =
      Fp8Geometry::Of(c.recipe, per, shape).ScaleBytes();
  auto scales = trainer->Alloc(scale_bytes * c.tensors + 256);
  if (!params.ok() || !grads.ok() || !scales.ok()) {
    std::fprintf(stderr, "trainer allocation failed\n");
    return false;
  }
  b->per = per;
  b->shape = shape;
  b->scale_bytes = scale_bytes;
  b->params = *params;
  b->grads = *grads;
  b->scales = *scales;
  return true;
}

// Fills bytes [0, bytes) of trainer allocation `id` with value(i) for byte
// i of each staging-sized chunk (the staging area's pattern repeats).
template <typename Value>
bool FillRepeating(IpcTrainer* trainer, int id, uint64_t bytes,
                   uint64_t staging_bytes, Value value) {
  for (uint64_t i = 0; i < staging_bytes; ++i) trainer->staging()[i] = value(i);
  for (uint64_t at = 0; at < bytes; at += staging_bytes) {
    const uint64_t n = std::min(staging_bytes, bytes - at);
    if (!trainer->Upload(id, at, n, 0).ok()) {
      std::fprintf(stderr, "trainer upload failed\n");
      return false;
    }
  }
  return true;
}

// An FP8 configuration's weights (e4m3 codes of normal values, sigma 1,
// scale inverses 1) and bf16 gradients (normal, sigma 0.01), element by
// element.
bool FillFp8Random(IpcTrainer* trainer, const Config& c, const ConfigBuffers& b,
                   uint64_t staging_bytes) {
  // 1: fp32 1.0f, or MXFP8's e8m0 code 127.
  const bool e8m0 = c.recipe == Fp8Recipe::kMxfp8;
  if (!FillRepeating(trainer, b.scales.id, b.scale_bytes * c.tensors,
                     staging_bytes, [e8m0](uint64_t i) -> uint8_t {
                       if (e8m0) return 127;
                       return i % 4 == 3 ? 0x3f : i % 4 == 2 ? 0x80 : 0;
                     })) {
    return false;
  }
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::uniform_real_distribution<float> uniform(-1.f, 1.f);
  const bool flat = absl::GetFlag(FLAGS_fp8_uniform);
  std::vector<float> x(staging_bytes);
  for (float& v : x) v = flat ? uniform(rng) : normal(rng);
  const uint64_t n = b.per * c.tensors;
  const bool params =
      FillRepeating(trainer, b.params.id, n, staging_bytes,
                    [&](uint64_t i) { return EncodeFp8<kE4M3>(x[i]); });
  // bf16: the upper half of the fp32 bits (truncated; any value will do).
  return params &&
         FillRepeating(
             trainer, b.grads.id, 2 * n, staging_bytes, [&](uint64_t i) {
               uint32_t bits;
               const float g = 0.01f * x[(i / 2 + 7919) % staging_bytes];
               std::memcpy(&bits, &g, 4);
               return static_cast<uint8_t>(bits >> (i % 2 ? 24 : 16));
             });
}

// Bytes one step of configuration `c` must move per parameter: read grad,
// state slots and master (or the parameter where the master is not a
// separate fp32 copy), write them back. The same for every backend
// variant: one copy baseline per configuration.
uint64_t BytesPerParam(const Config& c, const OptimizerHyper& hyper) {
  const uint64_t ps = DTypeSize(c.param), gs = DTypeSize(c.grad);
  Layout l =
      *ResolveLayout("t", c.param, c.grad, c.moment, c.master, false, hyper);
  return gs + l.MasterBytesPerElement() * 2 +
         l.MomentBytesPerElement() * 2 * l.state_slots +
         (c.master == MasterRequest::kFp32 ? ps : 2 * ps);
}

// Group "g" of configuration `c`: its tensors "t0", "t1", ... side by side
// in the trainer's buffers `b`, each FP8 tensor with its scales.
GroupSpec MakeGroupSpec(const Config& c, const OptimizerHyper& hyper,
                        const ConfigBuffers& b) {
  const uint64_t per = b.per;
  const uint64_t ps = DTypeSize(c.param), gs = DTypeSize(c.grad);
  GroupSpec spec;
  spec.id = "g";
  spec.master = c.master;
  spec.moment_dtype = c.moment;
  spec.hyper = hyper;
  for (uint64_t i = 0; i < c.tensors; ++i) {
    TensorSpec t;
    t.name = "t" + std::to_string(i);
    t.numel = per;
    t.param_dtype = c.param;
    t.grad_dtype = c.grad;
    t.param_dtype_set = t.grad_dtype_set = true;
    t.param.kind = t.grad.kind = BufferHandle::Kind::kCudaIpc;
    t.param.device = t.grad.device = 0;
    t.param.ipc_handle = b.params.ipc_handle;
    t.grad.ipc_handle = b.grads.ipc_handle;
    t.param.offset = i * per * ps;
    t.grad.offset = i * per * gs;
    t.param.size = per * ps;
    t.grad.size = per * gs;
    if (c.recipe != Fp8Recipe::kNone) {
      t.shape = b.shape;
      t.fp8_recipe = c.recipe;
      t.scale_inv = t.param;
      t.scale_inv.ipc_handle = b.scales.ipc_handle;
      t.scale_inv.offset = i * b.scale_bytes;
      t.scale_inv.size = b.scale_bytes;
    }
    spec.tensors.push_back(t);
  }
  return spec;
}

// The two steps of a step mode: one that returns once launched, and one
// that waits for the GPU.
struct ModeSteps {
  StepRequestSpec async_step, wait_step;
};

ModeSteps StepsOfMode(const std::string& mode) {
  ModeSteps m;
  m.wait_step.options.wait = true;
  for (StepRequestSpec* r : {&m.async_step, &m.wait_step}) {
    r->options.assume_finite = mode == "assume_finite";
    if (mode == "clip") r->options.max_grad_norm = 1.0;
  }
  return m;
}

// What one step mode measured on one backend variant.
struct ModeTimes {
  double first_ms = 0;  // each of the first steps, waited for
  double gpu_ms = 0;    // per step, steps back to back
  double host_s = 0;    // median wall time of one asynchronous Step
  double cpu_s = 0;     // median thread CPU time of the same
};

ModeTimes TimeMode(Session& s, const ModeSteps& m, int step_records,
                   int steps) {
  ModeTimes times;
  // The first steps after a change of configuration (here: the mode), one
  // per step record, each capture a CUDA graph for their record: their wall
  // time, each waited for from an idle GPU, against gpu_ms (and against the
  // same without graphs).
  const double f0 = Now();
  for (int i = 0; i < step_records; ++i) MustStep(s, m.wait_step);
  times.first_ms = (Now() - f0) * 1e3 / step_records;
  const double t0 = Now();
  for (int i = 0; i < steps; ++i) MustStep(s, m.async_step);
  MustStep(s, m.wait_step);
  times.gpu_ms = (Now() - t0) * 1e3 / (steps + 1);
  // Host time of one asynchronous Step (the launches and bookkeeping), with
  // the GPU idle before it so that nothing blocks: the median of 51 (the
  // host of a shared machine is noisy).
  // Also the thread's CPU time, which leaves out time the thread spent
  // preempted by other processes.
  std::vector<double> host, cpu;
  for (int i = 0; i < 51; ++i) {
    MustStep(s, m.wait_step);
    const double c0 = ThreadCpu();
    const double h0 = Now();
    MustStep(s, m.async_step);
    host.push_back(Now() - h0);
    cpu.push_back(ThreadCpu() - c0);
  }
  std::sort(host.begin(), host.end());
  std::sort(cpu.begin(), cpu.end());
  MustStep(s, m.wait_step);
  times.host_s = host[host.size() / 2];
  times.cpu_s = cpu[cpu.size() / 2];
  return times;
}

// What the RESULT line of one configuration says beside its times.
struct ConfigRun {
  const Config& c;
  uint64_t per;      // elements per tensor
  uint64_t bpp;      // bytes per parameter a step moves
  double copy_ms;    // the copy baseline of the same bytes
  double reg_s = 0;  // the group's registration, on this backend
};

void PrintResult(const ConfigRun& run, const std::string& mode,
                 const CudaBackendOptions& variant, const ModeTimes& t) {
  std::printf(
      "RESULT %s %llu %llu %llu %.3f %.1f %.3f %s %llu %d %.1f "
      "(registration %.2f s; first %d steps, waited: %.3f ms "
      "each)\n",
      run.c.name, static_cast<unsigned long long>(run.c.tensors),
      static_cast<unsigned long long>(run.per * run.c.tensors),
      static_cast<unsigned long long>(run.bpp), t.gpu_ms, t.host_s * 1e6,
      run.copy_ms, mode.c_str(),
      static_cast<unsigned long long>(variant.item_elements),
      variant.use_graphs ? 1 : 0, t.cpu_s * 1e6, run.reg_s,
      variant.step_records, t.first_ms);
  std::fflush(stdout);
}

// Per-tensor FP8 scaling: the steps whose encode pass read the masters
// back (the amax prediction missed, or had no candidates yet), summed
// over the group's tensors (cuda::Fp8Prediction).
void PrintEncodePasses(Session& s) {
  const auto p = ReadFp8Predictions(s);
  if (!p.ok()) {
    std::fprintf(stderr, "%s\n", p.status().ToString().c_str());
    return;
  }
  uint64_t passes = 0;
  for (const auto& t : *p) passes += t.encode_passes;
  std::printf("ENCODE_PASSES %llu over %zu tensors, all steps\n",
              static_cast<unsigned long long>(passes), p->size());
}

// Registers the configuration's group on one backend variant and times
// every --modes value there, a RESULT line each. False, said on stderr,
// when the session cannot be opened or the group registered.
bool TimeOnBackend(const BackendVariant& variant, const GroupSpec& spec,
                   ConfigRun run, int steps) {
  Backend* backend = variant.backend.get();
  StateBudget budget(0);
  std::string done;
  auto ctx = backend->OpenSession(0, "", &done);
  if (!ctx.ok()) {
    std::fprintf(stderr, "%s\n", ctx.status().ToString().c_str());
    return false;
  }
  Session s(SessionIdentity{"bench", 0, 1, 0}, backend, &budget,
            *std::move(ctx));
  const double r0 = Now();
  auto reg = s.RegisterGroup(spec);
  if (!reg.ok()) {
    std::fprintf(stderr, "%s\n", reg.status().ToString().c_str());
    return false;
  }
  run.reg_s = Now() - r0;
  for (const std::string& mode : absl::GetFlag(FLAGS_modes)) {
    const ModeTimes t =
        TimeMode(s, StepsOfMode(mode), variant.options.step_records, steps);
    PrintResult(run, mode, variant.options, t);
  }
  if (run.c.recipe == Fp8Recipe::kTensor) PrintEncodePasses(s);
  return true;
}

// The trainer's staging area: the period of FillFp8Random's values.
constexpr uint64_t kStagingBytes = 16 << 20;

int Run(IpcTrainer* trainer) {
  const uint64_t total = static_cast<uint64_t>(absl::GetFlag(FLAGS_params));
  const int steps = absl::GetFlag(FLAGS_steps);
  const int grad_byte = absl::GetFlag(FLAGS_grad_byte);
  std::vector<BackendVariant> variants;
  if (!CreateBackendVariants(&variants)) return 1;
  OptimizerHyper hyper;
  if (!ParseOptimizer(&hyper) || !ModesAreKnown()) return 1;
  for (const Config& c : Configs()) {
    if (!Selected(c)) continue;
    ConfigBuffers buffers;
    if (!AllocateBuffers(trainer, c, total, grad_byte, &buffers)) return 1;
    if (c.recipe != Fp8Recipe::kNone && absl::GetFlag(FLAGS_fp8_random) &&
        c.grad == DType::kBFloat16 &&
        !FillFp8Random(trainer, c, buffers, kStagingBytes)) {
      return 1;
    }
    const uint64_t bpp = BytesPerParam(c, hyper);
    const double copy_ms = CopyMs(buffers.per * c.tensors * bpp / 2, 10);
    const GroupSpec spec = MakeGroupSpec(c, hyper, buffers);
    for (const BackendVariant& variant : variants) {
      if (!TimeOnBackend(variant, spec, {c, buffers.per, bpp, copy_ms},
                         steps)) {
        return 1;
      }
    }
  }
  return 0;
}

}  // namespace
}  // namespace optimd

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  auto trainer = optimd::IpcTrainer::Start(0, optimd::kStagingBytes);
  if (!trainer.ok()) return 1;
  const int rc = optimd::Run(trainer->get());
  trainer->reset();
  return rc;
}
