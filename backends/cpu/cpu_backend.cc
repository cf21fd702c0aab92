#include "backends/cpu/cpu_backend.h"

#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/fault_guard.h"
#include "common/status_macros.h"
#include "core/state_shard.h"
#include "core/step_math.h"
#include "kernels/master_cpu.h"
#include "kernels/step_cpu.h"

namespace optimd {

CpuBackend::CpuBackend(const Options& options)
    : options_(options),
      segments_(options.max_open_segments),
      pool_(options.threads) {
  MutexLock lock(&pool_mu_);
  partial_sums_.assign(static_cast<size_t>(pool_.size()) * 8, 0.0);
}

absl::StatusOr<BufferRef> CpuBackend::ResolveBuffer(const BufferHandle& handle,
                                                    uint64_t alignment,
                                                    const std::string& what) {
  return segments_.Resolve(handle, alignment, what);
}

absl::StatusOr<StateStorage> CpuBackend::AllocateState(uint64_t bytes) {
  if (bytes == 0) return StateStorage();
  constexpr uint64_t kAlign = 64;
  const uint64_t rounded = (bytes + kAlign - 1) / kAlign * kAlign;
  // The state is zeroed, so every byte of it gets touched: more than the
  // machine can hold would get the daemon killed for lack of memory
  // instead of refusing the registration.
  if (absl::Status s = CheckHostMemory(rounded, "the optimizer state");
      !s.ok()) {
    return absl::ResourceExhaustedError(
        absl::StrCat(s.message(),
                     "; use bf16 moments or remainders, fewer parameters per "
                     "daemon, or set --max_state_bytes"));
  }
  void* p = std::aligned_alloc(kAlign, rounded);
  if (p == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot allocate ", bytes, " bytes of optimizer state"));
  }
  std::memset(p, 0, rounded);
  return StateStorage(static_cast<uint8_t*>(p), bytes,
                      [](uint8_t* q) { std::free(q); });
}

absl::Status CpuBackend::PrepareGroup(Group& group) {
  MutexLock lock(&pool_mu_);
  BuildPlan(group, options_.item_elements);
  counters().plan_builds.fetch_add(1, std::memory_order_relaxed);
  const Plan& plan = group.plan;
  std::atomic<bool> fault{false};
  pool_.ParallelFor(plan.items.size(), [&](uint64_t i, int) {
    const PlanItem& item = plan.items[i];
    if (!GuardMemoryFaults(
             [&] {
               InitMasterRange(plan.layouts[item.entry],
                               plan.entries[item.entry], item.begin, item.end);
             },
             "registration")
             .ok()) {
      fault = true;
    }
  });
  if (fault) return fault_guard_internal::FaultStatus("registration");
  // Frozen tensors are never stepped but keep a master copy for GetParams and
  // checkpoints.
  return GuardMemoryFaults(
      [&] {
        for (TensorEntry& t : group.tensors) {
          if (t.frozen && t.numel > 0) {
            InitMasterRange(t.layout, t.Pointers(), 0, t.numel);
          }
        }
      },
      "registration");
}

absl::Status CpuBackend::UpdatePlanEntries(
    Group& group, const std::vector<uint32_t>& entries) {
  for (uint32_t entry : entries) {
    group.plan.entries[entry] =
        group.tensors[group.plan.tensor_index[entry]].Pointers();
  }
  counters().plan_entry_updates.fetch_add(entries.size(),
                                          std::memory_order_relaxed);
  return absl::OkStatus();
}

namespace {

// The CPU backend's per-session state: the session's totals.
struct CpuSession : SessionContext {
  uint64_t applied = 0;
  uint64_t skipped = 0;
};

}  // namespace

absl::StatusOr<std::unique_ptr<SessionContext>> CpuBackend::OpenSession(
    int device, const std::string& ready_event, std::string* done_event) {
  if (!ready_event.empty()) {
    return absl::InvalidArgumentError(
        "the CPU backend takes no CUDA events; leave ready_event empty");
  }
  done_event->clear();
  return std::unique_ptr<SessionContext>(new CpuSession());
}

namespace {

// Per plan entry, the step scalars of its own step count when some tensor
// of `g` missed steps (its bias correction, or SGD's first step, then
// differs from the group's); empty otherwise, the usual case.
std::vector<OptimizerScalars> OwnStepScalars(const Group& g, double scale,
                                             double clip) {
  const auto missed = [&](uint32_t e) {
    return g.tensors[g.plan.tensor_index[e]].missed_steps;
  };
  const uint32_t n = static_cast<uint32_t>(g.plan.entries.size());
  bool any = false;
  for (uint32_t e = 0; e < n && !any; ++e) any = missed(e) != 0;
  if (!any) return {};
  std::vector<OptimizerScalars> own(n);
  for (uint32_t e = 0; e < n; ++e) {
    own[e] = MakeOptimizerScalars(g.hyper, g.step + 1 - missed(e), scale, clip);
  }
  return own;
}

}  // namespace

double CpuBackend::SumSquares(const std::vector<Group*>& groups) {
  double sumsq = 0.0;
  for (Group* g : groups) {
    const Plan& plan = g->plan;
    if (plan.items.empty()) continue;
    std::fill(partial_sums_.begin(), partial_sums_.end(), 0.0);
    // The pool's threads write the sums while this thread holds pool_mu_.
    double* partials = partial_sums_.data();
    pool_.ParallelFor(plan.tasks.size(), [&](uint64_t t, int worker) {
      double sum = 0;
      const absl::Status s = GuardMemoryFaults(
          [&] {
            for (uint32_t i = plan.tasks[t].first_item;
                 i < plan.tasks[t].end_item; ++i) {
              const PlanItem& item = plan.items[i];
              // An entry without a gradient (absent) is not stepped.
              if (plan.entries[item.entry].grad == nullptr) continue;
              sum += GradSumSquaresRange(plan.layouts[item.entry].grad_dtype,
                                         plan.entries[item.entry].grad,
                                         item.begin, item.end);
            }
          },
          "step");
      if (!s.ok()) fault_ = true;
      partials[static_cast<size_t>(worker) * 8] += sum;
    });
    for (int w = 0; w < pool_.size(); ++w) sumsq += partial_sums_[w * 8];
  }
  return sumsq;
}

void CpuBackend::Update(const std::vector<Group*>& groups, double scale,
                        double clip) {
  for (Group* g : groups) {
    const Plan& plan = g->plan;
    if (plan.items.empty()) continue;
    const OptimizerScalars s =
        MakeOptimizerScalars(g->hyper, g->step + 1, scale, clip);
    const std::vector<OptimizerScalars> own = OwnStepScalars(*g, scale, clip);
    // Pass by pass (Plan::pass_tasks): parameters over one memory are
    // updated one after the other, as torch steps them.
    for (uint32_t pass = 0; pass < plan.passes(); ++pass) {
      const uint32_t first = plan.pass_tasks[pass];
      pool_.ParallelFor(plan.pass_tasks[pass + 1] - first, [&](uint64_t k,
                                                               int) {
        const PlanTask& task = plan.tasks[first + k];
        const absl::Status st = GuardMemoryFaults(
            [&] {
              for (uint32_t i = task.first_item; i < task.end_item; ++i) {
                const PlanItem& item = plan.items[i];
                if (plan.entries[item.entry].grad == nullptr) continue;
                OptimizerStepRange(plan.layouts[item.entry],
                                   plan.entries[item.entry], item.begin,
                                   item.end, own.empty() ? s : own[item.entry]);
              }
            },
            "step");
        if (!st.ok()) fault_ = true;
      });
    }
  }
}

absl::StatusOr<double> CpuBackend::Statistics(const std::vector<Group*>& groups,
                                              const StepOptions& options) {
  double sumsq = 0.0;
  bool faulted = false;
  {
    MutexLock lock(&pool_mu_);
    sumsq = SumSquares(groups);
    faulted = fault_.exchange(false);
  }
  // A fault: nothing has changed yet.
  if (options.exchange == nullptr) {
    if (faulted) return fault_guard_internal::FaultStatus("step");
    return sumsq;
  }
  if (options.exchanged != nullptr) *options.exchanged = true;
  // A faulted rank contributes NaN, so that every rank skips this step.
  absl::StatusOr<double> job = options.exchange->Reduce(
      options.rank, faulted ? std::numeric_limits<double>::quiet_NaN() : sumsq,
      options.exchange_deadline);
  if (faulted) return fault_guard_internal::FaultStatus("step");
  return job;
}

absl::Status CpuBackend::GatherParams(const std::vector<Group*>& groups,
                                      const StepOptions& options, bool failed) {
  const ParamPieces mine = UpdatedParamPieces(groups);
  auto copy = [&](const std::vector<const ParamPieces*>& all) -> absl::Status {
    // Targets first, so that a registration mismatch writes nothing.
    std::vector<std::pair<const ParamPiece*, uint8_t*>> copies;
    for (uint32_t r = 0; r < all.size(); ++r) {
      if (r == options.rank) continue;
      for (const ParamPiece& p : *all[r]) {
        OPTIMD_ASSIGN_OR_RETURN(uint8_t * to, PieceTarget(groups, p));
        copies.emplace_back(&p, to);
      }
    }
    // Other ranks' segments are read under the fault guard as well: a
    // trainer that shrinks its segment faults the copy, not the daemon.
    return GuardMemoryFaults(
        [&] {
          for (const auto& [p, to] : copies) {
            std::memcpy(to, p->data, p->bytes);
          }
        },
        "parameter gather");
  };
  return options.exchange->Gather(options.rank, &mine, failed, copy,
                                  options.exchange_deadline);
}

absl::StatusOr<StepOutcome> CpuBackend::Step(SessionContext* session,
                                             const std::vector<Group*>& groups,
                                             const StepOptions& options) {
  auto* totals = static_cast<CpuSession*>(session);
  // The trainer's writes into its parameters first (its writes are done:
  // a CPU trainer sends the step after them).
  if (options.written != nullptr) {
    for (const TensorEntry* t : *options.written) {
      OPTIMD_RETURN_IF_ERROR(AdoptWrittenParam(*t));
    }
  }
  StepOutcome out;
  // Pass 1: the sum of squares of every gradient of the session (of the
  // job, when its ranks exchange them).
  const bool statistics = !options.assume_finite || options.max_grad_norm > 0 ||
                          options.exchange != nullptr;
  double sumsq = 0.0;
  if (statistics) {
    OPTIMD_ASSIGN_OR_RETURN(sumsq, Statistics(groups, options));
  }
  const double scale = EffectiveGradScale(options.grad_scale);
  // A non-finite sum skips the step unless the trainer takes charge of
  // non-finite gradients (StepOptions::assume_finite); the ranks of a job
  // always skip, since a failed rank contributes NaN.
  const bool skips = !options.assume_finite || options.exchange != nullptr;
  if (!std::isfinite(sumsq) && skips) {
    out.skipped = true;
    out.grad_norm = std::numeric_limits<double>::quiet_NaN();
    out.steps_applied = totals->applied;
    out.steps_skipped = ++totals->skipped;
    return out;
  }
  out.grad_norm = statistics ? std::sqrt(sumsq) / scale
                             : std::numeric_limits<double>::quiet_NaN();
  const double clip = ClipCoefficient(options.max_grad_norm, out.grad_norm);
  // Pass 2: the update, one parallel loop per group.
  bool faulted = false;
  {
    MutexLock lock(&pool_mu_);
    Update(groups, scale, clip);
    faulted = fault_.exchange(false);
  }
  // ZeRO: every rank's trainer gets the other ranks' updated parts.
  const absl::Status gathered =
      options.gather_params && options.exchange != nullptr
          ? GatherParams(groups, options, faulted)
          : absl::OkStatus();
  if (faulted) {
    return absl::DataLossError(
        "step: a trainer's shared-memory segment shrank during the update; "
        "the state is partly updated and must be loaded from a checkpoint");
  }
  for (Group* g : groups) {
    ++g->step;
    for (uint32_t e = 0; e < g->plan.entries.size(); ++e) {
      if (g->plan.entries[e].grad == nullptr) {
        ++g->tensors[g->plan.tensor_index[e]].missed_steps;
      }
    }
  }
  out.steps_applied = ++totals->applied;
  out.steps_skipped = totals->skipped;
  // This rank's part was stepped (its counters say so); a failed gather
  // leaves other ranks' parts of its trainer's parameters stale.
  if (!gathered.ok()) return gathered;
  return out;
}

absl::Status CpuBackend::WriteParams(Group& group) {
  return GuardMemoryFaults(
      [&] {
        for (TensorEntry& t : group.tensors) {
          if (t.numel > 0) {
            WriteParamFromMasterRange(t.layout, t.Pointers(), 0, t.numel);
          }
        }
      },
      "GetParams");
}

absl::Status CpuBackend::AdoptWrittenParam(const TensorEntry& t) {
  // Over the pool in pieces, as registration sets masters: a large tensor
  // written every step (a pruning mask) costs its own bytes' time.
  constexpr uint64_t kPiece = uint64_t{1} << 16;
  const TensorPointers p = t.Pointers();
  std::atomic<bool> fault{false};
  MutexLock lock(&pool_mu_);
  pool_.ParallelFor((t.numel + kPiece - 1) / kPiece, [&](uint64_t i, int) {
    const uint64_t begin = i * kPiece;
    const uint64_t end = std::min(t.numel, begin + kPiece);
    if (!GuardMemoryFaults(
             [&] { AdoptWrittenParamRange(t.layout, p, begin, end); },
             "UpdateBuffers")
             .ok()) {
      fault = true;
    }
  });
  if (fault) return fault_guard_internal::FaultStatus("UpdateBuffers");
  return absl::OkStatus();
}

absl::Status CpuBackend::CopyToHost(const uint8_t* src, uint8_t* dst,
                                    uint64_t bytes) {
  return GuardMemoryFaults(
      [&] {
        if (bytes > 0) std::memcpy(dst, src, bytes);
      },
      "state read");
}

absl::Status CpuBackend::CopyFromHost(const uint8_t* src, uint8_t* dst,
                                      uint64_t bytes) {
  return GuardMemoryFaults(
      [&] {
        if (bytes > 0) std::memcpy(dst, src, bytes);
      },
      "state write");
}

void CpuBackend::ForgetTrainerBuffers(
    const std::vector<std::shared_ptr<const void>>& mappings) {
  for (const auto& m : mappings) {
    const auto* segment = static_cast<const SharedMemorySegment*>(m.get());
    // Only while the name still names the trainer's segment: a new
    // trainer may have made another under it.
    if (segment->StillNamed()) shm_unlink(segment->name().c_str());
  }
}

absl::Status CpuBackend::CheckMappings(
    const std::vector<std::shared_ptr<const void>>& mappings) {
  for (const auto& m : mappings) {
    absl::Status s =
        static_cast<const SharedMemorySegment*>(m.get())->CheckStillMapped();
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

}  // namespace optimd
