"""Checkpoints written and read by the daemon: bit-exact resume across a
daemon restart for every layout, the file format, and bad checkpoints."""
import json
import os
import random
import shutil
import struct
import subprocess
import tempfile
import unittest

import torch

import optimd
from optimd.testing import Daemon
from optimd.torch import AdamW

SEED = int(os.environ.get("OPTIMD_TEST_SEED", random.randrange(1 << 30)))
print("seed", SEED)
# The resume secrets of these tests' sessions stay in their own scratch.
os.environ.setdefault("OPTIMD_SECRETS_DIR",
                      tempfile.mkdtemp(prefix="optimd-secrets-"))
# OPTIMD_TEST_DEVICE=cuda runs the resume test on the CUDA backend (GPU
# machine); the default is the CPU backend.
DEVICE = os.environ.get("OPTIMD_TEST_DEVICE", "cpu")
BACKEND = "cuda" if DEVICE.startswith("cuda") else "cpu"

SHAPES = [(31, 7), (1,), (0,), (4099,)]

LAYOUTS = {
    "fp32": dict(dtype=torch.float32),
    "fp32_master": dict(dtype=torch.float32, master_weights=True),
    "bf16_master": dict(dtype=torch.bfloat16),
    "bf16_remainder": dict(dtype=torch.bfloat16, store_param_remainders=True),
    "fp16_master": dict(dtype=torch.float16),
    "fp64": dict(dtype=torch.float64, amsgrad=True),
    "bf16_moments_amsgrad_adam": dict(dtype=torch.float32,
                                      exp_avg_dtype=torch.bfloat16,
                                      amsgrad=True, adam_w_mode=False,
                                      weight_decay=0.01),
    "block8_moments_bf16_remainder": dict(dtype=torch.bfloat16,
                                          store_param_remainders=True,
                                          exp_avg_dtype=optimd.torch.BLOCK8),
}


def _as_grad(p, g):
    """A fresh gradient for `p` holding `g`, as autograd would set it."""
    return g.detach().to(device=p.device, dtype=p.dtype).reshape(
        p.shape).clone()


def read_safetensors(path):
    """An independent reader of the safetensors format."""
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    body = data[8 + n:]
    dtypes = {"F32": torch.float32, "BF16": torch.bfloat16,
              "F16": torch.float16, "F64": torch.float64, "I16": torch.int16,
              "U8": torch.uint8}
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        if b == a:
            tensors[name] = torch.empty(0, dtype=dtypes[info["dtype"]])
        else:
            tensors[name] = torch.frombuffer(bytearray(body[a:b]),
                                             dtype=dtypes[info["dtype"]])
    return header, tensors


def _crc32c(data):
    crc = 0xFFFFFFFF
    for b in data:
        crc ^= b
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def _rebuilt(good, edit):
    """The checkpoint bytes `good` with edit(metadata) applied to its optimd
    metadata, whose checksum is made to match."""
    (n,) = struct.unpack("<Q", good[:8])
    header = json.loads(good[8:8 + n])
    meta = json.loads(header["__metadata__"]["optimd"])
    edit(meta)
    text = json.dumps(meta, separators=(",", ":"))
    header["__metadata__"]["optimd"] = text
    header["__metadata__"]["optimd_crc32c"] = "%08x" % _crc32c(text.encode())
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - (8 + len(h)) % 8) % 8)
    return struct.pack("<Q", len(h)) + h + good[8 + n:]


def spool_files(daemon):
    """The LoadStateStream spool files of `daemon` in /tmp (its spool
    directory without --state_dir), named by its pid: other daemons on the
    machine (tests run side by side) have spool files of their own there
    that come and go, which are not this test's to judge."""
    prefix = ".optimd-load-%d-" % daemon.process.pid
    return [f for f in os.listdir("/tmp") if f.startswith(prefix)]


class CheckpointTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="optimd-ckpt-")

    def tearDown(self):
        shutil.rmtree(self.dir, ignore_errors=True)

    def grads(self, step, shapes, dtype):
        g = torch.Generator().manual_seed(SEED * 1000 + step)
        return [torch.randn(*s, generator=g).to(dtype) for s in shapes]

    def run_steps(self, opt, params, first, last, dtype):
        """Steps with fresh gradients; some tensors have none at some steps
        (so their own step counts, which checkpoints keep, differ)."""
        for step in range(first, last):
            grads = self.grads(step, SHAPES, dtype)
            for i, (p, g) in enumerate(zip(params, grads)):
                absent = i != 0 and (step + i) % 4 == 0
                p.grad = None if absent else _as_grad(p, g.to(p.device))
            opt.step()

    def make(self, daemon, init, layout, job):
        kw = dict(layout)
        dtype = kw.pop("dtype")
        params = [torch.nn.Parameter(t.clone().to(dtype).to(DEVICE))
                  for t in init]
        opt = AdamW(params, lr=1e-2, address=daemon.address, job_id=job, **kw)
        return params, opt, dtype

    def test_bit_exact_resume_across_daemon_restart(self):
        gen = torch.Generator().manual_seed(SEED)
        init = [torch.randn(*s, generator=gen) for s in SHAPES]
        n = 15
        for name, layout in LAYOUTS.items():
            with self.subTest(layout=name):
                # Run A: 2n steps without stopping.
                with Daemon(backend=BACKEND) as d:
                    pa, oa, dtype = self.make(d, init, layout, "a-" + name)
                    self.run_steps(oa, pa, 0, 2 * n, dtype)
                    state_a = {k: {kk: vv.cpu().clone() for kk, vv in v.items()}
                               for k, v in oa.state_dict()["state"].items()}
                    params_a = [p.detach().cpu().clone() for p in pa]
                # Run B: n steps, save, the daemon dies, a new one loads.
                d1 = Daemon(backend=BACKEND)
                pb, ob, dtype = self.make(d1, init, layout, "b-" + name)
                self.run_steps(ob, pb, 0, n, dtype)
                reply = ob.save_checkpoint(self.dir)
                self.assertTrue(reply.path.endswith(".safetensors"))
                d1.process.kill()  # no clean shutdown
                d1.stop()
                with Daemon(backend=BACKEND) as d2:
                    zeros = [torch.zeros(s) for s in SHAPES]
                    pc, oc, dtype = self.make(d2, zeros, layout, "b-" + name)
                    loaded = oc.load_checkpoint(self.dir)
                    # Loading needs at most one 64 MiB staging buffer (none
                    # on the CPU backend, which reads in place).
                    self.assertLessEqual(loaded.peak_staging_bytes, 64 << 20)
                    if BACKEND == "cpu":
                        self.assertEqual(loaded.peak_staging_bytes, 0)
                    self.run_steps(oc, pc, n, 2 * n, dtype)
                    for p, q in zip(pc, params_a):
                        self.assertTrue(torch.equal(p.detach().cpu(), q), name)
                    state_c = oc.state_dict()["state"]
                    self.assertEqual(sorted(state_c), sorted(state_a))
                    for k in state_a:
                        for kk in state_a[k]:
                            self.assertTrue(
                                torch.equal(state_c[k][kk].cpu(),
                                            state_a[k][kk]),
                                "%s %s %s" % (name, k, kk))

    def test_sessions_survive_a_daemon_restart(self):
        # Two trainers; the daemon is stopped (SIGTERM) and started again on
        # the same --save_dir; both resume bit-exactly, as if nothing had
        # happened; the saved files go once training went on.
        save_dir = os.path.join(self.dir, "saved")
        gen = torch.Generator().manual_seed(SEED)
        init = [torch.randn(*s, generator=gen) for s in SHAPES]
        layout = LAYOUTS["bf16_master"]
        with Daemon(backend=BACKEND) as d:
            ref = [self.make(d, init, layout, "ref-%d" % i) for i in range(2)]
            for params, opt, dtype in ref:
                self.run_steps(opt, params, 0, 12, dtype)
        flags = ["--save_dir=" + save_dir]
        d1 = Daemon(backend=BACKEND, flags=flags)
        runs = [self.make(d1, init, layout, "job-%d" % i) for i in range(2)]
        for params, opt, dtype in runs:
            self.run_steps(opt, params, 0, 6, dtype)
        self.assertEqual(d1.stop(), 0)  # SIGTERM: saves both sessions
        saved = sorted(os.listdir(save_dir))
        self.assertEqual(len(saved), 2)
        with Daemon(backend=BACKEND, flags=flags) as d2:
            # The saved state is guarded by its session's resume secret.
            with self.assertRaises(optimd.PermissionDeniedError):
                AdamW([torch.nn.Parameter(torch.zeros_like(p))
                       for p in runs[0][0]], lr=1e-2, address=d2.address,
                      job_id="job-0", resume=True, resume_secret="x" * 32)
            for i, ((params, _, dtype), (ref_params, ref_opt, _)) in \
                    enumerate(zip(runs, ref)):
                fresh = [torch.nn.Parameter(torch.zeros_like(p))
                         for p in params]
                opt = AdamW(fresh, lr=1e-2, address=d2.address,
                            job_id="job-%d" % i, resume=True)
                self.assertTrue(opt.resumed)
                self.run_steps(opt, fresh, 6, 12, dtype)
                for p, q in zip(fresh, ref_params):
                    self.assertTrue(torch.equal(p.detach(), q.detach()))
                opt.close()
            for name in saved:
                self.assertEqual(os.listdir(os.path.join(save_dir, name)), [])
            # Nothing to resume: an error by default, a fresh start on
            # request.
            q = torch.nn.Parameter(torch.randn(3))
            with self.assertRaises(optimd.NotFoundError):
                AdamW([q], address=d2.address, job_id="never", resume=True)
            opt = AdamW([q], address=d2.address, job_id="never",
                        resume="if_any")
            self.assertFalse(opt.resumed)
            opt.close()

    def test_checkpoint_found_by_rank_with_default_arguments(self):
        # save_checkpoint(dir) in one trainer and load_checkpoint(dir) in a
        # new one (its own default job id) meet at rank-0.safetensors; the
        # file's mode follows the daemon's umask.
        init = torch.randn(50)
        with Daemon() as d:
            p = torch.nn.Parameter(init.clone())
            opt = AdamW([p], lr=1e-2, address=d.address)
            p.grad = torch.randn(50)
            opt.step()
            path = opt.save_checkpoint(self.dir).path
            self.assertEqual(os.path.basename(path), "rank-0.safetensors")
            umask = os.umask(0)
            os.umask(umask)
            self.assertEqual(os.stat(path).st_mode & 0o777, 0o666 & ~umask)
            saved = p.detach().clone()
            opt.close()
            q = torch.nn.Parameter(init.clone())
            other = AdamW([q], lr=1e-2, address=d.address)
            other.load_checkpoint(self.dir)
            self.assertTrue(torch.equal(q.detach(), saved))
            self.assertEqual(float(other.state[q]["step"]), 1.0)
            other.close()

    def test_shards_of_every_rank_merge_into_whole_tensors(self):
        # Two ranks hold halves of each parameter (as FSDP2's DTensors do,
        # whose places the client sends: here given through the function
        # that computes them) and checkpoint into one directory;
        # merge_shards puts the parameters and every state slot together.
        from unittest import mock
        import optimd._daemon_optimizer as daemon_optimizer
        from optimd.checkpoint import merge_shards
        whole = {"w": torch.randn(6, 4), "b": torch.randn(5)}
        parts = {"w": [(0, 3), (3, 3)], "b": [(0, 3), (3, 2)]}
        places = {}

        def place(p, mem):
            return places.get(id(p))
        with Daemon() as d, mock.patch.object(daemon_optimizer,
                                              "shard_place", place):
            opts, shards = [], []
            for rank in (0, 1):
                params = []
                for name, t in whole.items():
                    begin, n = parts[name][rank]
                    p = torch.nn.Parameter(t[begin:begin + n].clone())
                    places[id(p)] = (list(t.shape),
                                     [begin] + [0] * (t.dim() - 1))
                    params.append((name, p))
                opt = AdamW(params, lr=1e-2, address=d.address,
                            job_id="shards", rank=rank, world_size=2)
                for step in range(3):
                    for _, p in params:
                        p.grad = torch.randn_like(p)
                    opt.step()
                opt.save_checkpoint(self.dir)
                opts.append(opt)
                shards.append(dict(params))
            merged, state = merge_shards(self.dir)
            for name in whole:
                self.assertTrue(torch.equal(merged[name], torch.cat(
                    [shards[r][name].detach() for r in (0, 1)])), name)
                for key in ("exp_avg", "exp_avg_sq"):
                    self.assertTrue(torch.equal(state[name][key], torch.cat(
                        [opts[r].state[shards[r][name]][key]
                         for r in (0, 1)])), name)
                self.assertEqual(float(state[name]["step"]), 3.0)
            for opt in opts:
                opt.close()

    def test_safetensors_load_file_gives_shaped_tensors(self):
        # What safetensors.torch.load_file returns, read by hand (safetensors
        # is not installed here): every tensor has its parameter's shape.
        with Daemon() as d:
            w = torch.nn.Parameter(torch.randn(6, 4, 3))
            b = torch.nn.Parameter(torch.randn(5))
            opt = AdamW([("conv.weight", w), ("conv.bias", b)],
                        address=d.address)
            w.grad, b.grad = torch.randn_like(w), torch.randn_like(b)
            opt.step()
            path = opt.save_checkpoint(self.dir).path
            with open(path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(n))
            for name in ("conv.weight", "conv.weight.exp_avg"):
                self.assertEqual(header[name]["shape"], [6, 4, 3], name)
            self.assertEqual(header["conv.bias.exp_avg_sq"]["shape"], [5])
            from optimd.checkpoint import to_torch_state_dict
            sd, params, _ = to_torch_state_dict(path)
            self.assertEqual(params["conv.weight"].shape, (6, 4, 3))
            self.assertTrue(torch.equal(params["conv.weight"], w.detach()))
            self.assertEqual(sd["state"][0]["exp_avg"].shape, (6, 4, 3))
            opt.close()

    def test_file_is_safetensors_with_documented_names(self):
        with Daemon() as d:
            params = [torch.nn.Parameter(torch.randn(*s).to(torch.bfloat16))
                      for s in SHAPES]
            named = [("layer%d.weight" % i, p) for i, p in enumerate(params)]
            opt = AdamW(named, lr=1e-3, address=d.address, job_id="fmt",
                        store_param_remainders=True, amsgrad=True)
            for p in params:
                p.grad = _as_grad(p, torch.randn(p.shape).to(torch.bfloat16))
            opt.step()
            reply = opt.save_checkpoint(self.dir)
            header, tensors = read_safetensors(reply.path)
            meta = json.loads(header["__metadata__"]["optimd"])
            self.assertEqual(meta["format_version"], 1)
            self.assertEqual(meta["groups"][0]["step"], 1)
            for i, p in enumerate(params):
                base = "layer%d.weight" % i
                for suffix in ("", ".remainder", ".exp_avg", ".exp_avg_sq",
                               ".max_exp_avg_sq"):
                    self.assertIn(base + suffix, tensors)
                    self.assertIn(base + suffix, meta["crc32c"])
                self.assertTrue(torch.equal(tensors[base],
                                            p.detach().reshape(-1)))
                self.assertEqual(tensors[base + ".exp_avg"].dtype,
                                 torch.float32)
            self.assertEqual(tensors["layer2.weight"].numel(), 0)
            self.assertEqual(os.listdir(self.dir),
                             [os.path.basename(reply.path)])
            m = opt.client.get_metrics()
            self.assertEqual(m.checkpoint_saves, 1)
            self.assertEqual(m.checkpoint_save_bytes, reply.bytes)
            self.assertIn("optimd_checkpoint_saves_total 1", m.prometheus_text)
            opt.close()

    def test_conversion_to_torch_reads_through_a_map(self):
        # to_torch_state_dict of a 240 MB checkpoint, in a process of its
        # own: its peak memory grows by far less than the file (tensors are
        # views of a memory map; reading them in one go would cost the
        # whole file).
        import sys
        n = 20_000_000
        with Daemon() as d:
            p = torch.nn.Parameter(torch.randn(n))
            opt = AdamW([("w", p)], address=d.address, job_id="mapped")
            p.grad = torch.randn_like(p)
            opt.step()
            path = opt.save_checkpoint(self.dir).path
            opt.close()
        del p, opt
        size = os.path.getsize(path)
        self.assertGreater(size, 200 << 20)
        probe = (
            "import resource, sys, torch\n"
            "from optimd.checkpoint import to_torch_state_dict\n"
            "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
            "state, params, masters = to_torch_state_dict(sys.argv[1])\n"
            "assert params['w'].numel() == %d\n"
            "after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
            "print((after - before) * 1024)\n" % n)
        out = subprocess.run([sys.executable, "-c", probe, path],
                             capture_output=True, text=True, check=True,
                             env=dict(os.environ))
        grew = int(out.stdout.strip().splitlines()[-1])
        self.assertLess(grew, size // 8, "peak memory grew by %d bytes for "
                        "a %d-byte checkpoint" % (grew, size))

    def test_checkpoint_to_torch_state_dict_and_back(self):
        from optimd.checkpoint import to_torch_state_dict
        torch.manual_seed(SEED)
        model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(),
                                    torch.nn.Linear(5, 1))
        twin = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(),
                                   torch.nn.Linear(5, 1))
        with Daemon() as d:
            opt = AdamW(model.named_parameters(), lr=1e-2, address=d.address,
                        job_id="interop")
            x = torch.randn(32, 6)
            for _ in range(4):
                opt.zero_grad()
                model(x).pow(2).mean().backward()
                opt.step()
            path = opt.save_checkpoint(self.dir).path
            shapes = {n: p.shape for n, p in model.named_parameters()}
            sd, params, _ = to_torch_state_dict(path, shapes)
            # The checkpoint alone restores the model and a torch optimizer.
            twin.load_state_dict(params)
            ref = torch.optim.AdamW(twin.parameters(), lr=1e-2)
            ref.load_state_dict(sd)
            for _ in range(3):
                for m, o in ((model, opt), (twin, ref)):
                    o.zero_grad()
                    m(x).pow(2).mean().backward()
                    o.step()
            for p, q in zip(model.parameters(), twin.parameters()):
                err = (p.detach() - q.detach()).abs().max()
                self.assertLessEqual(err.item(),
                                     1e-6 * q.detach().abs().max().item())
            opt.close()

    def test_float64_checkpoint_continues_in_torch(self):
        # A float64 model's checkpoint holds F64 parameters and moments;
        # torch's float64 AdamW continues from it as optimd does.
        from optimd.checkpoint import to_torch_state_dict
        torch.manual_seed(SEED)
        model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(),
                                    torch.nn.Linear(5, 1)).double()
        twin = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(),
                                   torch.nn.Linear(5, 1)).double()
        x = torch.randn(32, 6, dtype=torch.float64)
        with Daemon() as d:
            opt = AdamW(model.named_parameters(), lr=1e-2, address=d.address,
                        job_id="f64")
            for _ in range(4):
                opt.zero_grad()
                model(x).pow(2).mean().backward()
                opt.step()
            path = opt.save_checkpoint(self.dir).path
            header, raw = read_safetensors(path)
            self.assertEqual(header["0.weight"]["dtype"], "F64")
            self.assertEqual(header["0.weight.exp_avg"]["dtype"], "F64")
            self.assertNotIn("0.weight.master", raw)
            sd, params, masters = to_torch_state_dict(path)
            self.assertEqual(masters, {})
            twin.load_state_dict(params)
            ref = torch.optim.AdamW(twin.parameters(), lr=1e-2)
            ref.load_state_dict(sd)
            self.assertEqual(ref.state_dict()["state"][0]["exp_avg"].dtype,
                             torch.float64)
            for _ in range(3):
                for m, o in ((model, opt), (twin, ref)):
                    o.zero_grad()
                    m(x).pow(2).mean().backward()
                    o.step()
            for p, q in zip(model.parameters(), twin.parameters()):
                err = (p.detach() - q.detach()).abs().max()
                self.assertLessEqual(err.item(),
                                     1e-12 * q.detach().abs().max().item())
            opt.close()

    def test_torch_state_dict_keeps_each_tensors_own_step(self):
        """An MoE-like model: expert 1 has no gradient at some steps and
        expert 2 never has one. The converted checkpoint is torch's own
        state_dict(): the same entries (none for expert 2, which torch never
        stepped), each tensor's own step, the same moments."""
        from optimd.checkpoint import to_torch_state_dict

        def build():
            torch.manual_seed(SEED)
            return torch.nn.ModuleDict(dict(
                shared=torch.nn.Linear(6, 6),
                experts=torch.nn.ModuleList(
                    [torch.nn.Linear(6, 1) for _ in range(3)])))
        ours, theirs = build(), build()
        x = torch.randn(8, 6)
        with Daemon() as d:
            opt = AdamW(ours.named_parameters(), lr=1e-2, weight_decay=0.1,
                        address=d.address, job_id="moe")
            ref = torch.optim.AdamW(theirs.parameters(), lr=1e-2,
                                    weight_decay=0.1)
            # Each parameter's largest gradient element: exp_avg sums
            # terms of that size, and those of opposite signs can cancel to
            # a far smaller moment, so its rounding is bounded by theirs.
            grad_max = {}
            for step in range(7):
                for o in (opt, ref):
                    o.zero_grad()
                expert = 1 if step in (1, 4) else 0
                h = torch.tanh(ours["shared"](x))
                ours["experts"][expert](h).square().mean().backward()
                # The same gradients (None where ours have none) for torch,
                # so that only the optimizers are compared.
                for i, (p, q) in enumerate(zip(ours.parameters(),
                                               theirs.parameters())):
                    q.grad = None if p.grad is None else p.grad.clone()
                    if p.grad is not None:
                        grad_max[i] = max(grad_max.get(i, 0.0),
                                          p.grad.abs().max().item())
                opt.step()
                ref.step()
            shapes = {n: p.shape for n, p in ours.named_parameters()}
            sd, _, _ = to_torch_state_dict(
                opt.save_checkpoint(self.dir).path, shapes)
            opt.close()
        want = ref.state_dict()
        self.assertEqual(sorted(sd["state"]), sorted(want["state"]))
        self.assertEqual([g["params"] for g in sd["param_groups"]],
                         [g["params"] for g in want["param_groups"]])
        for i, entry in want["state"].items():
            self.assertEqual(sorted(sd["state"][i]), sorted(entry), i)
            self.assertEqual(float(sd["state"][i]["step"]),
                             float(entry["step"]), i)
            for k in ("exp_avg", "exp_avg_sq"):
                got, exp = sd["state"][i][k], entry[k]
                self.assertEqual(got.shape, exp.shape, (i, k))
                err = (got - exp).abs().max().item()
                scale = exp.abs().max().item()
                if k == "exp_avg":
                    scale = max(scale, grad_max[i])
                self.assertLessEqual(err, 1e-6 * scale, (i, k))

    def test_packed_checkpoint_reads_as_torch_state_dict(self):
        """A session whose per-tensor header would not fit is saved packed
        (format 2); to_torch_state_dict reads it like any other."""
        from optimd.checkpoint import read_checkpoint, to_torch_state_dict
        names = ["%05d" % i + "n" * 995 for i in range(8000)]
        params = [torch.nn.Parameter(torch.randn(2)) for _ in names]
        with Daemon() as d:
            opt = AdamW(list(zip(names, params)), lr=1e-2, address=d.address,
                        job_id="packed", amsgrad=True)
            for _ in range(2):
                for p in params:
                    p.grad = torch.randn_like(p)
                opt.step()
            path = opt.save_checkpoint(self.dir).path
            meta, _ = read_checkpoint(path)
            self.assertEqual(meta["format_version"], 2)
            # A stream carries the same bytes as the file.
            with open(path, "rb") as f:
                self.assertEqual(b"".join(opt.state_bytes()), f.read())
            sd, saved, _ = to_torch_state_dict(path)
            ours = opt.state_dict()
            for i, (name, p) in enumerate(zip(names, params)):
                self.assertTrue(torch.equal(saved[name], p.detach()), name)
                for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
                    self.assertTrue(torch.equal(sd["state"][i][k],
                                                ours["state"][i][k]), (i, k))
                self.assertEqual(float(sd["state"][i]["step"]), 2.0)
            # And the daemon loads it back.
            before = [p.detach().clone() for p in params]
            opt.step()
            opt.load_checkpoint(self.dir)
            for p, q in zip(params, before):
                self.assertTrue(torch.equal(p.detach(), q))
            opt.close()

    def test_bad_checkpoints_change_nothing(self):
        with Daemon() as d:
            p = torch.nn.Parameter(torch.randn(1000))
            opt = AdamW([("w", p)], lr=1e-3, address=d.address, job_id="bad")
            p.grad = _as_grad(p, torch.randn(1000))
            opt.step()
            path = opt.save_checkpoint(self.dir).path
            good = open(path, "rb").read()
            before = p.detach().clone()
            state_before = {k: v.clone() for k, v in opt.state[p].items()}

            def unchanged():
                self.assertTrue(torch.equal(p.detach(), before))
                for k, v in opt.state[p].items():
                    self.assertTrue(torch.equal(v, state_before[k]), k)

            self.assert_bad_paths_refused(opt, path, unchanged)
            self.assert_damaged_files_refused(opt, path, good, unchanged)
            with open(path, "wb") as f:
                f.write(good)
            opt.load_checkpoint(self.dir)
            unchanged()
            opt.step()
            opt.close()
        # A checkpoint of other shapes or layouts is refused whole.
        self.assert_other_shapes_refused(path, good)

    def assert_bad_paths_refused(self, opt, path, unchanged):
        """Loads from a relative, a missing and a FIFO path are refused."""
        from optimd.v1 import optimd_pb2 as pb
        with self.assertRaises(optimd.InvalidArgumentError):
            opt.client._call("LoadState",
                             pb.LoadStateRequest(directory="relative"))
        with self.assertRaises(optimd.NotFoundError):
            opt.load_checkpoint(os.path.join(self.dir, "missing"))
        # Not a regular file: refused at once (a FIFO without a writer
        # must not hold the daemon), and the daemon still steps.
        fifo_dir = os.path.join(self.dir, "fifo")
        os.mkdir(fifo_dir)
        os.mkfifo(os.path.join(fifo_dir, os.path.basename(path)))
        with self.assertRaises(optimd.FailedPreconditionError) as cm:
            opt.load_checkpoint(fifo_dir)
        self.assertIn("not a regular file", str(cm.exception))
        unchanged()

    def assert_damaged_files_refused(self, opt, path, good, unchanged):
        """Truncated, foreign, newer and corrupt files are refused."""
        # Truncated.
        with open(path, "wb") as f:
            f.write(good[:len(good) // 2])
        with self.assertRaises(optimd.OptimdError) as cm:
            opt.load_checkpoint(self.dir)
        self.assertEqual(cm.exception.code.name, "DATA_LOSS")
        unchanged()
        # Another format.
        with open(path, "wb") as f:
            f.write(b"PK\x03\x04 this is a zip file, not a checkpoint")
        with self.assertRaises(optimd.InvalidArgumentError):
            opt.load_checkpoint(self.dir)
        unchanged()
        # A newer format version.
        with open(path, "wb") as f:
            f.write(good.replace(b'\\"format_version\\":1',
                                 b'\\"format_version\\":7'))
        with self.assertRaises(optimd.InvalidArgumentError) as cm:
            opt.load_checkpoint(self.dir)
        self.assertIn("newer", str(cm.exception))
        unchanged()
        # Corrupt data: every checksum is verified before anything
        # changes (test_corrupt_large_checkpoint_changes_nothing).
        corrupt = bytearray(good)
        corrupt[-5] ^= 0xFF
        with open(path, "wb") as f:
            f.write(bytes(corrupt))
        with self.assertRaises(optimd.OptimdError) as cm:
            opt.load_checkpoint(self.dir)
        self.assertEqual(cm.exception.code.name, "DATA_LOSS")
        self.assertIn("checksum", str(cm.exception))
        unchanged()

    def assert_other_shapes_refused(self, path, good):
        """`good`, loaded by a session of other shapes, is refused whole."""
        with Daemon() as d:
            q = torch.nn.Parameter(torch.randn(999))
            opt = AdamW([("w", q)], lr=1e-3, address=d.address, job_id="bad")
            q_before = q.detach().clone()
            with open(path, "wb") as f:
                f.write(good)
            with self.assertRaises(optimd.FailedPreconditionError) as cm:
                opt.load_checkpoint(self.dir)
            self.assertIn("'w'", str(cm.exception))
            self.assertTrue(torch.equal(q.detach(), q_before))
            opt.close()

    def test_corrupt_large_checkpoint_changes_nothing(self):
        """A corrupt checkpoint of 12 MiB, loaded from its file or streamed
        in, is DATA_LOSS and changes nothing: the optimizer steps on from
        its old state, bit for bit as a twin that never loaded (every load
        verifies all checksums first, whatever the file's size)."""
        n = 1 << 20
        init = torch.randn(n, generator=torch.Generator().manual_seed(SEED))
        with Daemon(flags=["--state_dir=" + self.dir]) as d:
            pa = torch.nn.Parameter(init.clone())
            pt = torch.nn.Parameter(init.clone())
            oa = AdamW([("w", pa)], lr=1e-2, address=d.address, job_id="a")
            ot = AdamW([("w", pt)], lr=1e-2, address=d.address, job_id="t")

            def step(seed):
                g = torch.randn(n, generator=torch.Generator().manual_seed(
                    SEED + seed))
                for p, o in ((pa, oa), (pt, ot)):
                    p.grad = g.clone()
                    o.step()

            def same():
                self.assertTrue(torch.equal(pa.detach(), pt.detach()))
                for k, v in oa.state[pa].items():
                    self.assertTrue(torch.equal(v, ot.state[pt][k]), k)

            step(1)
            path = oa.save_checkpoint(self.dir).path
            step(2)
            with open(path, "rb") as f:
                data = bytearray(f.read())
            data[-2] ^= 0x10  # the last moment: found after every other byte
            with open(path, "wb") as f:
                f.write(bytes(data))
            loads = [lambda: oa.load_checkpoint(self.dir),
                     lambda: oa.load_state_bytes(
                         bytes(data[i:i + (1 << 20)])
                         for i in range(0, len(data), 1 << 20))]
            for load, source in zip(loads, (path, "the streamed checkpoint")):
                with self.assertRaises(optimd.OptimdError) as cm:
                    load()
                self.assertEqual(cm.exception.code.name, "DATA_LOSS")
                self.assertIn("nothing was loaded", str(cm.exception))
                # Named as the client knows it (not the daemon's spool file).
                self.assertIn(source, str(cm.exception))
                self.assertNotIn(".optimd-load", str(cm.exception))
                same()
            step(3)
            step(4)
            same()
            oa.close()
            ot.close()

    def test_layouts_name_their_slots_and_older_files_still_read(self):
        """Each layout lists its state slots by name, so that a reader needs
        no table of each optimizer's; a file without the names (as written
        before) converts to the same torch state dict and loads alike."""
        from optimd.checkpoint import read_checkpoint, to_torch_state_dict
        from optimd.torch import SGD

        def no_slot_names(meta):
            for g in meta["groups"]:
                for t in g["tensors"]:
                    del t["layout"]["slot_names"]
        with Daemon() as d:
            p = torch.nn.Parameter(torch.randn(6))
            q = torch.nn.Parameter(torch.randn(5))
            opts = {"adamw": AdamW([("w", p)], amsgrad=True,
                                   address=d.address, job_id="slots-a"),
                    "sgd": SGD([("v", q)], lr=0.1, momentum=0.9,
                               address=d.address, job_id="slots-s")}
            names = {"adamw": ["exp_avg", "exp_avg_sq", "max_exp_avg_sq"],
                     "sgd": ["momentum_buffer"]}
            for kind, opt in opts.items():
                x = p if kind == "adamw" else q
                x.grad = torch.randn_like(x)
                opt.step()
                data = b"".join(opt.state_bytes())
                new, old = (os.path.join(self.dir, kind + n)
                            for n in (".new", ".old"))
                with open(new, "wb") as f:
                    f.write(data)
                with open(old, "wb") as f:
                    f.write(_rebuilt(data, no_slot_names))
                layout = read_checkpoint(new)[0]["groups"][0]["tensors"][0][
                    "layout"]
                self.assertEqual(layout["slot_names"], names[kind])
                want, got = (to_torch_state_dict(f)[0]["state"]
                             for f in (new, old))
                # torch's SGD keeps no step.
                self.assertEqual(sorted(got[0]), sorted(
                    names[kind] + (["step"] if kind == "adamw" else [])))
                for k in names[kind]:
                    self.assertTrue(torch.equal(got[0][k], want[0][k]), k)
                before = opt.state_dict()["state"]
                x.grad = torch.randn_like(x)
                opt.step()  # the state moves on; the load takes it back
                with open(old, "rb") as f:
                    opt.load_state_bytes([f.read()])
                after = opt.state_dict()["state"]
                for k in names[kind]:
                    self.assertTrue(torch.equal(after[0][k], before[0][k]))
                opt.close()

    def test_malformed_metadata_through_the_stream_keeps_the_daemon_up(self):
        """Wrong-typed or out-of-range header fields, streamed in: each is
        refused with a specific code, nothing changes, and the daemon (which
        a wrong-typed step used to abort) keeps serving."""

        def group(m):
            return m["groups"][0]

        edits = {
            "step a string": lambda m: group(m).update(step="3"),
            "step negative": lambda m: group(m).update(step=-1),
            "no step": lambda m: group(m).pop("step"),
            "lr a string": lambda m: group(m)["hyperparameters"].update(
                lr="0.1"),
            "lr past fp32": lambda m: group(m)["hyperparameters"].update(
                lr=-1e39),
            "lr 1e400": lambda m: group(m)["hyperparameters"].update(
                lr=float("inf")),
            "no hyperparameters": lambda m: group(m).pop("hyperparameters"),
            "hyperparameters a list": lambda m: group(m).update(
                hyperparameters=[1]),
        }
        with Daemon() as d:
            p = torch.nn.Parameter(torch.randn(100))
            opt = AdamW([("w", p)], lr=1e-3, address=d.address,
                        job_id="hostile")
            p.grad = torch.randn(100)
            opt.step()
            good = b"".join(opt.state_bytes())
            opt.step()
            before = p.detach().clone()
            for what, edit in edits.items():
                with self.subTest(edit=what):
                    bad = _rebuilt(good, edit)
                    with self.assertRaises(optimd.OptimdError) as cm:
                        opt.load_state_bytes([bad])
                    self.assertIn(cm.exception.code.name,
                                  ("INVALID_ARGUMENT", "DATA_LOSS"), what)
                    self.assertTrue(torch.equal(p.detach(), before))
                    self.assertEqual(d.process.poll(), None, "daemon died")
            # One digit of the learning rate changed, the metadata's own
            # checksum left as it was (a damaged byte, not an edit):
            # DATA_LOSS, where such a change once loaded silently.
            at = good.index(b'lr\\":') + len(b'lr\\":')
            while not good[at:at + 1].isdigit():
                at += 1
            damaged = bytearray(good)
            damaged[at] = ord("1") if damaged[at] != ord("1") else ord("2")
            with self.assertRaises(optimd.OptimdError) as cm:
                opt.load_state_bytes([bytes(damaged)])
            self.assertEqual(cm.exception.code.name, "DATA_LOSS",
                             str(cm.exception))
            self.assertTrue(torch.equal(p.detach(), before))
            opt.load_state_bytes([good])
            opt.step()
            opt.close()

    def test_a_stream_the_daemon_stops_sending_ends_after_the_timeout(self):
        """A state stream whose daemon stops sending (stopped here with
        SIGSTOP) raises DeadlineExceededError once one wait for a chunk
        passes the client's timeout, where it waited forever before; a
        reader slower than the timeout is not cut off."""
        import signal
        import time
        with Daemon() as d:
            p = torch.nn.Parameter(torch.randn(16_000_000))
            # 5 s: a loaded machine (CI's parallel tests) may take over 2 s
            # to send a chunk the reader asks for.
            opt = AdamW([("w", p)], address=d.address, job_id="stalled",
                        timeout=5.0)
            p.grad = torch.ones_like(p)
            opt.step()
            stream = opt.client.save_state_stream(1 << 20)
            next(stream)
            time.sleep(6)  # the reader's own time does not count
            next(stream)
            d.process.send_signal(signal.SIGSTOP)
            try:
                t0 = time.monotonic()
                with self.assertRaises(optimd.DeadlineExceededError) as cm:
                    for _ in stream:
                        pass
                self.assertLess(time.monotonic() - t0, 30)
                self.assertIn("sent no chunk", str(cm.exception))
            finally:
                d.process.send_signal(signal.SIGCONT)
            # The daemon and the session go on (on a loaded machine the
            # calls below may need more than the short bound).
            opt.client.timeout = 60.0
            opt.step()
            self.assertEqual(opt.state[p]["step"].item(), 2)
            opt.close()

    def test_unread_snapshots_count_against_the_state_budget(self):
        """Each SaveStateStream holds a host copy of the state until it is
        read to the end; those copies used to be unbounded and invisible to
        --max_state_bytes."""
        import time
        n = 1_000_000
        state, snapshot = 8 * n, 12 * n  # fp32 moments; params + moments

        def wait_for(client, value):
            deadline = time.time() + 10
            while client.get_metrics().state_bytes != value:
                self.assertLess(time.time(), deadline)
                time.sleep(0.01)

        with Daemon(flags=["--max_state_bytes=%d" % (100 << 20)]) as d:
            p = torch.nn.Parameter(torch.randn(n))
            opt = AdamW([("w", p)], address=d.address, job_id="snaps")
            c = opt.client
            self.assertEqual(c.get_metrics().state_bytes, state)
            held = [c.save_state_stream(1 << 20) for _ in range(2)]
            for s in held:
                next(s)  # the snapshot is taken; the rest stays unread
            self.assertEqual(c.get_metrics().state_bytes,
                             state + 2 * snapshot)
            with self.assertRaises(optimd.ResourceExhaustedError) as cm:
                next(c.save_state_stream(1 << 20))
            self.assertIn("still held", str(cm.exception))
            for s in held:
                s.close()  # cancels the stream
            wait_for(c, state)
            # A stream read to the end gives its memory back too.
            self.assertGreater(len(b"".join(opt.state_bytes())), snapshot)
            wait_for(c, state)
            opt.close()
        with Daemon(flags=["--max_state_bytes=%d" % (state + snapshot)]) as d:
            p = torch.nn.Parameter(torch.randn(n))
            opt = AdamW([("w", p)], address=d.address, job_id="budget")
            c = opt.client
            first = c.save_state_stream(1 << 20)
            next(first)
            with self.assertRaises(optimd.ResourceExhaustedError) as cm:
                next(c.save_state_stream(1 << 20))
            self.assertIn("max_state_bytes", str(cm.exception))
            first.close()
            wait_for(c, state)
            opt.close()

    def test_background_save_is_consistent_while_steps_go_on(self):
        with Daemon() as d:
            big = torch.nn.Parameter(torch.randn(40_000_000))
            small = torch.nn.Parameter(torch.randn(100))
            opt = AdamW([("big", big), ("small", small)], lr=1e-3,
                        address=d.address, job_id="bg")
            for _ in range(2):
                big.grad = torch.randn_like(big)
                small.grad = torch.randn_like(small)
                opt.step()
            at_save = small.detach().clone()
            big_at_save = big.detach()[:1000].clone()
            reply = opt.save_checkpoint(self.dir, background=True)
            self.assertGreater(reply.bytes, 40_000_000 * 12)
            # A second save while the first is writing is refused.
            with self.assertRaises(optimd.FailedPreconditionError) as cm:
                opt.save_checkpoint(self.dir)
            self.assertIn("still writing", str(cm.exception))
            # Steps go on meanwhile.
            for _ in range(3):
                big.grad = torch.randn_like(big)
                small.grad = torch.randn_like(small)
                opt.step()
            st = opt.wait_for_save()
            self.assertEqual(st.bytes_written, st.total_bytes)
            self.assertTrue(os.path.exists(st.path))
            header, tensors = read_safetensors(st.path)
            # The file holds the state at the save, not after the later steps.
            self.assertTrue(torch.equal(tensors["small"], at_save))
            self.assertTrue(torch.equal(tensors["big"][:1000], big_at_save))
            self.assertFalse(torch.equal(tensors["small"], small.detach()))
            self.assertEqual(
                json.loads(header["__metadata__"]["optimd"])["groups"][0]
                ["step"], 2)
            opt.close()

    def test_streamed_state_holds_values_written_into_bf16_parameters(self):
        # state_bytes() is what save_checkpoint() would write: masters as
        # the trainer's parameters are, writes since the last step told.
        params = [torch.nn.Parameter(torch.randn(3, 4).to(torch.bfloat16))]
        with Daemon(backend="cpu") as d:
            opt = AdamW(params, lr=1e-2, address=d.address, job_id="written")
            params[0].grad = torch.ones_like(params[0])
            opt.step()
            with torch.no_grad():
                params[0].fill_(5.0)
            streamed = b"".join(opt.state_bytes())
            opt.close()
            fresh = [torch.nn.Parameter(torch.zeros(3, 4, dtype=torch.bfloat16))]
            again = AdamW(fresh, lr=1e-2, address=d.address, job_id="again")
            again.load_state_bytes([streamed])
            master = again.state_dict()["state"][0]["master"]
            self.assertTrue(torch.equal(master, torch.full_like(master, 5.0)),
                            master)
            again.close()

    def test_streamed_state_equals_the_file_and_loads_bit_exact(self):
        gen = torch.Generator().manual_seed(SEED)
        init = [torch.randn(*s, generator=gen) for s in SHAPES]
        layout = LAYOUTS["bf16_remainder"]
        with Daemon(backend=BACKEND) as d:
            pa, oa, dtype = self.make(d, init, layout, "stream")
            self.run_steps(oa, pa, 0, 10, dtype)
            path = oa.save_checkpoint(self.dir).path
            streamed = b"".join(oa.state_bytes(chunk_bytes=1000))
            with open(path, "rb") as f:
                self.assertEqual(streamed, f.read())
            self.run_steps(oa, pa, 10, 20, dtype)
            final = [p.detach().clone() for p in pa]
        with Daemon(backend=BACKEND) as d:
            zeros = [torch.zeros(s) for s in SHAPES]
            pb_, ob, dtype = self.make(d, zeros, layout, "stream")
            before = [p.detach().clone() for p in pb_]
            # A stream that stops early changes nothing.
            with self.assertRaises(optimd.OptimdError) as cm:
                ob.load_state_bytes([streamed[:len(streamed) // 2]])
            self.assertEqual(cm.exception.code.name, "DATA_LOSS")
            for p, q in zip(pb_, before):
                self.assertTrue(torch.equal(p.detach(), q))

            # A stream that breaks (the client fails mid-way) changes
            # nothing.
            def broken():
                yield streamed[:5000]
                raise IOError("the checkpoint store went away")
            with self.assertRaises(Exception):
                ob.load_state_bytes(broken())
            for p, q in zip(pb_, before):
                self.assertTrue(torch.equal(p.detach(), q))
            # A stream claiming more bytes than a checkpoint of this session
            # can hold is refused before anything is spooled.
            from optimd.v1 import optimd_pb2 as pb
            # Sent at once after the broken stream, which the daemon learns
            # of asynchronously: it waits for that one to end, not refused.
            with self.assertRaises(optimd.InvalidArgumentError):
                ob.client.load_state_stream([pb.StateChunk(
                    offset=0, total_bytes=1 << 50, data=b"x")])
            ob.load_state_bytes(streamed[i:i + 777]
                                for i in range(0, len(streamed), 777))
            self.run_steps(ob, pb_, 10, 20, dtype)
            for p, q in zip(pb_, final):
                self.assertTrue(torch.equal(p.detach(), q))
            # No spool file is left behind.
            self.assertEqual(spool_files(d), [])
            ob.close()

    def test_next_stream_at_once_after_a_broken_one_is_taken(self):
        # A trainer whose stream broke (its iterator failed) and that sends
        # the next one as soon as the call has raised is never refused for
        # the broken one, which the daemon learns of asynchronously.
        gen = torch.Generator().manual_seed(SEED)
        init = [torch.randn(*s, generator=gen) for s in SHAPES]
        layout = LAYOUTS["fp32"]
        with Daemon(backend=BACKEND) as d:
            params, opt, dtype = self.make(d, init, layout, "rebreak")
            self.run_steps(opt, params, 0, 3, dtype)
            streamed = b"".join(opt.state_bytes())
            before = [p.detach().clone() for p in params]

            def broken():
                yield streamed[:5000]
                raise IOError("the checkpoint store went away")
            from optimd.v1 import optimd_pb2 as pb
            for _ in range(100):
                with self.assertRaises(Exception) as cm:
                    opt.load_state_bytes(broken())
                self.assertNotIsInstance(
                    cm.exception, optimd.FailedPreconditionError)
                with self.assertRaises(optimd.InvalidArgumentError):
                    opt.client.load_state_stream([pb.StateChunk(
                        offset=0, total_bytes=1 << 50, data=b"x")])
            for p, q in zip(params, before):
                self.assertTrue(torch.equal(p.detach(), q))
            opt.load_state_bytes([streamed])
            self.assertEqual(spool_files(d), [])
            opt.close()

    def test_stop_during_a_background_save_keeps_everything(self):
        """SIGTERM while a background save is writing: the daemon lets it
        finish (the trainer's checkpoint is complete and logged), then saves
        the session for its restart, and the restarted daemon resumes it
        bit-exactly."""
        from optimd.v1 import optimd_pb2 as pb
        n = 12_000_000  # a 144 MB file: the write takes a while
        save_dir = os.path.join(self.dir, "saved")
        log_path = os.path.join(self.dir, "daemon.log")
        flags = ["--save_dir=" + save_dir]
        with open(log_path, "w") as log:
            d1 = Daemon(flags=flags, stderr=log)
        try:
            p = torch.nn.Parameter(torch.randn(n))
            opt = AdamW([("w", p)], address=d1.address, job_id="bg-stop")
            for _ in range(2):
                p.grad = torch.randn_like(p)
                opt.step()
            expected = {k: v.clone() for k, v in opt.state[p].items()
                        if torch.is_tensor(v)}
            # A save can finish before the look on a fast machine: then
            # another starts.
            for _ in range(5):
                reply = opt.save_checkpoint(self.dir, background=True)
                if opt.save_status().state == pb.SAVE_STATE_RUNNING:
                    break
                opt.wait_for_save()
            else:
                self.fail("no background save was seen running")
            self.assertEqual(d1.stop(), 0)
        finally:
            d1.stop()
        with open(log_path) as f:
            log = f.read()
        self.assertIn("waited for the background save of job 'bg-stop'", log)
        self.assertIn("checkpoint saved (background): job 'bg-stop'", log)
        self.assertIn("saved job 'bg-stop' rank 0", log)
        _, written = read_safetensors(reply.path)
        self.assertTrue(torch.equal(written["w"], p.detach()))
        with Daemon(flags=flags) as d2:
            q = torch.nn.Parameter(torch.zeros(n))
            resumed = AdamW([("w", q)], address=d2.address, job_id="bg-stop",
                            resume=True)
            self.assertTrue(resumed.resumed)
            self.assertTrue(torch.equal(q.detach(), p.detach()))
            for k, v in expected.items():
                self.assertTrue(torch.equal(resumed.state[q][k], v), k)
            resumed.close()

    @staticmethod
    def temporary_seen(opt, path):
        """Whether the background save under way was seen writing its
        temporary file beside `path` before it finished."""
        import glob
        import time
        from optimd.v1 import optimd_pb2 as pb
        deadline = time.time() + 60
        while time.time() < deadline:
            if glob.glob(path + ".tmp-*"):
                return True
            if opt.save_status().state != pb.SAVE_STATE_RUNNING:
                return bool(glob.glob(path + ".tmp-*"))
            time.sleep(0.001)
        return False

    def test_daemon_killed_mid_save_keeps_the_previous_checkpoint(self):
        """SIGKILL while a save is writing: the previous checkpoint is intact,
        and the next save to that file removes the dead save's temporary."""
        import glob
        import hashlib

        def digest(path):
            with open(path, "rb") as f:
                return hashlib.sha256(f.read()).hexdigest()

        n = 12_000_000  # a 144 MB file: the write takes a while
        d1 = Daemon()
        try:
            p = torch.nn.Parameter(torch.randn(n))
            opt = AdamW([("w", p)], address=d1.address, job_id="killed")
            p.grad = torch.randn_like(p)
            opt.step()
            path = opt.save_checkpoint(self.dir).path
            good = digest(path)
            p.grad = torch.randn_like(p)
            opt.step()
            # A save can finish between two looks on a busy machine: then
            # its file is the previous checkpoint, and another save starts.
            for _ in range(5):
                opt.save_checkpoint(self.dir, background=True)
                if self.temporary_seen(opt, path):
                    break
                opt.wait_for_save()
                good = digest(path)
            else:
                self.fail("no save was seen writing its temporary")
            d1.process.kill()
            d1.process.wait()
        finally:
            d1.stop()
        left = glob.glob(path + ".tmp-*")
        self.assertEqual(len(left), 1)
        self.assertEqual(digest(path), good)
        del opt, p
        with Daemon() as d2:
            q = torch.nn.Parameter(torch.zeros(n))
            opt = AdamW([("w", q)], address=d2.address, job_id="killed")
            opt.load_checkpoint(self.dir)
            opt.save_checkpoint(self.dir)
            self.assertEqual(glob.glob(path + ".tmp-*"), [])
            self.assertEqual(os.listdir(self.dir), [os.path.basename(path)])
            opt.close()

    def test_full_disk_keeps_the_previous_checkpoint(self):
        small = os.path.join(self.dir, "small")
        os.mkdir(small)
        if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs",
                           small], capture_output=True).returncode != 0:
            self.skipTest("cannot mount a small tmpfs here (needs root)")
        try:
            with Daemon() as d:
                p = torch.nn.Parameter(torch.randn(10_000))
                opt = AdamW([("w", p)], address=d.address, job_id="full")
                p.grad = torch.randn_like(p)
                opt.step()
                first = opt.save_checkpoint(small).path  # 120 KB: fits
                good = open(first, "rb").read()
                big = torch.nn.Parameter(torch.randn(200_000))
                opt.add_param_group({"params": [("big", big)]})
                with self.assertRaises(optimd.ResourceExhaustedError) as cm:
                    opt.save_checkpoint(small)  # 2.5 MB: the disk is full
                self.assertIn("No space", str(cm.exception))
                self.assertEqual(open(first, "rb").read(), good)
                self.assertEqual(os.listdir(small), [os.path.basename(first)])
                opt.close()
        finally:
            subprocess.run(["umount", small])

    def test_failed_background_save_reports_its_error(self):
        with Daemon() as d:
            p = torch.nn.Parameter(torch.randn(1000))
            opt = AdamW([("w", p)], address=d.address, job_id="bgfail")
            self.assertEqual(opt.save_status().state, 0)  # none yet
            # The final name is taken by a directory: the save fails, on
            # the writing thread, before it writes anything.
            os.mkdir(os.path.join(self.dir, "rank-0.safetensors"))
            opt.save_checkpoint(self.dir, background=True)
            with self.assertRaises(optimd.OptimdError) as cm:
                opt.wait_for_save()
            self.assertIn("FAILED_PRECONDITION", str(cm.exception))
            self.assertIn("is a directory", str(cm.exception))
            from optimd.v1 import optimd_pb2 as pb
            self.assertEqual(opt.save_status().state, pb.SAVE_STATE_FAILED)
            # The failure counts in the daemon's metrics.
            self.assertEqual(opt._client.get_metrics().checkpoint_failures, 1)
            # Nothing half-written is left; the next save works.
            self.assertEqual(os.listdir(self.dir),
                             ["rank-0.safetensors"])
            os.rmdir(os.path.join(self.dir, "rank-0.safetensors"))
            opt.save_checkpoint(self.dir, background=True)
            self.assertEqual(opt.wait_for_save().state,
                             pb.SAVE_STATE_SUCCEEDED)
            opt.close()

    def test_state_dir_confines_paths(self):
        allowed = os.path.join(self.dir, "allowed")
        os.mkdir(allowed)
        with Daemon(flags=["--state_dir=" + allowed]) as d:
            p = torch.nn.Parameter(torch.randn(10))
            opt = AdamW([p], address=d.address, job_id="confined")
            with self.assertRaises(optimd.OptimdError) as cm:
                opt.save_checkpoint(self.dir)
            self.assertEqual(cm.exception.code.name, "PERMISSION_DENIED")
            with self.assertRaises(optimd.OptimdError) as cm:
                opt.save_checkpoint(os.path.join(allowed, ".."))
            self.assertEqual(cm.exception.code.name, "PERMISSION_DENIED")
            sub = os.path.join(allowed, "run1")
            os.mkdir(sub)
            self.assertTrue(opt.save_checkpoint(sub).path.startswith(sub))
            # A directory at the checkpoint's name is refused before
            # anything is written (it used to fail INTERNAL at the final
            # rename), and leaves no temporary file behind.
            os.mkdir(os.path.join(allowed, "rank-0.safetensors"))
            with self.assertRaises(optimd.OptimdError) as cm:
                opt.save_checkpoint(allowed)
            self.assertEqual(cm.exception.code.name, "FAILED_PRECONDITION")
            self.assertIn("is a directory", str(cm.exception))
            self.assertEqual(sorted(os.listdir(allowed)),
                             ["rank-0.safetensors", "run1"])
            opt.close()


    def test_symbolic_links_do_not_lead_out_of_the_state_dir(self):
        """With --state_dir, a checkpoint file that is a symbolic link, or a
        directory whose link leads out of the state directory, is
        PERMISSION_DENIED and changes nothing. Without it, a linked file
        that is no checkpoint is refused without its bytes in the message
        (the daemon once echoed its first 8 bytes as the header length)."""
        allowed = os.path.join(self.dir, "allowed")
        outside = os.path.join(self.dir, "outside")
        linked = os.path.join(allowed, "linked")
        for d in (allowed, outside, linked):
            os.mkdir(d)
        secret = os.path.join(self.dir, "secret")
        with open(secret, "wb") as f:
            f.write(b"SECRETS!" + b"x" * 100)
        shutil.copy(secret, os.path.join(outside, "rank-0.safetensors"))
        os.symlink(secret, os.path.join(linked, "rank-0.safetensors"))
        door = os.path.join(allowed, "door")
        os.symlink(outside, door)
        echoed = (str(struct.unpack("<Q", b"SECRETS!")[0]), "SECRETS")

        def refused(opt, directory, code):
            p = opt.param_groups[0]["params"][0]
            before = p.detach().clone()
            with self.assertRaises(optimd.OptimdError) as cm:
                opt.load_checkpoint(directory)
            self.assertEqual(cm.exception.code.name, code, str(cm.exception))
            for text in echoed:
                self.assertNotIn(text, str(cm.exception))
            self.assertTrue(torch.equal(p.detach(), before))
            p.grad = torch.randn(10)
            opt.step()  # not left needing a load
            self.assertFalse(torch.equal(p.detach(), before))

        with Daemon(flags=["--state_dir=" + allowed]) as d:
            p = torch.nn.Parameter(torch.randn(10))
            opt = AdamW([p], address=d.address, job_id="links")
            p.grad = torch.randn(10)
            opt.step()
            for directory in (linked, door):
                with self.subTest(directory=directory):
                    refused(opt, directory, "PERMISSION_DENIED")
            opt.close()
        with Daemon() as d:
            p = torch.nn.Parameter(torch.randn(10))
            opt = AdamW([p], address=d.address, job_id="links")
            refused(opt, linked, "INVALID_ARGUMENT")
            opt.close()

if __name__ == "__main__":
    unittest.main()
