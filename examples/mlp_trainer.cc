// A small trainer that trains through optimd on the CPU backend.
//
// A two-layer MLP (tanh) regresses a smooth function of 8 inputs on
// generated data, full batch. Forward and backward are written by hand; the
// parameters and gradients live in shared memory that the daemon maps, and
// every step is one Step call: the daemon updates the parameters in place.
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "client/shm_tensor.h"
#include "common/default_address.h"

ABSL_FLAG(std::string, target, "", "Daemon address (default socket if empty).");
ABSL_FLAG(int, steps, 300, "Training steps.");
ABSL_FLAG(double, lr, 1e-2, "AdamW learning rate.");
ABSL_FLAG(int, seed, 1, "Seed for data and initial weights.");
ABSL_FLAG(std::string, job_id, "mlp-demo", "Job id of the session.");

namespace {

constexpr int kIn = 8, kHidden = 64, kSamples = 512;

struct Layout {
  // Element offsets of each tensor in the flat fp32 buffers.
  size_t w1 = 0, b1 = kHidden * kIn, w2 = b1 + kHidden, b2 = w2 + kHidden;
  size_t total = b2 + 1;
};

int Fail(const absl::Status& s) {
  std::fprintf(stderr, "mlp_trainer: %s\n", s.ToString().c_str());
  return 1;
}

// The data set: y = sin(a.x) + 0.5 cos(b.x), x ~ U(-1, 1)^8.
struct Data {
  std::vector<float> x, y;
};

Data MakeData(std::mt19937& rng) {
  std::uniform_real_distribution<float> unif(-1.f, 1.f);
  std::vector<float> a(kIn), b(kIn);
  Data d{std::vector<float>(kSamples * kIn), std::vector<float>(kSamples)};
  for (int i = 0; i < kIn; ++i) {
    a[i] = unif(rng);
    b[i] = 1.5f * unif(rng);
  }
  for (int n = 0; n < kSamples; ++n) {
    float da = 0, db = 0;
    for (int i = 0; i < kIn; ++i) {
      d.x[n * kIn + i] = unif(rng);
      da += a[i] * d.x[n * kIn + i];
      db += b[i] * d.x[n * kIn + i];
    }
    d.y[n] = std::sin(da) + 0.5f * std::cos(db);
  }
  return d;
}

// The group of the MLP's four tensors over the flat buffers, for AdamW.
optimd::v1::RegisterGroupRequest MlpGroup(
    const Layout& L, const optimd::SharedMemoryRegion& params,
    const optimd::SharedMemoryRegion& grads) {
  optimd::v1::RegisterGroupRequest rg;
  rg.set_group_id("mlp");
  auto* h = rg.mutable_hyperparameters();
  h->set_lr(absl::GetFlag(FLAGS_lr));
  h->set_beta1(0.9);
  h->set_beta2(0.999);
  h->set_eps(1e-8);
  h->set_weight_decay(1e-4);
  struct Named {
    const char* name;
    size_t begin, end;
  };
  for (const Named& t :
       {Named{"fc1.weight", L.w1, L.b1}, Named{"fc1.bias", L.b1, L.w2},
        Named{"fc2.weight", L.w2, L.b2}, Named{"fc2.bias", L.b2, L.total}}) {
    auto* spec = rg.add_tensors();
    spec->set_name(t.name);
    spec->set_numel(t.end - t.begin);
    spec->set_param_dtype(optimd::v1::DTYPE_FLOAT32);
    spec->set_grad_dtype(optimd::v1::DTYPE_FLOAT32);
    const uint64_t off = t.begin * sizeof(float);
    const uint64_t bytes = (t.end - t.begin) * sizeof(float);
    *spec->mutable_param() = params.Handle(off, bytes);
    *spec->mutable_grad() = grads.Handle(off, bytes);
  }
  return rg;
}

// Forward and backward over the full batch (mean squared error): writes
// the gradients into g and returns the loss.
double ForwardBackward(const Layout& L, const Data& d, const float* p,
                       float* g) {
  std::vector<float> hid(kHidden);
  std::fill(g, g + L.total, 0.f);
  double loss = 0;
  for (int n = 0; n < kSamples; ++n) {
    const float* xn = &d.x[n * kIn];
    float out = p[L.b2];
    for (int j = 0; j < kHidden; ++j) {
      float z = p[L.b1 + j];
      for (int i = 0; i < kIn; ++i) z += p[L.w1 + j * kIn + i] * xn[i];
      hid[j] = std::tanh(z);
      out += p[L.w2 + j] * hid[j];
    }
    const float err = out - d.y[n];
    loss += double(err) * err;
    const float dout = 2.f * err / kSamples;
    g[L.b2] += dout;
    for (int j = 0; j < kHidden; ++j) {
      g[L.w2 + j] += dout * hid[j];
      const float dz = dout * p[L.w2 + j] * (1.f - hid[j] * hid[j]);
      g[L.b1 + j] += dz;
      for (int i = 0; i < kIn; ++i) g[L.w1 + j * kIn + i] += dz * xn[i];
    }
  }
  return loss / kSamples;
}

void Progress(int step, int steps, double loss,
              const optimd::v1::StepResponse& reply) {
  if (step != 1 && step % 25 != 0 && step != steps) return;
  const int width = 30, done = width * step / steps;
  std::printf("[%s%s] step %4d/%d  loss %.6f  grad_norm %.4f%s\n",
              std::string(done, '#').c_str(),
              std::string(width - done, '.').c_str(), step, steps, loss,
              reply.grad_norm(), reply.skipped() ? "  (skipped)" : "");
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  std::string target = absl::GetFlag(FLAGS_target);
  if (target.empty()) target = optimd::DefaultAddress();
  const int steps = absl::GetFlag(FLAGS_steps);
  const int seed = absl::GetFlag(FLAGS_seed);
  std::printf("mlp_trainer: seed %d, %d steps, daemon %s\n", seed, steps,
              target.c_str());
  std::mt19937 rng(seed);
  const Data data = MakeData(rng);

  const Layout L;
  auto params = optimd::SharedMemoryRegion::Create(L.total * sizeof(float));
  auto grads = optimd::SharedMemoryRegion::Create(L.total * sizeof(float));
  if (!params.ok()) return Fail(params.status());
  if (!grads.ok()) return Fail(grads.status());
  float* p = (*params)->as<float>();
  float* g = (*grads)->as<float>();
  std::normal_distribution<float> normal(0.f, 1.f);
  for (size_t i = L.w1; i < L.b1; ++i)
    p[i] = normal(rng) / std::sqrt(float(kIn));
  for (size_t i = L.w2; i < L.b2; ++i)
    p[i] = normal(rng) / std::sqrt(float(kHidden));

  auto client = optimd::Client::Create(target);
  if (!client.ok()) return Fail(client.status());
  optimd::v1::CreateSessionRequest cs;
  cs.set_job_id(absl::GetFlag(FLAGS_job_id));
  cs.set_world_size(1);
  cs.set_device(-1);
  auto session = (*client)->CreateSession(cs);
  if (!session.ok()) return Fail(session.status());
  auto reg = (*client)->RegisterGroup(MlpGroup(L, **params, **grads));
  if (!reg.ok()) return Fail(reg.status());
  std::printf(
      "mlp_trainer: registered %zu parameters (%llu bytes of "
      "optimizer state in the daemon)\n",
      L.total, static_cast<unsigned long long>(reg->state_bytes()));

  double first_loss = 0, loss = 0;
  for (int step = 1; step <= steps; ++step) {
    loss = ForwardBackward(L, data, p, g);
    if (step == 1) first_loss = loss;
    optimd::v1::StepRequest sr;
    sr.set_step(step);
    // Steps go over the session's StepStream (half the round trip of a
    // unary call).
    auto reply = (*client)->StreamStep(sr);
    if (!reply.ok()) return Fail(reply.status());
    Progress(step, steps, loss, *reply);
  }
  (void)(*client)->CloseSession();
  const double ratio = first_loss / loss;
  std::printf("mlp_trainer: loss %.6f -> %.6f (%.1fx lower)\n", first_loss,
              loss, ratio);
  if (ratio < 10) {
    std::printf("mlp_trainer: FAILED: loss fell less than 10x\n");
    return 1;
  }
  return 0;
}
