#include "server/request_fuzz.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <tuple>

#include "absl/strings/str_format.h"
#include "absl/strings/str_replace.h"
#include "backends/cpu/cpu_backend.h"
#include "core/session.h"
#include "google/protobuf/stubs/logging.h"
#include "server/convert.h"
#include "server/request_scan.h"

namespace optimd {
namespace {

// Scans `bytes` as the daemon does before parsing (request_scan.h), then
// parses them into *r. The scan and the parser must agree: bytes the scan
// takes parse, bytes that parse are taken unless over a cap, and the
// scan's estimate covers what protobuf reports of the parsed message;
// anything else is a finding (abort).
template <typename Request>
absl::Status ScanAndParse(const std::string& bytes, Request* r) {
  grpc::Slice slice(bytes);
  const grpc::ByteBuffer buffer(&slice, 1);
  auto scan = ScanRequest(buffer, *Request::descriptor());
  const bool parsed = r->ParseFromString(bytes);
  if (scan.ok() != parsed &&
      !(parsed &&
        scan.status().code() == absl::StatusCode::kResourceExhausted)) {
    std::fprintf(stderr, "scan %s, parse %s\n",
                 scan.status().ToString().c_str(), parsed ? "ok" : "failed");
    std::abort();
  }
  if (scan.ok() && scan->parsed_bytes < r->SpaceUsedLong()) {
    std::fprintf(stderr, "estimate %llu below SpaceUsedLong %zu\n",
                 static_cast<unsigned long long>(scan->parsed_bytes),
                 r->SpaceUsedLong());
    std::abort();
  }
  return scan.ok() ? absl::OkStatus() : scan.status();
}

// Seeds and inputs name two segments by fixed names; each fuzzing process
// makes its own under names of the same length (its pid in them) and reads
// inputs with the fixed names replaced, so that processes running at once
// (a fuzzer beside the corpus test) neither share nor unlink each other's.
constexpr char kParams[] = "/optimd-fuzz-params";
constexpr char kGrads[] = "/optimd-fuzz-grads";
constexpr uint64_t kSegmentBytes = 4096;

// This process's name for the segment seeds call `fixed` (same length).
const std::string& LocalName(const char* fixed) {
  static const std::string params =
      absl::StrFormat("/ofuz%07d-params", getpid() % 10000000);
  static const std::string grads =
      absl::StrFormat("/ofuz%07d-grads", getpid() % 10000000);
  static_assert(sizeof(kParams) == sizeof("/ofuz0000000-params"));
  static_assert(sizeof(kGrads) == sizeof("/ofuz0000000-grads"));
  return std::string(fixed) == kParams ? params : grads;
}

// `bytes` with the fixed segment names replaced by this process's.
std::string Localized(std::string bytes) {
  return absl::StrReplaceAll(
      bytes, {{kParams, LocalName(kParams)}, {kGrads, LocalName(kGrads)}});
}

void MakeSegment(const std::string& name) {
  const int fd = shm_open(name.c_str(), O_RDWR | O_CREAT, 0600);
  if (fd < 0 || ftruncate(fd, kSegmentBytes) != 0) std::abort();
  close(fd);
}

v1::BufferHandle Handle(const char* segment, uint64_t offset, uint64_t size) {
  v1::BufferHandle h;
  h.mutable_shared_memory()->set_segment_name(segment);
  h.mutable_shared_memory()->set_offset(offset);
  h.mutable_shared_memory()->set_size(size);
  return h;
}

v1::RegisterGroupRequest BaseGroup(const std::string& id, uint64_t offset) {
  v1::RegisterGroupRequest r;
  r.set_group_id(id);
  r.mutable_hyperparameters()->set_lr(1e-3);
  for (int i = 0; i < 2; ++i) {
    auto* t = r.add_tensors();
    t->set_name(id + (i == 0 ? ".w" : ".h"));
    t->set_numel(16);
    const v1::DType d = i == 0 ? v1::DTYPE_FLOAT32 : v1::DTYPE_BFLOAT16;
    t->set_param_dtype(d);
    t->set_grad_dtype(d);
    const uint64_t at = offset + 128 * i;
    *t->mutable_param() = Handle(kParams, at, i == 0 ? 64 : 32);
    *t->mutable_grad() = Handle(kGrads, at, i == 0 ? 64 : 32);
  }
  return r;
}

// BaseGroup with another optimizer.
v1::RegisterGroupRequest OptimizerGroup(const std::string& id, uint64_t offset,
                                        v1::OptimizerKind kind) {
  v1::RegisterGroupRequest r = BaseGroup(id, offset);
  r.mutable_hyperparameters()->set_optimizer(kind);
  r.mutable_hyperparameters()->set_momentum(0.9);
  r.mutable_hyperparameters()->set_nesterov(kind == v1::OPTIMIZER_KIND_SGD);
  r.mutable_hyperparameters()->set_beta1(0.9);
  r.mutable_hyperparameters()->set_beta2(0.99);
  return r;
}

CpuBackend& FuzzBackend() {
  static CpuBackend* backend = [] {
    // Parse errors of mutated inputs are expected; do not log each one.
    google::protobuf::SetLogHandler(nullptr);
    MakeSegment(LocalName(kParams));
    MakeSegment(LocalName(kGrads));
    std::atexit([] {
      shm_unlink(LocalName(kParams).c_str());
      shm_unlink(LocalName(kGrads).c_str());
    });
    return new CpuBackend(CpuBackend::Options{1, 1024});
  }();
  return *backend;
}

absl::Status Apply(Session& s, char kind, const std::string& bytes) {
  switch (kind % 5) {
    case 0: {
      v1::RegisterGroupRequest r;
      if (absl::Status p = ScanAndParse(bytes, &r); !p.ok()) return p;
      auto spec = GroupSpecFromProto(r);
      if (!spec.ok()) return spec.status();
      return s.RegisterGroup(*spec).status();
    }
    case 1: {
      v1::UpdateBuffersRequest r;
      if (absl::Status p = ScanAndParse(bytes, &r); !p.ok()) return p;
      auto updates = BufferUpdatesFromProto(r);
      if (!updates.ok()) return updates.status();
      return s.UpdateBuffers(r.group_id(), *updates, r.memory_released());
    }
    case 2: {
      v1::StepRequest r;
      if (absl::Status p = ScanAndParse(bytes, &r); !p.ok()) return p;
      auto spec = StepSpecFromProto(r);
      if (!spec.ok()) return spec.status();
      spec->refused = CheckStepOptions(r);  // as the service does
      return s.Step(*spec).status();
    }
    case 3: {
      v1::SetStateRequest r;
      if (absl::Status p = ScanAndParse(bytes, &r); !p.ok()) return p;
      auto blobs = StateBlobsFromProto(r);
      if (!blobs.ok()) return blobs.status();
      return s.WriteState(r.group_id(), r.step(), *blobs);
    }
    default: {
      v1::GetStateRequest r;
      if (absl::Status p = ScanAndParse(bytes, &r); !p.ok()) return p;
      std::vector<std::string> ids(r.group_ids().begin(), r.group_ids().end());
      std::vector<std::string> names(r.tensor_names().begin(),
                                     r.tensor_names().end());
      return s.ReadState(ids, !r.metadata_only(), names, 1 << 20).status();
    }
  }
}

// A harness group under this process's segment names.
v1::RegisterGroupRequest LocalGroup(const v1::RegisterGroupRequest& r) {
  v1::RegisterGroupRequest local;
  if (!local.ParseFromString(Localized(r.SerializeAsString()))) std::abort();
  return local;
}

// The harness's own groups must register in every fresh session: a
// failure is a finding (state leaking between inputs), reported with its
// status before the abort that libFuzzer records.
void RegisterOrDie(Session& s, absl::StatusOr<GroupSpec> spec) {
  absl::Status st = spec.ok() ? s.RegisterGroup(*spec).status() : spec.status();
  if (!st.ok()) {
    std::fprintf(stderr,
                 "request_fuzz: the harness's group did not register: %s\n",
                 st.ToString().c_str());
    std::abort();
  }
}

}  // namespace

absl::Status ApplyFuzzRequest(const uint8_t* data, size_t size) {
  if (size == 0) return absl::InvalidArgumentError("empty input");
  CpuBackend& backend = FuzzBackend();
  StateBudget budget(uint64_t{1} << 30);
  std::string done;
  Session s(SessionIdentity{"fuzz", 0, 1, -1}, &backend, &budget,
            *backend.OpenSession(-1, "", &done));
  // An AdamW group "g" and an SGD group "s" (momentum, nesterov).
  RegisterOrDie(s, GroupSpecFromProto(LocalGroup(BaseGroup("g", 0))));
  RegisterOrDie(s, GroupSpecFromProto(LocalGroup(
                       OptimizerGroup("s", 512, v1::OPTIMIZER_KIND_SGD))));
  const absl::Status status =
      Apply(s, static_cast<char>(data[0]),
            Localized(std::string(reinterpret_cast<const char*>(data) + 1,
                                  size - 1)));
  // Whatever the request did, the session still steps or refuses cleanly.
  (void)s.Step(StepRequestSpec());
  return status;
}

absl::Status WriteRequestSeeds(const std::string& dir) {
  v1::UpdateBuffersRequest update;
  update.set_group_id("g");
  auto* tb = update.add_tensors();
  tb->set_name("g.w");
  *tb->mutable_grad() = Handle(kGrads, 1024, 64);
  v1::StepRequest step;
  step.set_grad_scale(1024);
  step.set_max_grad_norm(1.0);
  auto* o = step.add_overrides();
  o->set_group_id("g");
  o->set_beta1(0.8);
  *step.add_buffer_updates() = update;
  v1::SetStateRequest set;
  set.set_group_id("g");
  set.set_step(7);
  auto* st = set.add_tensors();
  st->set_tensor("g.w");
  st->set_kind("exp_avg");
  st->set_dtype(v1::DTYPE_FLOAT32);
  st->set_numel(16);
  st->set_data(std::string(64, '\0'));
  v1::GetStateRequest get;
  get.add_tensor_names("g.h");
  v1::StepRequest momentum;
  auto* mo = momentum.add_overrides();
  mo->set_group_id("s");
  mo->set_momentum(0.8);
  v1::StepRequest momentum_off = momentum;
  momentum_off.mutable_overrides(0)->set_momentum(0);
  // Writes into bf16 parameters (fp32 masters), carried by a step: one
  // beside a new gradient, one alone, in the two groups.
  v1::StepRequest written = step;
  written.mutable_buffer_updates(0)->mutable_tensors(0)->set_name("g.h");
  written.mutable_buffer_updates(0)->mutable_tensors(0)->set_param_written(
      true);
  *written.mutable_buffer_updates(0)->mutable_tensors(0)->mutable_grad() =
      Handle(kGrads, 1024, 32);
  auto* alone = written.add_buffer_updates();
  alone->set_group_id("s");
  auto* sw = alone->add_tensors();
  sw->set_name("s.h");
  sw->set_param_written(true);
  v1::SetStateRequest buffer = set;
  buffer.set_group_id("s");
  buffer.mutable_tensors(0)->set_tensor("s.w");
  buffer.mutable_tensors(0)->set_kind("momentum_buffer");
  const std::pair<const char*, std::string> seeds[] = {
      {"valid-register", BaseGroup("n", 2048).SerializeAsString()},
      {"valid-update", update.SerializeAsString()},
      {"valid-step", step.SerializeAsString()},
      {"valid-setstate", set.SerializeAsString()},
      {"valid-getstate", get.SerializeAsString()}};
  char kind = 0;
  for (const auto& [name, bytes] : seeds) {
    std::ofstream out(dir + "/" + name, std::ios::binary);
    out << kind++ << bytes;
    if (!out) return absl::InternalError(dir + "/" + name);
  }
  // SGD and Lion: (kind, name, request).
  const std::tuple<char, const char*, std::string> more[] = {
      {0, "valid-register-lion",
       OptimizerGroup("l", 3072, v1::OPTIMIZER_KIND_LION).SerializeAsString()},
      {2, "valid-step-momentum", momentum.SerializeAsString()},
      {2, "valid-step-written", written.SerializeAsString()},
      {2, "step-momentum-off", momentum_off.SerializeAsString()},
      {3, "valid-setstate-momentum-buffer", buffer.SerializeAsString()}};
  for (const auto& [k, name, bytes] : more) {
    std::ofstream out(dir + "/" + name, std::ios::binary);
    out << k << bytes;
    if (!out) return absl::InternalError(dir + "/" + name);
  }
  return absl::OkStatus();
}

}  // namespace optimd

// libFuzzer's entry point (tools/fuzz.sh).
extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  (void)optimd::ApplyFuzzRequest(data, size);
  return 0;
}
