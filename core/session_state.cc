// Session's state calls: GetState/SetState (ReadState, WriteState),
// converting between the backend's memory and host blobs, and the whole
// state lent to checkpoints (LockedSession). Registration and steps are in
// session.cc.
#include <algorithm>
#include <set>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "core/block8.h"
#include "core/fp8_quantize.h"
#include "core/session.h"

namespace optimd {
namespace {

// "exp_avg, exp_avg_sq, ": the state slots a tensor of `layout` holds, for
// errors.
std::string SlotNames(const Layout& layout) {
  std::string out;
  for (int s = 0; s < layout.state_slots; ++s) {
    absl::StrAppend(&out, StateSlotName(layout.optimizer, s), ", ");
  }
  return out;
}

// Widening to double is exact for every dtype, so one staging type serves
// all of them.
void ToDouble(DType d, const void* src, uint64_t n, double* out) {
  auto widen = [&](auto load) {
    for (uint64_t i = 0; i < n; ++i) out[i] = load(i);
  };
  const auto* f64 = static_cast<const double*>(src);
  const auto* f32 = static_cast<const float*>(src);
  const auto* u16 = static_cast<const uint16_t*>(src);
  switch (d) {
    case DType::kFloat64:
      return widen([&](uint64_t i) { return f64[i]; });
    case DType::kFloat32:
      return widen([&](uint64_t i) { return f32[i]; });
    case DType::kBFloat16:
      return widen([&](uint64_t i) { return BFloat16ToFloat(u16[i]); });
    case DType::kFloat16:
      return widen([&](uint64_t i) { return HalfToFloat(u16[i]); });
    case DType::kBlock8:  // refused for blobs (CheckStateBlobs)
    case DType::kFloat8E4M3:
    case DType::kFloat8E5M2:
      return;
  }
}

// Narrower dtypes round through float32, as torch's conversions from
// float64 to bfloat16 and float16 do.
void FromDouble(DType d, const double* src, uint64_t n, void* out) {
  auto* f64 = static_cast<double*>(out);
  auto* f32 = static_cast<float*>(out);
  auto* u16 = static_cast<uint16_t*>(out);
  switch (d) {
    case DType::kFloat64:
      std::copy(src, src + n, f64);
      return;
    case DType::kFloat32:
      for (uint64_t i = 0; i < n; ++i) f32[i] = static_cast<float>(src[i]);
      return;
    case DType::kBFloat16:
      for (uint64_t i = 0; i < n; ++i) {
        u16[i] = FloatToBFloat16(static_cast<float>(src[i]));
      }
      return;
    case DType::kFloat16:
      for (uint64_t i = 0; i < n; ++i) {
        u16[i] = FloatToHalf(static_cast<float>(src[i]));
      }
      return;
    case DType::kBlock8:      // written by WriteBlock8Slot
    case DType::kFloat8E4M3:  // never state (ResolveLayout, CheckStateBlobs)
    case DType::kFloat8E5M2:
      return;
  }
}

// The dtype of a tensor's "master" blob: its weight at full precision,
// float64 for a float64 parameter, else float32.
DType MasterBlobDType(const Layout& layout) {
  return layout.param_dtype == DType::kFloat64 ? DType::kFloat64
                                               : DType::kFloat32;
}

}  // namespace

absl::Status Session::ReadTensorState(const TensorEntry& t,
                                      std::vector<StateBlob>* out) {
  const uint64_t n = t.numel;
  auto raw = [&](const uint8_t* src, uint64_t bytes,
                 std::string* dst) -> absl::Status {
    dst->resize(bytes);
    return backend_->CopyToHost(src, reinterpret_cast<uint8_t*>(dst->data()),
                                bytes);
  };
  // The master at full precision (MasterBlobDType), for every layout.
  StateBlob master{t.name, "master", MasterBlobDType(t.layout), n,
                   std::string()};
  if (n > 0) {
    if (t.layout.master == MasterKind::kFp32) {
      OPTIMD_RETURN_IF_ERROR(raw(t.master.data(), n * 4, &master.data));
    } else if (t.layout.master == MasterKind::kRemainder) {
      std::string param, rem;
      OPTIMD_RETURN_IF_ERROR(raw(t.param.data, n * 2, &param));
      OPTIMD_RETURN_IF_ERROR(raw(t.master.data(), n * 2, &rem));
      master.data.resize(n * 4);
      float* mf = reinterpret_cast<float*>(master.data.data());
      const auto* pb = reinterpret_cast<const uint16_t*>(param.data());
      const auto* rb = reinterpret_cast<const int16_t*>(rem.data());
      for (uint64_t i = 0; i < n; ++i) {
        mf[i] = ReconstructFromRemainder(pb[i], rb[i]);
      }
    } else {
      // No master: the float32 or float64 parameter is the weight.
      OPTIMD_RETURN_IF_ERROR(
          raw(t.param.data, n * DTypeSize(t.layout.param_dtype), &master.data));
    }
  }
  out->push_back(std::move(master));
  if (t.frozen) return absl::OkStatus();
  if (t.layout.block8()) return ReadBlock8State(t, out);
  const DType md = t.layout.moment_dtype;
  const uint64_t mb = n * DTypeSize(md);
  for (int slot = 0; slot < t.layout.state_slots; ++slot) {
    StateBlob b{t.name, std::string(StateSlotName(t.layout.optimizer, slot)),
                md, n, std::string()};
    if (n > 0) {
      OPTIMD_RETURN_IF_ERROR(raw(t.state[slot].data(), mb, &b.data));
    }
    out->push_back(std::move(b));
  }
  return absl::OkStatus();
}

absl::Status Session::ReadBlock8State(const TensorEntry& t,
                                      std::vector<StateBlob>* out) {
  const uint64_t n = t.numel;
  const int slots = t.layout.state_slots;
  std::vector<float> scales(Block8Blocks(n) * slots);
  if (n > 0) {
    OPTIMD_RETURN_IF_ERROR(backend_->CopyToHost(
        t.scales.data(), reinterpret_cast<uint8_t*>(scales.data()),
        scales.size() * 4));
  }
  std::vector<uint8_t> codes(n);
  for (int slot = 0; slot < slots; ++slot) {
    // Dequantized: readers get the fp32 values the step computes with.
    StateBlob b{t.name, std::string(StateSlotName(t.layout.optimizer, slot)),
                DType::kFloat32, n, std::string(n * 4, '\0')};
    if (n > 0) {
      OPTIMD_RETURN_IF_ERROR(
          backend_->CopyToHost(t.state[slot].data(), codes.data(), n));
    }
    float* values = reinterpret_cast<float*>(b.data.data());
    for (uint64_t i = 0; i < n; i += kBlock8Elements) {
      const uint64_t len = std::min(kBlock8Elements, n - i);
      DequantizeBlock8(Block8SlotIsSigned(slot), codes.data() + i, len,
                       scales[(i / kBlock8Elements) * slots + slot],
                       values + i);
    }
    out->push_back(std::move(b));
  }
  return absl::OkStatus();
}

absl::Status Session::WriteBlock8Slot(const std::vector<float>& values,
                                      int slot, TensorEntry* t) {
  const uint64_t n = t->numel;
  const int slots = t->layout.state_slots;
  std::vector<float> scales(Block8Blocks(n) * slots);
  OPTIMD_RETURN_IF_ERROR(backend_->CopyToHost(
      t->scales.data(), reinterpret_cast<uint8_t*>(scales.data()),
      scales.size() * 4));
  std::vector<uint8_t> codes(n);
  for (uint64_t i = 0; i < n; i += kBlock8Elements) {
    const uint64_t len = std::min(kBlock8Elements, n - i);
    scales[(i / kBlock8Elements) * slots + slot] = QuantizeBlock8(
        Block8SlotIsSigned(slot), values.data() + i, len, codes.data() + i);
  }
  OPTIMD_RETURN_IF_ERROR(
      backend_->CopyFromHost(codes.data(), t->state[slot].data(), n));
  return backend_->CopyFromHost(reinterpret_cast<const uint8_t*>(scales.data()),
                                t->scales.data(), scales.size() * 4);
}

absl::StatusOr<std::vector<GroupState>> Session::ReadState(
    const std::vector<std::string>& group_ids, bool with_data,
    const std::vector<std::string>& tensors, uint64_t max_bytes) {
  MutexLock lock(&mu_);
  OPTIMD_ASSIGN_OR_RETURN(std::vector<Group*> targets, Targets(group_ids));
  OPTIMD_RETURN_IF_ERROR(backend_->CheckMappings(mappings_));
  OPTIMD_RETURN_IF_ERROR(backend_->SyncGroupCounters(targets));
  const std::set<std::string> wanted(tensors.begin(), tensors.end());
  for (const std::string& name : wanted) {
    if (tensor_names_.count(name) == 0) {
      return absl::NotFoundError(absl::StrCat(
          "tensor '", name, "' is not registered in this session"));
    }
  }
  auto selected = [&](const TensorEntry& t) {
    return with_data && (wanted.empty() || wanted.count(t.name) > 0);
  };
  uint64_t bytes = 0;
  for (const Group* g : targets) {
    for (const TensorEntry& t : g->tensors) {
      // Data, plus each of its up to four blobs' name and framing.
      if (selected(t)) {
        bytes += t.numel * DTypeSize(MasterBlobDType(t.layout)) +
                 t.StateBytes() + 4 * (t.name.size() + 64);
      }
    }
  }
  if (bytes > max_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the requested state is ", bytes, " bytes, more than ", max_bytes,
        " fit in one reply (counting names); ask for fewer tensors "
        "(tensor_names) or use SaveState"));
  }
  std::vector<GroupState> out;
  for (Group* g : targets) {
    GroupState gs;
    gs.id = g->id;
    gs.step = g->step;
    gs.hyper = g->hyper;
    for (const TensorEntry& t : g->tensors) {
      if (!selected(t)) continue;
      const size_t first_blob = gs.tensors.size();
      OPTIMD_RETURN_IF_ERROR(ReadTensorState(t, &gs.tensors));
      for (size_t b = first_blob; b < gs.tensors.size(); ++b) {
        gs.tensors[b].step = g->step - t.missed_steps;
      }
    }
    out.push_back(std::move(gs));
  }
  return out;
}

absl::StatusOr<std::vector<std::pair<const StateBlob*, TensorEntry*>>>
Session::CheckStateBlobs(Group* g, const std::vector<StateBlob>& blobs) {
  std::vector<std::pair<const StateBlob*, TensorEntry*>> work;
  std::set<std::pair<std::string, std::string>> seen;
  for (const StateBlob& b : blobs) {
    const size_t index = g->FindTensor(b.tensor);
    TensorEntry* t = index < g->tensors.size() ? &g->tensors[index] : nullptr;
    if (t == nullptr) return g->TensorNotFound(b.tensor);
    const int slot =
        StateSlotIndex(t->layout.optimizer, kMaxStateSlots, b.kind);
    if (slot < 0 && b.kind != "master") {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor '", b.tensor, "': unknown state kind '", b.kind,
                       "' (", OptimizerName(t->layout.optimizer), " keeps ",
                       SlotNames(t->layout), "master)"));
    }
    if (slot >= 0 && t->frozen) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor '", b.tensor, "' is frozen and holds no ", b.kind));
    }
    if (slot >= t->layout.state_slots) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor '", b.tensor, "' holds no ", b.kind, " (",
                       b.kind == "max_exp_avg_sq" ? "it needs amsgrad=true"
                                                  : "it needs momentum > 0",
                       ")"));
    }
    if (b.dtype == DType::kBlock8 || IsFp8(b.dtype)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor '", b.tensor, "' ", b.kind,
          ": state is set from float32, bfloat16, float16 or float64 "
          "values, not ",
          DTypeName(b.dtype), " codes (the daemon quantizes what needs it)"));
    }
    if (b.numel != t->numel) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor '", b.tensor, "' ", b.kind, ": ", b.numel,
                       " elements given, the tensor has ", t->numel));
    }
    if (b.data.size() != b.numel * DTypeSize(b.dtype)) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor '", b.tensor, "' ", b.kind, ": ", b.data.size(),
                       " bytes of data for ", b.numel, " ", DTypeName(b.dtype),
                       " elements"));
    }
    if (!seen.insert({b.tensor, b.kind}).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor '", b.tensor, "' ", b.kind, " is given twice"));
    }
    work.emplace_back(&b, t);
  }
  return work;
}

absl::Status Session::WriteStateBlob(const StateBlob& b, TensorEntry* t) {
  const uint64_t n = t->numel;
  if (n == 0) return absl::OkStatus();
  std::vector<double> values(n);
  ToDouble(b.dtype, b.data.data(), n, values.data());
  auto put = [&](DType d, uint8_t* dst) -> absl::Status {
    std::string bytes(n * DTypeSize(d), '\0');
    FromDouble(d, values.data(), n, bytes.data());
    return backend_->CopyFromHost(
        reinterpret_cast<const uint8_t*>(bytes.data()), dst, bytes.size());
  };
  const int slot =
      StateSlotIndex(t->layout.optimizer, t->layout.state_slots, b.kind);
  if (slot >= 0 && t->layout.block8()) {
    OPTIMD_RETURN_IF_ERROR(WriteBlock8Slot(
        std::vector<float>(values.begin(), values.end()), slot, t));
  } else if (slot >= 0) {
    OPTIMD_RETURN_IF_ERROR(put(t->layout.moment_dtype, t->state[slot].data()));
  } else if (t->layout.master == MasterKind::kRemainder) {
    std::vector<uint16_t> hi(n);
    std::vector<int16_t> rem(n);
    for (uint64_t i = 0; i < n; ++i) {
      SplitToRemainder(static_cast<float>(values[i]), &hi[i], &rem[i]);
    }
    OPTIMD_RETURN_IF_ERROR(backend_->CopyFromHost(
        reinterpret_cast<const uint8_t*>(hi.data()), t->param.data, n * 2));
    OPTIMD_RETURN_IF_ERROR(backend_->CopyFromHost(
        reinterpret_cast<const uint8_t*>(rem.data()), t->master.data(), n * 2));
  } else if (t->layout.fp8_recipe != Fp8Recipe::kNone) {
    OPTIMD_RETURN_IF_ERROR(put(DType::kFloat32, t->master.data()));
    OPTIMD_RETURN_IF_ERROR(
        WriteFp8Param(std::vector<float>(values.begin(), values.end()), *t));
  } else {
    if (t->layout.master == MasterKind::kFp32) {
      OPTIMD_RETURN_IF_ERROR(put(DType::kFloat32, t->master.data()));
    }
    OPTIMD_RETURN_IF_ERROR(put(t->layout.param_dtype, t->param.data));
  }
  return absl::OkStatus();
}

absl::Status Session::WriteFp8Param(const std::vector<float>& master,
                                    const TensorEntry& t) {
  TensorPointers p = t.Pointers();
  std::vector<uint8_t> param(t.numel);
  std::vector<uint8_t> scale_inv(p.fp8.ScaleBytes());
  p.master = const_cast<float*>(master.data());
  p.param = param.data();
  p.scale_inv = scale_inv.data();
  QuantizeFp8Range(t.layout.param_dtype, p, 0, t.numel);
  OPTIMD_RETURN_IF_ERROR(
      backend_->CopyFromHost(param.data(), t.param.data, param.size()));
  return backend_->CopyFromHost(scale_inv.data(), t.scale_inv.data,
                                scale_inv.size());
}

absl::Status Session::WriteState(
    const std::string& group_id, uint64_t step,
    const std::vector<StateBlob>& blobs,
    const std::vector<std::pair<std::string, uint64_t>>& tensor_steps) {
  MutexLock lock(&mu_);
  Group* g = FindGroup(group_id);
  if (g == nullptr) {
    return absl::NotFoundError(absl::StrCat(
        "group '", group_id, "' is not registered in this session"));
  }
  if (step > kMaxStepCounter) {
    return absl::InvalidArgumentError(absl::StrCat(
        "step ", step, " is past the largest step counter ", kMaxStepCounter));
  }
  // Check everything first.
  OPTIMD_ASSIGN_OR_RETURN(std::vector<uint64_t> missed,
                          MissedSteps(*g, step, tensor_steps));
  OPTIMD_ASSIGN_OR_RETURN(auto work, CheckStateBlobs(g, blobs));
  OPTIMD_RETURN_IF_ERROR(backend_->CheckMappings(mappings_));
  for (const auto& [b, t] : work) {
    OPTIMD_RETURN_IF_ERROR(WriteStateBlob(*b, t));
  }
  for (size_t i = 0; i < g->tensors.size(); ++i) {
    g->tensors[i].missed_steps = missed[i];
  }
  return backend_->SetGroupStep(*g, step);
}

absl::StatusOr<std::vector<uint64_t>> Session::MissedSteps(
    const Group& g, uint64_t step,
    const std::vector<std::pair<std::string, uint64_t>>& tensor_steps) {
  std::vector<uint64_t> missed(g.tensors.size(), 0);
  std::vector<bool> seen(g.tensors.size(), false);
  for (const auto& [name, own] : tensor_steps) {
    const size_t found = g.FindTensor(name);
    if (found == g.tensors.size()) {
      return g.TensorNotFound(name, "tensor_steps: ");
    }
    if (seen[found]) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor_steps: tensor '", name, "' is given twice"));
    }
    seen[found] = true;
    if (own > step) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor_steps: tensor '", name, "' has step ", own,
                       ", more than its group's step ", step));
    }
    missed[found] = step - own;
  }
  return missed;
}

const SessionIdentity& LockedSession::identity() const {
  return session_->identity_;
}

Backend* LockedSession::backend() const { return session_->backend_; }

const std::vector<Group*>& LockedSession::groups() const {
  session_->mu_.AssertHeld();
  return session_->step_groups_;
}

absl::Status LockedSession::SyncFromBackend() {
  Session& s = *session_;
  s.mu_.AssertHeld();
  OPTIMD_RETURN_IF_ERROR(s.backend_->CheckMappings(s.mappings_));
  return s.backend_->SyncGroupCounters(s.step_groups_);
}

bool LockedSession::state_mixed() const {
  session_->mu_.AssertHeld();
  return session_->needs_load_;
}

void LockedSession::set_state_mixed(bool mixed) {
  session_->mu_.AssertHeld();
  session_->needs_load_ = mixed;
}

absl::StatusOr<SnapshotReservation> LockedSession::ReserveSnapshot() {
  Session& s = *session_;
  s.mu_.AssertHeld();
  if (s.live_snapshots_->load() >= kMaxLiveSnapshots) {
    return absl::ResourceExhaustedError(absl::StrCat(
        kMaxLiveSnapshots, " snapshots of this session's state are still ",
        "held (SaveStateStream streams not read to the end, or a background ",
        "save writing); finish or cancel them first"));
  }
  // A snapshot holds the parameters and the state, in host memory, and
  // a header of every tensor's names and shapes, which takes up to about
  // as much again as their metadata while it is built.
  const uint64_t bytes = s.param_bytes_ + s.state_bytes_;
  const std::string what =
      "a snapshot of the session's state (SaveStateStream or a background "
      "save)";
  OPTIMD_RETURN_IF_ERROR(s.budget_->Reserve(bytes, s.metadata_bytes_, what));
  s.live_snapshots_->fetch_add(1);
  return SnapshotReservation(s.budget_, bytes, s.metadata_bytes_,
                             s.live_snapshots_);
}

}  // namespace optimd
