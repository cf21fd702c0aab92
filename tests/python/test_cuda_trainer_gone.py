"""GPU (skipped without CUDA): a trainer killed after it sent a step but
before its stream marked the step ready. The daemon's stream waits for that
ready flag, and every session on the GPU waits behind it, until the daemon
notices the trainer is gone (its session reaper) and lets the step through,
skipped: another trainer on the same daemon and GPU goes on, and a resume
finds the state of the last whole step.

    LD_LIBRARY_PATH=.gpu/lib OPTIMD_BINARY=.gpu/optimd \\
        PYTHONPATH=client/python python3 -m unittest -v \\
        tests/python/test_cuda_trainer_gone.py
"""
import os
import subprocess
import sys
import tempfile
import threading
import unittest

import torch

from optimd.testing import Daemon
from optimd.torch import AdamW

# The resume secret of the killed trainer's session stays in this test's
# scratch, where the resuming trainer (this process) finds it.
os.environ.setdefault("OPTIMD_SECRETS_DIR",
                      tempfile.mkdtemp(prefix="optimd-secrets-"))

# The trainer that dies: three whole steps (their parameters saved), then
# `late` steps whose ready flags its stream writes only after seconds of
# spinning, sent and answered (queued by the daemon), then SIGKILL.
_DOOMED = r"""
import os, signal, sys
import torch
from optimd.torch import AdamW
address, job, saved, late = sys.argv[1:5]
torch.manual_seed(0)
p = torch.nn.Parameter(torch.randn(1 << 20, device="cuda"))
opt = AdamW([p], lr=1e-2, master_weights=True, address=address, job_id=job)
for _ in range(3):
    p.grad = torch.randn_like(p)
    opt.step()
opt.synchronize()
torch.save(p.detach().cpu(), saved)
torch.cuda._sleep(8_000_000_000)  # seconds: the ready flags never come
for _ in range(int(late)):
    p.grad = torch.randn_like(p)
    opt.step()
opt._look_at_replies(block=True)
print("queued", flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


@unittest.skipUnless(torch.cuda.is_available(), "needs a GPU")
class TrainerGone(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="optimd-gone-")
        self.log_path = os.path.join(self.dir, "daemon.log")
        self.log = open(self.log_path, "w")
        self.daemon = Daemon(backend="cuda", stderr=self.log,
                             flags=["--orphan_grace_s=120"])

    def tearDown(self):
        self.assertEqual(self.daemon.stop(), 0)
        self.log.close()

    def settles(self, fn, timeout=30):
        """Whether fn() returns within `timeout` seconds (what it raised
        is raised here)."""
        raised = []

        def run():
            try:
                fn()
            except BaseException as e:  # noqa: B902 (re-raised below)
                raised.append(e)
        t = threading.Thread(target=run, daemon=True)
        t.start()
        t.join(timeout)
        if raised:
            raise raised[0]
        return not t.is_alive()

    def kill_a_trainer_mid_step(self, job, saved, late=1):
        doomed = subprocess.run(
            [sys.executable, "-c", _DOOMED, self.daemon.address, job, saved,
             str(late)],
            stdout=subprocess.PIPE, timeout=120)
        self.assertIn(b"queued", doomed.stdout)
        self.assertEqual(doomed.returncode, -9)

    def test_a_trainer_killed_before_its_ready_flag_wedges_no_one(self):
        q = torch.nn.Parameter(torch.randn(1 << 16, device="cuda"))
        other = AdamW([q], lr=1e-2, address=self.daemon.address,
                      job_id="survivor")

        def train_other(steps=3):
            for _ in range(steps):
                q.grad = torch.randn_like(q)
                other.step()
            other.synchronize()
            torch.cuda.synchronize()
        self.assertTrue(self.settles(train_other))
        saved = os.path.join(self.dir, "doomed.pt")
        self.kill_a_trainer_mid_step("doomed", saved)
        self.assertTrue(self.settles(train_other),
                        "a session on the same GPU hangs behind the step of "
                        "a trainer that died before marking it ready")
        other.close()
        self.assert_resume_finds_the_last_whole_step("doomed", saved)
        with open(self.log_path) as f:
            self.assertIn("let through, skipped", f.read())

    def test_a_resume_right_after_the_kill_finds_the_last_whole_step(self):
        # Before the session reaper's next look (it looks every second):
        # the resume itself lets the gone trainer's two queued steps
        # through, or its own first call waits behind them for good.
        saved = os.path.join(self.dir, "doomed.pt")
        self.kill_a_trainer_mid_step("quick", saved, late=2)
        self.assertTrue(self.settles(
            lambda: self.assert_resume_finds_the_last_whole_step("quick",
                                                                 saved)),
            "a resume waits behind the steps of the trainer it replaces")

    def assert_resume_finds_the_last_whole_step(self, job, saved):
        """The steps let through were skipped: a resume finds three steps
        and the parameters after them, and steps on."""
        p = torch.nn.Parameter(torch.zeros(1 << 20, device="cuda"))
        resumed = AdamW([p], lr=1e-2, master_weights=True, resume=True,
                        address=self.daemon.address, job_id=job)
        self.assertTrue(resumed.resumed)
        self.assertEqual(int(resumed.state[p]["step"]), 3)
        self.assertTrue(torch.equal(p.detach().cpu(), torch.load(saved)))
        p.grad = torch.randn_like(p)
        resumed.step()  # the resumed trainer steps on
        resumed.synchronize()
        self.assertEqual(int(resumed.state[p]["step"]), 4)
        resumed.close()


if __name__ == "__main__":
    unittest.main()
