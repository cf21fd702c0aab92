"""GPU end to end (run on a GPU machine; skipped without CUDA): a trainer
with real CUDA tensors, the daemon on the CUDA backend in another process on
the same GPU, 100 steps; every parameter and state tensor must equal, bit for
bit, the same run on the CPU reference backend. Also times the step against
torch.optim.AdamW(fused=True) in the same script.

    LD_LIBRARY_PATH=.gpu/lib OPTIMD_BINARY=.gpu/optimd \\
        PYTHONPATH=client/python python3 -m unittest -v \\
        tests/python/test_cuda_e2e.py
"""
import os
import random
import shutil
import subprocess
import sys
import threading
import time
import unittest

import tempfile

import torch

import optimd
from optimd.testing import Daemon
from optimd.torch import SGD, AdamW, Lion

SEED = int(os.environ.get("OPTIMD_TEST_SEED", random.randrange(1 << 30)))
print("seed", SEED)
# The resume secrets of these tests' sessions stay in their own scratch.
os.environ.setdefault("OPTIMD_SECRETS_DIR",
                      tempfile.mkdtemp(prefix="optimd-secrets-"))

SHAPES = [(1000, 257), (4099,), (1,), (0,), (64, 64), (33, 7)]


def _as_grad(p, g):
    """A fresh gradient for `p` holding `g`, as autograd would set it."""
    return g.detach().to(device=p.device, dtype=p.dtype).reshape(
        p.shape).clone()


@unittest.skipUnless(torch.cuda.is_available(), "needs a GPU")
class CudaEndToEnd(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.gpu = Daemon(backend="cuda")
        cls.cpu = Daemon(backend="cpu")

    @classmethod
    def tearDownClass(cls):
        assert cls.gpu.stop() == 0
        assert cls.cpu.stop() == 0

    def run_both(self, dtype, steps=100, cpu_daemon=None,
                 absent=lambda step, i: False, zero=None, optimizer=AdamW,
                 **kw):
        """`absent(step, i)`: tensor i has no gradient at `step`; `zero`:
        zero_grad(set_to_none=zero) before each step's gradients, which
        then accumulate (None: gradients are assigned fresh); `optimizer`:
        optimd's class for both sessions."""
        g = torch.Generator().manual_seed(SEED)
        init = [torch.randn(*s, generator=g).to(dtype) for s in SHAPES]
        on_gpu = [torch.nn.Parameter(t.clone().cuda()) for t in init]
        on_cpu = [torch.nn.Parameter(t.clone()) for t in init]
        opt_g = optimizer(on_gpu, lr=1e-2, address=self.gpu.address,
                          job_id="gpu-" + self.id(), **kw)
        opt_c = optimizer(on_cpu, lr=1e-2,
                          address=(cpu_daemon or self.cpu).address,
                          job_id="cpu-" + self.id(), **kw)
        for step in range(steps):
            if zero is not None:
                opt_g.zero_grad(set_to_none=zero)
                opt_c.zero_grad(set_to_none=zero)
            for i, (p, q) in enumerate(zip(on_gpu, on_cpu)):
                grad = torch.randn(q.shape, generator=g).to(dtype)
                if absent(step, i):
                    p.grad = q.grad = None
                elif zero is not None and p.grad is not None:
                    p.grad.add_(grad.to(p.device))
                    q.grad.add_(grad)
                else:
                    p.grad = _as_grad(p, grad)
                    q.grad = _as_grad(q, grad)
            opt_g.step()
            opt_c.step()
            for p, q in zip(on_gpu, on_cpu):
                self.assertTrue(torch.equal(p.detach().cpu(), q.detach()),
                                "step %d" % step)
        sg, sc = opt_g.state, opt_c.state
        for p, q in zip(on_gpu, on_cpu):
            if q.numel() == 0:
                continue
            for k, v in sc[q].items():
                self.assertTrue(torch.equal(sg[p][k].cpu(), v), k)
        opt_g.close()
        opt_c.close()

    def test_fp32_matches_cpu_reference(self):
        self.run_both(torch.float32, weight_decay=0.01)

    def test_bf16_remainders_amsgrad_match_cpu_reference(self):
        self.run_both(torch.bfloat16, amsgrad=True, store_param_remainders=True)

    def test_absent_gradients_match_cpu_reference(self):
        # Tensors without gradients on some steps (an MoE expert the router
        # skipped): not stepped, and their own step counts drive their bias
        # corrections, bit-identical to the CPU reference. Clipping on, so
        # the norm leaves them out too.
        self.run_both(torch.float32, steps=40, weight_decay=0.1,
                      max_grad_norm=1.0,
                      absent=lambda step, i: (step + i) % 5 < 2 and i != 1)
        self.run_both(torch.bfloat16, steps=30, store_param_remainders=True,
                      exp_avg_dtype=torch.bfloat16,
                      absent=lambda step, i: step < 10 and i % 2 == 0)

    def test_zero_grad_in_place_matches_cpu_reference(self):
        # set_to_none=False: gradients move into the flat gradient buffer
        # and accumulate there; alternating with set_to_none=True moves
        # them back and forth between the buffer and the allocator.
        self.run_both(torch.float32, steps=20, zero=False)
        self.run_both(torch.float32, steps=20, zero=True)

    def test_graphed_forward_and_backward_match_cpu_reference(self):
        # A trainer whose forward and backward are CUDA graphs
        # (torch.cuda.make_graphed_callables), captured before the optimizer
        # is made: its gradients come out of the graphs' static buffers, and
        # the graphs read the parameters where they were. (Before every
        # CUDA parameter was registered where it is, graphs captured before
        # the optimizer was made read the parameters' old memory:
        # bench/RESULTS.md run 108.)
        def graphed(model, sample):
            torch.cuda.make_graphed_callables(model, (sample,))
            return model
        self.assert_fast_forward_matches_cpu_reference(graphed)

    def assert_fast_forward_matches_cpu_reference(self, make_fast):
        """`make_fast(model, sample)` (before the optimizer is made) gives
        the callable the trainer runs. Every forward through it sees the
        parameters of the step before it (an eager forward on them
        agrees), and the steps are bit-identical to the CPU reference given
        the same gradients, clipping included."""
        g = torch.Generator().manual_seed(SEED)
        torch.manual_seed(SEED)
        model = torch.nn.Sequential(torch.nn.Linear(64, 128),
                                    torch.nn.GELU(),
                                    torch.nn.Linear(128, 8)).cuda()
        batches = [torch.randn(32, 64, generator=g).cuda() for _ in range(3)]
        # A copy as the sample: graphs keep it as their static input.
        fast = make_fast(model, batches[0].clone())
        ref = [torch.nn.Parameter(p.detach().cpu().clone())
               for p in model.parameters()]
        opt_g = AdamW(model.parameters(), lr=1e-2, max_grad_norm=0.5,
                      address=self.gpu.address, job_id="gpu-" + self.id())
        opt_c = AdamW(ref, lr=1e-2, max_grad_norm=0.5,
                      address=self.cpu.address, job_id="cpu-" + self.id())
        for step in range(12):
            x = batches[step % 3]
            opt_g.zero_grad()
            out = fast(x)
            with torch.no_grad():
                eager = model[2](model[1](model[0](x)))
            torch.testing.assert_close(out, eager, rtol=1e-4, atol=1e-5,
                                       msg="step %d: stale parameters" % step)
            out.square().mean().backward()
            for p, q in zip(model.parameters(), ref):
                q.grad = p.grad.detach().cpu().clone()
            opt_g.step()
            opt_c.step()
            for p, q in zip(model.parameters(), ref):
                self.assertTrue(torch.equal(p.detach().cpu(), q.detach()),
                                "step %d" % step)
        opt_g.close()
        opt_c.close()

    def test_memory_cuda_ipc_cannot_export_is_stepped_in_the_buffer(self):
        # A parameter in an expandable segment (memory CUDA IPC cannot
        # export) moves into its group's buffer with a warning naming it,
        # and its steps still equal the CPU reference's. An odd size, so
        # the allocation is a fresh (expandable) segment, not a block the
        # cache kept from before.
        g = torch.Generator().manual_seed(SEED)
        init = torch.randn((37 << 20) + 4099, generator=g)
        torch.cuda.memory._set_allocator_settings("expandable_segments:True")
        try:
            p = torch.nn.Parameter(init.cuda())
        finally:
            torch.cuda.memory._set_allocator_settings(
                "expandable_segments:False")
        q = torch.nn.Parameter(init.clone())
        with self.assertWarnsRegex(UserWarning, "cannot share"):
            opt_g = AdamW([p], lr=1e-2, address=self.gpu.address,
                          job_id="gpu-" + self.id())
        opt_c = AdamW([q], lr=1e-2, address=self.cpu.address,
                      job_id="cpu-" + self.id())
        for step in range(3):
            grad = torch.randn(q.shape, generator=g)
            p.grad, q.grad = grad.cuda(), grad
            opt_g.step()
            opt_c.step()
            self.assertTrue(torch.equal(p.detach().cpu(), q.detach()),
                            "step %d" % step)
        opt_g.close()
        opt_c.close()

    def test_expandable_segments_train_as_the_cpu_reference(self):
        # Under PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (set before
        # torch starts: a process of its own) nothing torch allocates can
        # be shared by CUDA IPC; the daemon maps it chunk by chunk from
        # descriptors the client passes over its descriptor socket, and
        # steps parameters and reads gradients where they are, also
        # after torch.cuda.empty_cache() unmapped freed chunks.
        run = self.run_expandable()
        self.assertEqual(run.returncode, 0, run.stdout + run.stderr)
        self.assertIn("equal to the CPU reference", run.stdout)

    def test_memory_torch_gives_back_returns_to_the_device(self):
        # torch.cuda.empty_cache() frees the blocks of gradients that
        # zero_grad(set_to_none=True) let go; the daemon still maps them
        # (it keeps mappings for allocations handed out again). At the next
        # step the client says torch gave memory back, and the daemon
        # closes what no buffer uses: the device gets those blocks back.
        # A new allocation may lie at a freed one's address: the client
        # then sends the gradients anew, and the steps equal the CPU
        # reference's.
        self.run_releasing_steps(reset_stats=False)

    def test_a_release_then_a_reset_of_torchs_stats_is_seen(self):
        # torch.cuda.reset_accumulated_memory_stats() after each
        # empty_cache() zeroes the counts of device frees the client
        # compares, so that they read the same at every step; the client
        # counts the resets too.
        self.run_releasing_steps(reset_stats=True)

    def step_against_cpu(self, opt, ref, params, refs):
        """One step of `opt` (CUDA) and `ref` (CPU) on the same fresh
        gradients; the parameters must then be equal bit for bit."""
        for p, q in zip(params, refs):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.cpu()
        opt.step()
        ref.step()
        opt.synchronize()
        for i, (p, q) in enumerate(zip(params, refs)):
            self.assertTrue(torch.equal(p.detach().cpu(), q.detach()),
                            "parameter %d differs from the CPU reference" % i)

    def test_values_written_into_bf16_parameters_reach_their_masters(self):
        # bf16 parameters keep fp32 masters in the daemon. Values the
        # trainer writes (an in-place edit, a state-dict load) are told at
        # the next step (param_written) and stepped from, after the
        # trainer's stream; the same writes on the CPU reference give the
        # same bits.
        torch.manual_seed(SEED)
        params = [torch.nn.Parameter(torch.randn(s, device="cuda").to(
            torch.bfloat16)) for s in [(1000, 257), (4099,)]]
        refs = [torch.nn.Parameter(p.detach().cpu()) for p in params]
        opt = AdamW(params, lr=1e-2, address=self.gpu.address,
                    job_id="written-" + self.id())
        ref = AdamW(refs, lr=1e-2, address=self.cpu.address,
                    job_id="written-cpu-" + self.id())
        self.step_against_cpu(opt, ref, params, refs)
        self.step_against_cpu(opt, ref, params, refs)
        torch.cuda._sleep(10 * _SPIN_CYCLES)  # the writes come late
        with torch.no_grad():
            for p, q in zip(params, refs):
                p[: p.shape[0] // 2].fill_(5.0)
                q[: q.shape[0] // 2].fill_(5.0)
        self.step_against_cpu(opt, ref, params, refs)
        self.assertLess((params[1][:2049].float() - 5.0).abs().max().item(),
                        0.1, "stepped from the old masters")
        opt.close()
        ref.close()

    def test_pruned_weights_with_remainders_match_the_cpu_reference(self):
        # store_param_remainders: a written 0 or infinity gets a zero
        # remainder (cuda::LaunchAdoptWrittenRemainder), riding with the
        # step after the trainer's stream; the CPU reference gives the
        # same bits, and no pruned weight stays 0.
        torch.manual_seed(SEED)
        params = [torch.nn.Parameter(torch.randn(s, device="cuda").to(
            torch.bfloat16)) for s in [(1000, 257), (4099,)]]
        refs = [torch.nn.Parameter(p.detach().cpu()) for p in params]
        kw = dict(lr=1e-2, store_param_remainders=True)
        opt = AdamW(params, address=self.gpu.address,
                    job_id="pruned-" + self.id(), **kw)
        ref = AdamW(refs, address=self.cpu.address,
                    job_id="pruned-cpu-" + self.id(), **kw)
        for _ in range(3):
            self.step_against_cpu(opt, ref, params, refs)
        torch.cuda._sleep(10 * _SPIN_CYCLES)  # the writes come late
        with torch.no_grad():
            for p, q in zip(params, refs):
                mask = (torch.arange(p.numel()) % 2).reshape(p.shape).to(
                    torch.bfloat16)
                p.mul_(mask.cuda())
                q.mul_(mask)
        for _ in range(3):
            self.step_against_cpu(opt, ref, params, refs)
        self.assertEqual(int((params[1][0::2] == 0).sum()), 0)
        opt.close()
        ref.close()

    def test_out_of_memory_gives_back_gradients_the_daemon_maps(self):
        # Gradients set to None, then freed by torch's allocator as it
        # retries before an out-of-memory error, stay mapped by the daemon
        # until the next step. torch's out-of-memory observer has the
        # daemon close them (optimd/_oom_release.py), so that a retry
        # before the next step finds their memory, as under torch; the
        # steps after equal the CPU reference. The control, with the
        # release taken out, gets that memory back only at the next step.
        gained = self.memory_after_out_of_memory(release=True)
        self.assertGreater(gained, 448, "MiB given back: %.0f" % gained)
        gained = self.memory_after_out_of_memory(release=False)
        self.assertLess(gained, 256, "the control got back %.0f MiB: the "
                        "test does not see the daemon's mappings" % gained)

    def test_out_of_memory_gives_back_expandable_segments_chunks(self):
        # The same under expandable segments: the daemon holds the chunks'
        # descriptors and mappings. The client closes its descriptor
        # connections and the daemon lets go of the freed gradients'
        # chunks, so that a retry finds their memory; the control (the
        # release taken out) keeps them, and the same retry fails.
        for mode, outcome in (("oom-release", "ok"),
                              ("oom-release-held", "failed")):
            run = self.run_expandable(mode)
            self.assertEqual(run.returncode, 0, run.stdout + run.stderr)
            self.assertIn("equal to the CPU reference", run.stdout)
            self.assertIn("past the memory free before %s" % outcome,
                          run.stdout, mode)

    def memory_after_out_of_memory(self, release):
        """MiB of device memory that an out-of-memory error gave back after
        zero_grad(set_to_none=True), 512 MiB of gradients having been
        stepped."""
        params = [torch.nn.Parameter(torch.randn(4096, 4096, device="cuda"))
                  for _ in range(8)]
        refs = [torch.nn.Parameter(p.detach().cpu()) for p in params]
        opt = AdamW(params, lr=1e-3, address=self.gpu.address,
                    job_id="oom-%s-%s" % (release, self.id()))
        ref = AdamW(refs, lr=1e-3, address=self.cpu.address,
                    job_id="oom-cpu-%s-%s" % (release, self.id()))
        if not release:
            opt.release_freed_gradients = lambda: None

        def step():
            self.step_against_cpu(opt, ref, params, refs)
            opt.zero_grad(set_to_none=True)
            ref.zero_grad(set_to_none=True)

        step()
        step()
        torch.cuda.synchronize()
        before = torch.cuda.mem_get_info()[0]
        total = torch.cuda.mem_get_info()[1]
        with self.assertRaises(torch.cuda.OutOfMemoryError):
            torch.empty(total, dtype=torch.uint8, device="cuda")
        gained = (torch.cuda.mem_get_info()[0] - before) / 2**20
        step()
        opt.close()
        ref.close()
        return gained

    def run_releasing_steps(self, reset_stats):
        params = [torch.nn.Parameter(torch.randn(4096, 4096, device="cuda"))
                  for _ in range(8)]  # 512 MiB of gradients
        refs = [torch.nn.Parameter(p.detach().cpu()) for p in params]
        opt = AdamW(params, lr=1e-3, address=self.gpu.address,
                    job_id="released-" + self.id())
        ref = AdamW(refs, lr=1e-3, address=self.cpu.address,
                    job_id="released-cpu-" + self.id())

        def step():
            self.step_against_cpu(opt, ref, params, refs)
            opt.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            if reset_stats:
                torch.cuda.reset_accumulated_memory_stats()
            torch.cuda.synchronize()
            return torch.cuda.mem_get_info()[0] / 2**20

        for _ in range(3):
            first = step()
        # These gradients are new allocations (the cache was emptied); the
        # step closes the daemon's mappings of the ones before.
        then = step()
        self.assertGreater(then, first - 64,
                           "the daemon still holds the gradients torch "
                           "freed a step before (MiB free: %.0f, then %.0f)"
                           % (first, then))
        opt.close()
        ref.close()

    def run_expandable(self, *mode):
        """Runs expandable_segments_run.py in a process of its own (the
        variable is read when torch starts)."""
        env = dict(os.environ,
                   PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                              "expandable_segments_run.py")
        return subprocess.run(
            [sys.executable, script, self.gpu.address, self.cpu.address,
             str(SEED)] + list(mode), env=env, capture_output=True,
            text=True, timeout=300)

    def test_a_release_while_copying_a_gradient_is_seen(self):
        # torch may release cached memory (unmap chunks) inside the very
        # allocation the client makes to copy a gradient for the daemon;
        # the copy can then lie where a chunk the daemon knows was. The
        # client builds the step's updates again when that happened: the
        # steps equal the CPU reference, and they do not when the updates
        # are built once (the same script, its negative control).
        control = self.assert_mode_and_its_control(
            "release-in-copy", "release-in-copy-one-pass",
            "the copy did not take a released chunk's address")
        self.assertIn("AssertionError: (1, 1)", control.stderr)

    def test_a_release_on_a_side_stream_leaves_queued_steps_their_chunks(
            self):
        # Torch releases memory of another stream while the daemon is steps
        # behind; the descriptor connection of the chunks the queued steps
        # name stays open until they are answered. The negative control
        # closes it at once, and a queued step is refused.
        self.assert_mode_and_its_control(
            "side-release", "side-release-unheld",
            "no step was queued behind the release")

    def assert_mode_and_its_control(self, mode, control_mode, why_not):
        """expandable_segments_run.py's `mode` equals the CPU reference,
        and its negative control `control_mode` fails (`why_not`: what a
        passing control would mean); returns the control's run."""
        run = self.run_expandable(mode)
        self.assertEqual(run.returncode, 0, run.stdout + run.stderr)
        self.assertIn("equal to the CPU reference", run.stdout)
        control = self.run_expandable(control_mode)
        self.assertNotEqual(control.returncode, 0,
                            "the negative control passed: " + why_not)
        return control

    def assert_gpu_settles(self, timeout=30):
        """The trainer's stream finishes its queued work: nothing waits
        forever on a step flag."""
        t = threading.Thread(target=torch.cuda.synchronize, daemon=True)
        t.start()
        t.join(timeout)
        self.assertFalse(t.is_alive(), "the trainer's stream hangs")

    def test_refused_step_never_hangs_the_trainer_stream(self):
        p = torch.nn.Parameter(torch.randn(1000, device="cuda"))
        opt = AdamW([p], lr=1e-2, address=self.gpu.address,
                    job_id="refused-" + self.id())
        for _ in range(3):
            p.grad = torch.randn_like(p)
            opt.step()
        opt.param_groups[0]["lr"] = float("nan")  # refused by the daemon
        p.grad = torch.randn_like(p)
        opt.step()  # returns at once; the error comes with the reply
        (p * 2).sum()  # queued behind the refused step's done flag
        with self.assertRaises(optimd.InvalidArgumentError):
            opt.synchronize()
        self.assert_gpu_settles()
        # Fixed, the optimizer steps again (step flags bound anew).
        opt.param_groups[0]["lr"] = 1e-2
        before = p.detach().clone()
        opt.step()
        opt.synchronize()
        self.assertFalse(torch.equal(before, p.detach()))
        opt.close()

    def test_a_refused_step_leaves_the_step_before_it_whole(self):
        # The release after a refusal waits for the done flag of the step
        # the daemon answered before it, however late its ready flag
        # comes: released early, the trainer's stream would read the
        # parameters while that step's update writes them.
        p = torch.nn.Parameter(torch.randn(1 << 24, device="cuda"))
        opt = AdamW([p], lr=1e-2, address=self.gpu.address,
                    job_id="refused-late-" + self.id())
        for _ in range(3):
            p.grad = torch.randn_like(p)
            opt.step()
        opt.synchronize()
        torch.cuda._sleep(80 * _SPIN_CYCLES)  # ~8 s: past the 5 s patience
        p.grad = torch.randn_like(p)
        opt.step()  # answered, waiting for its ready flag
        opt._look_at_replies(block=True)
        opt.param_groups[0]["lr"] = float("nan")  # refused by the daemon
        p.grad = torch.randn_like(p)
        opt.step()
        seen = p.detach().clone()  # after the refused step's done flag
        with self.assertRaises(optimd.InvalidArgumentError):
            opt.synchronize()
        self.assert_gpu_settles()
        self.assertTrue(torch.equal(seen, p.detach()))
        opt.close()

    def test_two_optimizers_steps_out_of_order_never_deadlock(self):
        # One trainer, two optimizers on one GPU; the first one's step
        # request reaches the daemon after the second one's. The second
        # optimizer waits for the first one's reply before it sends, so
        # that the daemon's stream never waits for the second ready flag
        # ahead of the first step (two_optimizers_run.py). Without that
        # wait, the script's negative control, both processes wait for
        # each other. Each run has a daemon of its own; the control's,
        # stopped at once after its trainer is killed, lets the gone
        # trainer's waiting step through before it ends (its stream would
        # otherwise keep the daemon from exiting).
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                              "two_optimizers_run.py")
        daemon = Daemon(backend="cuda")
        try:
            ordered = subprocess.run(
                [sys.executable, script, daemon.address],
                capture_output=True, text=True, timeout=120)
            self.assertEqual(ordered.returncode, 0, ordered.stderr[-3000:])
            self.assertIn("steps done", ordered.stdout)
        finally:
            self.assertEqual(daemon.stop(), 0)
        daemon = Daemon(backend="cuda")
        try:
            with self.assertRaises(subprocess.TimeoutExpired,
                                   msg="the control did not deadlock: the "
                                   "requests were not out of order"):
                subprocess.run([sys.executable, script, daemon.address,
                                "unordered"], capture_output=True,
                               text=True, timeout=30)
        finally:
            self.assertEqual(daemon.stop(), 0)

    def test_an_optimizer_trains_under_cuda_malloc_async(self):
        # cudaMallocAsync's pool: no CUDA IPC export and no out-of-memory
        # observers (torch raises on attaching one). The optimizer must
        # still be built and train (malloc_async_run.py).
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                              "malloc_async_run.py")
        env = dict(os.environ,
                   PYTORCH_CUDA_ALLOC_CONF="backend:cudaMallocAsync")
        run = subprocess.run([sys.executable, script, self.gpu.address],
                             capture_output=True, text=True, timeout=120,
                             env=env)
        self.assertEqual(run.returncode, 0, run.stderr[-3000:])
        self.assertIn("allocator cudaMallocAsync, steps done", run.stdout)

    def test_daemon_gone_never_hangs_the_trainer_stream(self):
        daemon = Daemon(backend="cuda")
        p = torch.nn.Parameter(torch.randn(1 << 20, device="cuda"))
        opt = AdamW([p], lr=1e-2, address=daemon.address, job_id="gone")
        for _ in range(3):
            p.grad = torch.randn_like(p)
            opt.step()
        daemon.process.kill()
        daemon.process.wait()
        p.grad = torch.randn_like(p)
        with self.assertRaises(optimd.OptimdError):
            opt.step()
            opt.synchronize()
        self.assert_gpu_settles()
        daemon.stop()

    def test_daemon_gone_after_answering_never_hangs_the_trainer_stream(self):
        # A reply comes once the step is queued on the daemon, not run: a
        # daemon gone then never writes that step's done flag.
        daemon = Daemon(backend="cuda")
        p = torch.nn.Parameter(torch.randn(1 << 20, device="cuda"))
        opt = AdamW([p], lr=1e-2, address=daemon.address, job_id="answered")
        for _ in range(3):
            p.grad = torch.randn_like(p)
            opt.step()
        opt.synchronize()
        torch.cuda._sleep(_SPIN_CYCLES)  # the ready flag comes late
        p.grad = torch.randn_like(p)
        opt.step()
        opt._look_at_replies(block=True)  # answered, still waiting to run
        daemon.process.kill()
        daemon.process.wait()
        self.assert_gpu_settles()
        daemon.stop()

    def test_steps_wait_once_more_than_two_replies_are_out(self):
        # A refused step's error (and opt.skipped) comes at most two steps
        # late: with the daemon frozen, the first two steps return, the
        # third waits for the oldest reply.
        daemon = Daemon(backend="cuda")
        p = torch.nn.Parameter(torch.randn(1000, device="cuda"))
        opt = AdamW([p], lr=1e-2, address=daemon.address,
                    job_id="lag-" + self.id())
        p.grad = torch.randn_like(p)
        opt.step()
        opt.synchronize()
        returned = []

        # A gradient that moved, for the thread's first step to find.
        p.grad = torch.randn_like(p)

        def three_steps():
            # In a thread of its own, as some trainers step, which has made
            # no CUDA call before (no current context on device 0).
            for _ in range(3):
                opt.step()
                returned.append(len(opt._pending))

        daemon.freeze()
        try:
            t = threading.Thread(target=three_steps, daemon=True)
            t.start()
            t.join(3)
            self.assertEqual(returned, [1, 2])
            self.assertTrue(t.is_alive(), "a third step did not wait")
        finally:
            daemon.thaw()
        t.join(30)
        self.assertFalse(t.is_alive())
        self.assertEqual(len(returned), 3)
        self.assertLessEqual(returned[2], 2)
        opt.synchronize()
        opt.close()
        self.assert_gpu_settles()
        self.assertEqual(daemon.stop(), 0)

    def test_refused_staged_step_never_hangs_the_next_forward(self):
        # The trainer's stream resets the progress word before it writes
        # ready; the daemon's release of a refused staged step must come
        # after that reset, or the next forward's stage wait never ends.
        torch.manual_seed(SEED)
        model = torch.nn.Sequential(torch.nn.Linear(64, 1024),
                                    torch.nn.Linear(1024, 1)).cuda()
        opt = AdamW(model.parameters(), lr=1e-3, overlap=True,
                    address=self.gpu.address, job_id="staged-refused")
        x = torch.randn(32, 64, device="cuda")
        for _ in range(3):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
        opt.zero_grad()
        torch.cuda._sleep(_SPIN_CYCLES)  # the reset and ready come late
        model(x).square().mean().backward()
        opt.param_groups[0]["lr"] = float("nan")  # refused by the daemon
        opt.step()
        model(x).sum()  # waits for its stage of the refused step
        with self.assertRaises(optimd.InvalidArgumentError):
            opt.synchronize()
        self.assert_gpu_settles()
        opt.close()

    def train_model(self, overlap, iters=12, wrap=None):
        """A small model with a large last layer (its update ends last),
        trained with clipping, one step skipped for a non-finite gradient,
        and a refused step; `wrap`: "graphs" (its forward and backward CUDA
        graphs captured after the optimizer is made), "compile"
        (torch.compile(model)) or "compile_in_place" (model.compile()).
        Returns the loss bits of every iteration, the final parameters and
        the optimizer."""
        torch.manual_seed(SEED)
        model = torch.nn.Sequential(
            torch.nn.Embedding(1000, 64), torch.nn.LayerNorm(64),
            torch.nn.Linear(64, 4096), torch.nn.GELU(),
            torch.nn.Linear(4096, 4096), torch.nn.Linear(4096, 1)).cuda()
        decay = [p for p in model.parameters() if p.dim() > 1]
        other = [p for p in model.parameters() if p.dim() <= 1]
        opt = AdamW([dict(params=decay), dict(params=other,
                                              weight_decay=0.0)],
                    lr=1e-3, max_grad_norm=1.0, overlap=overlap,
                    skip_nonfinite=True,
                    address=self.gpu.address, job_id=self.id() + str(overlap))
        data = torch.randint(0, 1000, (iters, 32), generator=torch.Generator()
                             .manual_seed(SEED)).cuda()
        forward = model
        if wrap == "graphs":
            torch.cuda.make_graphed_callables(model, (data[0].clone(),))
        elif wrap == "compile":
            forward = torch.compile(model, backend="aot_eager")
        elif wrap == "compile_in_place":
            model.compile(backend="aot_eager")
        losses = []
        for i in range(iters):
            opt.zero_grad(set_to_none=i % 4 != 3)
            loss = forward(data[i]).float().square().mean()
            losses.append(loss.detach())
            loss.backward()
            if i == 5:
                model[4].weight.grad[0, 0] = float("inf")  # skipped
            if i == 8:
                opt.param_groups[0]["lr"] = float("nan")  # refused
                opt.step()
                with self.assertRaises(optimd.InvalidArgumentError):
                    opt.synchronize()
                opt.param_groups[0]["lr"] = 1e-3
                continue
            opt.step()
        opt.synchronize()
        self.assert_gpu_settles()
        params = [p.detach().clone() for p in model.parameters()]
        return torch.stack(losses).cpu(), params, opt

    def test_overlap_gives_the_plain_steps_bits(self):
        # Every forward reads parameters its module waited for: the losses
        # of every iteration and the final parameters equal a run without
        # overlap bit for bit (plain steps equal the CPU reference in the
        # tests above and in cuda_backend_test).
        opt = self.assert_overlap_gives_the_plain_steps_bits()
        # The steps were staged: the progress word is past every stage.
        self.assertEqual(opt._flags.words[2].item(), 0x7FFFFFFF)
        opt.close()

    def test_overlap_with_a_graphed_model_gives_the_plain_steps_bits(self):
        # The model's forward a CUDA graph: its submodules' hooks do not run
        # in the replay, so the model's own waits for every stage under it;
        # the same bits as plain steps through the same graphs.
        self.assert_overlap_gives_the_plain_steps_bits("graphs").close()

    def test_overlap_with_a_compiled_model_gives_the_plain_steps_bits(self):
        # torch.compile(model): the OptimizedModule's own hook runs eagerly
        # before the compiled code and waits for every stage under it;
        # model.compile(): the hooks run inside the compiled code.
        for wrap in ("compile", "compile_in_place"):
            with self.subTest(wrap=wrap):
                torch._dynamo.reset()
                self.assert_overlap_gives_the_plain_steps_bits(wrap).close()

    def assert_overlap_gives_the_plain_steps_bits(self, wrap=None):
        """train_model with overlap gives the losses and parameters of
        train_model without, bit for bit; returns the overlap run's
        optimizer."""
        torch.use_deterministic_algorithms(True, warn_only=True)
        try:
            plain_losses, plain, opt = self.train_model(overlap=False,
                                                        wrap=wrap)
            opt.close()
            losses, params, opt = self.train_model(overlap=True, wrap=wrap)
        finally:
            torch.use_deterministic_algorithms(False)
        self.assertTrue(torch.equal(losses, plain_losses),
                        "%s != %s" % (losses, plain_losses))
        for p, q in zip(params, plain):
            self.assertTrue(torch.equal(p, q))
        return opt

    def test_sgd_and_lion_give_the_cpu_reference_bits(self):
        # Parameters without a gradient now and then: SGD's momentum buffer
        # starts at each tensor's own first step. float64 parameters are
        # stepped in double on both backends.
        sometimes = lambda step, i: (step + i) % 7 == 3
        for dtype in (torch.float32, torch.bfloat16, torch.float64):
            with self.subTest(dtype=dtype):
                self.run_both(dtype, steps=30, optimizer=SGD, momentum=0.9,
                              nesterov=True, weight_decay=0.01,
                              absent=sometimes)
                self.run_both(dtype, steps=30, optimizer=SGD,
                              weight_decay=0.01, maximize=True)
                self.run_both(dtype, steps=30, optimizer=Lion,
                              weight_decay=0.1, absent=sometimes)

    def test_one_daemon_serves_cuda_and_cpu_sessions(self):
        # The CUDA daemon keeps CPU tensors' state on its CPU backend: both
        # sessions step through the same daemon, bit-identical to each other.
        self.run_both(torch.float32, steps=20, cpu_daemon=self.gpu,
                      weight_decay=0.01)

    def test_step_time_against_torch_fused(self):
        n, count = 50_000_000, 100
        ours = [torch.nn.Parameter(torch.randn(n // count, device="cuda"))
                for _ in range(count)]
        theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
        for p, q in zip(ours, theirs):
            q.grad = torch.randn_like(q)
        opt = AdamW(ours, lr=1e-3, address=self.gpu.address, job_id="time")
        for p, q in zip(ours, theirs):
            p.grad = _as_grad(p, q.grad)
        ref = torch.optim.AdamW(theirs, lr=1e-3, fused=True)

        def timed(step, iters=50):
            for _ in range(5):
                step()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(iters):
                step()
            torch.cuda.synchronize()
            return (time.perf_counter() - t0) / iters * 1e3
        for _ in range(5):  # the first steps map buffers and build graphs
            opt.step()
        opt.synchronize()
        before = opt._client.get_metrics()
        t_ours = timed(opt.step)
        opt.synchronize()
        after = opt._client.get_metrics()
        t_ref = timed(ref.step)
        print("training step, %d params in %d tensors: optimd.torch.AdamW "
              "%.3f ms, torch AdamW(fused=True) %.3f ms, ratio %.3f" %
              (n, count, t_ours, t_ref, t_ours / t_ref))
        # The daemon times each step it reports on its own stream: its work
        # fits in the step's share of the wall time. Where the step is all
        # GPU work (the H200) the two are equal but for the timers' own
        # resolution, hence the 5% margin.
        timed_steps = (after.step_device_time.count -
                       before.step_device_time.count)
        self.assertGreater(timed_steps, 0)
        device_ms = (after.step_device_time.sum -
                     before.step_device_time.sum) / timed_steps * 1e3
        wait_ms = (after.step_ready_wait.sum -
                   before.step_ready_wait.sum) / timed_steps * 1e3
        print("daemon: %d steps timed, device %.3f ms, ready wait %.3f ms "
              "per step" % (timed_steps, device_ms, wait_ms))
        self.assertGreater(device_ms, 0)
        self.assertLess(device_ms, t_ours * 1.05)
        opt.close()


# About 0.1 s of the GPU spinning (torch.cuda._sleep counts clock cycles):
# long against a call's round trip, so trainer work queued behind it is
# still pending when the next call reaches the daemon.
_SPIN_CYCLES = 200_000_000


@unittest.skipUnless(torch.cuda.is_available(), "needs a GPU")
class TrainerStreamOrder(unittest.TestCase):
    """Calls in which the daemon reads or writes parameters outside a step
    come after the trainer's queued work, as torch's stream order has it
    (Client.before_trainer_memory)."""

    @classmethod
    def setUpClass(cls):
        cls.gpu = Daemon(backend="cuda")
        cls.dir = tempfile.mkdtemp(prefix="optimd-order-")

    @classmethod
    def tearDownClass(cls):
        assert cls.gpu.stop() == 0
        shutil.rmtree(cls.dir, ignore_errors=True)

    def make(self, p, job, **kw):
        return AdamW([p], lr=0.0, weight_decay=0.0, address=self.gpu.address,
                     job_id=job, **kw)

    def step_once(self, opt, p):
        p.grad = torch.zeros_like(p)
        opt.step()
        opt.synchronize()

    def test_masters_are_made_from_values_the_trainer_wrote_last(self):
        # bf16 parameters: registration makes the fp32 master from them.
        p = torch.nn.Parameter(torch.zeros(1 << 20, dtype=torch.bfloat16,
                                           device="cuda"))
        torch.cuda._sleep(_SPIN_CYCLES)
        p.data.fill_(1.5)  # queued behind the spin
        opt = self.make(p, "order-register", master_weights=True)
        self.step_once(opt, p)  # lr 0: the parameter becomes its master
        self.assertTrue(torch.all(p.detach() == 1.5))
        opt.close()

    def test_a_save_sees_an_edit_queued_before_it(self):
        p = torch.nn.Parameter(torch.zeros(1 << 20, device="cuda"))
        opt = self.make(p, "order-save")
        self.step_once(opt, p)
        torch.cuda._sleep(_SPIN_CYCLES)
        with torch.no_grad():
            p.fill_(3.0)  # fp32: the parameter is its own master
        path = tempfile.mkdtemp(dir=self.dir)
        opt.save_checkpoint(path)
        with torch.no_grad():
            p.zero_()
        opt.load_checkpoint(path)
        torch.cuda.synchronize()
        self.assertTrue(torch.all(p.detach() == 3.0))
        opt.close()

    def test_a_load_is_not_overwritten_by_work_queued_before_it(self):
        p = torch.nn.Parameter(torch.full((1 << 20,), 2.0, device="cuda"))
        opt = self.make(p, "order-load")
        self.step_once(opt, p)
        path = tempfile.mkdtemp(dir=self.dir)
        opt.save_checkpoint(path)
        torch.cuda._sleep(_SPIN_CYCLES)
        with torch.no_grad():
            p.fill_(7.0)  # queued before the load, so the load wins
        opt.load_checkpoint(path)
        torch.cuda.synchronize()
        self.assertTrue(torch.all(p.detach() == 2.0))
        opt.close()

    def test_streamed_state_comes_after_the_steps_sent_before_it(self):
        p = torch.nn.Parameter(torch.zeros(1 << 20, device="cuda"))
        opt = AdamW([p], lr=0.1, address=self.gpu.address,
                    job_id="order-stream")
        self.step_once(opt, p)
        torch.cuda._sleep(_SPIN_CYCLES)
        p.grad = torch.ones_like(p)
        opt.step()  # still waiting for the trainer's stream
        streamed = b"".join(opt.state_bytes())
        opt.synchronize()
        self.assertEqual(streamed, b"".join(opt.state_bytes()))
        opt.close()


if __name__ == "__main__":
    unittest.main()
