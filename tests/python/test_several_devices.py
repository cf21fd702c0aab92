"""One optimd.torch optimizer over parameters on several devices, side by
side with torch.optim.AdamW (optimd/_several_devices.py).

A session lives on one device, so such an optimizer keeps one part (and
session) per device. On a machine without a GPU the parts are made by
SplitAdamW, which splits CPU parameters by the parity of their size as if
they were on two devices: the same code, the real daemon, two real
sessions. With CUDA, the CPU and the GPU.
"""
import copy
import os
import signal
import subprocess
import sys
import tempfile
import unittest

import torch

import optimd
from optimd.testing import Daemon, DaemonTestCase
from optimd.torch import AdamW

TOL = dict(rtol=1e-5, atol=1e-6)
HAS_CUDA = torch.cuda.is_available()


class SplitAdamW(AdamW):
    """AdamW whose parameters of an odd number of elements form a part of
    their own, as if on a second device; a parameter's `part` attribute,
    where set, names its part instead (setting it moves the parameter to
    another part, as a move to another device would)."""

    def _part_key(self, p):
        return (str(p.device), getattr(p, "part", p.numel() % 2))

    def _part_label(self, key):
        return "%s-%d" % (key[0].replace(":", ""), key[1])


def model_on(devices):
    """Layers whose parameters have odd and even sizes, the i-th layer on
    devices[i % len(devices)]."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(5, 7), torch.nn.Linear(7, 4),
              torch.nn.Linear(4, 3)]
    for i, layer in enumerate(layers):
        layer.to(devices[i % len(devices)])
    return layers


def forward(layers, x):
    for layer in layers:
        x = torch.tanh(layer(x.to(layer.weight.device)))
    return x.sum()


def session_keys(client):
    return {(s.job_id, s.rank) for s in client.list_sessions().sessions}


class SeveralDevicesCase(DaemonTestCase):
    cls = SplitAdamW
    devices = ("cpu",)

    def both(self, groups_of, **kw):
        """(ours, theirs, our layers, their layers): self.cls and torch's
        AdamW over copies of one model, each given groups_of(layers)."""
        out = []
        for _ in range(2):
            out.append(model_on(self.devices))
        opt = self.cls(groups_of(out[0]), address=self.daemon.address, **kw)
        self.opts.append(opt)
        for k in ("max_grad_norm", "skip_nonfinite", "exp_avg_dtype"):
            kw.pop(k, None)
        return opt, torch.optim.AdamW(groups_of(out[1]), **kw), out[0], out[1]

    def train(self, opt, ref, ours, theirs, steps=4, clip=0.0, after=None):
        for step in range(steps):
            torch.manual_seed(100 + step)
            x = torch.randn(8, 5)
            for o, layers in ((opt, ours), (ref, theirs)):
                o.zero_grad()
                forward(layers, x).backward()
                if clip and o is ref:
                    norm = torch.nn.utils.clip_grad_norm_(
                        [p for layer in layers for p in layer.parameters()],
                        clip)
                o.step()
                if after is not None:
                    after(o)
            if clip:
                self.assertAlmostEqual(opt.grad_norm, norm.item(), places=5)

    def assert_same(self, ours, theirs):
        for a, b in zip(ours, theirs):
            for p, q in zip(a.parameters(), b.parameters()):
                self.assertEqual(p.device, q.device)
                torch.testing.assert_close(p.detach(), q.detach(), **TOL)


def two_groups(layers):
    return [{"params": list(layers[0].parameters())},
            {"params": [p for layer in layers[1:] for p in layer.parameters()],
             "lr": 3e-3, "weight_decay": 0.0}]


class SeveralParts(SeveralDevicesCase):
    nonfinite_layer = 2
    def test_trains_as_torch_with_groups_schedulers_and_clipping(self):
        client = optimd.Client(self.daemon.address)
        before = session_keys(client)
        opt, ref, ours, theirs = self.both(two_groups, lr=1e-2,
                                           max_grad_norm=0.05)
        self.assertIsInstance(opt, torch.optim.AdamW)
        self.assertEqual(type(opt).__name__, self.cls.__name__)
        self.assertEqual(len(session_keys(client) - before), 2)
        scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 0.9 ** s)
                  for o in (opt, ref)]
        self.train(opt, ref, ours, theirs, steps=5, clip=0.05,
                   after=lambda o: scheds[o is ref].step())
        self.assert_same(ours, theirs)
        self.assertEqual([g["lr"] for g in opt.param_groups],
                         [g["lr"] for g in ref.param_groups])
        opt.close()
        self.assertEqual(session_keys(client) - before, set())
        client.close()

    def test_state_dicts_cross_both_ways_and_state_writes_are_followed(self):
        opt, ref, ours, theirs = self.both(two_groups, lr=1e-2)
        self.train(opt, ref, ours, theirs)
        mine, torchs = opt.state_dict(), ref.state_dict()
        self.assertEqual(sorted(mine["state"]), sorted(torchs["state"]))
        for i, entry in torchs["state"].items():
            for k in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(mine["state"][i][k].cpu(),
                                           entry[k].cpu(), **TOL)
        self.assertEqual([g["params"] for g in mine["param_groups"]],
                         [g["params"] for g in torchs["param_groups"]])
        # optimizer.state: read and written per parameter, as torch's.
        for o, layers in ((opt, ours), (ref, theirs)):
            o.state[layers[1].weight]["exp_avg"].zero_()
        self.assertEqual(len(opt.state), len(ref.state))
        self.train(opt, ref, ours, theirs, steps=2)
        self.assert_same(ours, theirs)
        # torch's state dict into ours, ours into torch's.
        fresh, twin, layers, their_layers = self.both(two_groups, lr=1e-2)
        fresh.load_state_dict(ref.state_dict())
        twin.load_state_dict(opt.state_dict())
        for layer, mine_l in zip(layers, ours):
            layer.load_state_dict(mine_l.state_dict())
        for layer, theirs_l in zip(their_layers, theirs):
            layer.load_state_dict(theirs_l.state_dict())
        self.train(fresh, twin, layers, their_layers, steps=2)
        self.assert_same(layers, their_layers)

    def test_state_dict_holds_values_written_into_bf16_parameters(self):
        # Each part keeps the fp32 masters of its bf16 parameters; a write
        # into them is told before the state dict is read.
        params = [torch.nn.Parameter(torch.randn(3, 4).to(torch.bfloat16)),
                  torch.nn.Parameter(torch.randn(5).to(torch.bfloat16))]
        opt = self.cls(params, lr=1e-2, address=self.daemon.address)
        self.opts.append(opt)
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()
        with torch.no_grad():
            for p in params:
                p.fill_(5.0)
        for entry in opt.state_dict()["state"].values():
            self.assertTrue(torch.equal(entry["master"], torch.full_like(
                entry["master"], 5.0)), entry["master"])

    def test_a_non_finite_gradient_on_one_part_skips_every_part(self):
        opt, _, ours, _ = self.both(two_groups, skip_nonfinite=True)
        forward(ours, torch.randn(8, 5)).backward()
        before = [p.detach().clone() for layer in ours
                  for p in layer.parameters()]
        # On one part: the odd one (3 elements), or the GPU's.
        ours[self.nonfinite_layer].bias.grad[0] = float("inf")
        opt.step()
        self.assertTrue(opt.skipped)
        after = [p.detach() for layer in ours for p in layer.parameters()]
        for a, b in zip(before, after):
            self.assertTrue(torch.equal(a, b))
        self.assertEqual(len(opt.state), 0)

    def test_groups_added_later_and_zero_grad_both_ways(self):
        opt, ref, ours, theirs = self.both(
            lambda layers: list(layers[0].parameters()), lr=1e-2)
        self.train(opt, ref, ours, theirs, steps=2)
        for o, layers in ((opt, ours), (ref, theirs)):
            o.add_param_group({"params": [p for layer in layers[1:]
                                          for p in layer.parameters()],
                               "lr": 2e-3})
        self.train(opt, ref, ours, theirs, steps=2)
        for o, layers in ((opt, ours), (ref, theirs)):
            forward(layers, torch.ones(2, 5)).backward()
            o.zero_grad(set_to_none=False)
            self.assertTrue(all(p.grad is not None and not p.grad.any()
                                for layer in layers
                                for p in layer.parameters()))
            o.step()  # zero gradients: weight decay and moments move
        self.assert_same(ours, theirs)

    def test_checkpoints_keep_a_folder_per_part(self):
        opt, ref, ours, theirs = self.both(two_groups, lr=1e-2)
        self.train(opt, ref, ours, theirs, steps=2)
        with tempfile.TemporaryDirectory() as d:
            opt.save_checkpoint(d)
            self.assertEqual(len(os.listdir(d)), 2)
            # A new optimizer (a new process, say) over the same model.
            twin = self.cls(two_groups(ours), address=self.daemon.address)
            self.opts.append(twin)
            twin.load_checkpoint(d)
        saved, loaded = opt.state_dict(), twin.state_dict()
        for i, entry in saved["state"].items():
            torch.testing.assert_close(loaded["state"][i]["exp_avg"],
                                       entry["exp_avg"])
        with self.assertRaisesRegex(NotImplementedError, "save_checkpoint"):
            next(iter(opt.state_bytes()))

    def test_what_parts_do_not_take_raises_and_leaves_nothing(self):
        client = optimd.Client(self.daemon.address)
        before = session_keys(client)
        layers = model_on(self.devices)
        params = [p for layer in layers for p in layer.parameters()]
        for kw, error in ((dict(shard_state=True), NotImplementedError),
                          (dict(gradient_sharding="replicated"),
                           NotImplementedError),
                          (dict(resume_secret="s"), ValueError)):
            with self.assertRaises(error):
                self.cls(params, address=self.daemon.address, **kw)
        with self.assertRaisesRegex(TypeError, "complex64"):
            self.cls(params + [torch.nn.Parameter(
                torch.randn(3, dtype=torch.complex64))],
                address=self.daemon.address)
        self.assertEqual(session_keys(client) - before, set())
        client.close()


def complex_parameter():
    return torch.nn.Parameter(torch.randn(3, dtype=torch.complex64))


class ChangesOfParts(SeveralDevicesCase):
    """Parts made anew, refused changes and resumes (CPU parts)."""

    def test_a_parameter_moved_between_parts_keeps_its_state(self):
        # Also the state of a parameter out of every group at the move.
        opt, ref, ours, theirs = self.both(two_groups, lr=1e-2)
        self.train(opt, ref, ours, theirs, steps=2)
        for o, layers in ((opt, ours), (ref, theirs)):
            ps = o.param_groups[1]["params"]
            del ps[list(map(id, ps)).index(id(layers[2].weight))]
        self.train(opt, ref, ours, theirs, steps=1)
        ours[0].weight.part = 0  # 35 elements: from the odd part to the even
        self.train(opt, ref, ours, theirs, steps=2)
        for o, layers in ((opt, ours), (ref, theirs)):
            o.param_groups[1]["params"].append(layers[2].weight)
        self.train(opt, ref, ours, theirs, steps=2)
        self.assert_same(ours, theirs)

    def test_a_refused_group_keeps_the_parts_and_their_state(self):
        # A group that would spread a one-device optimizer, one with a new
        # part, and one on the parts there are: refused (TypeError, as
        # before), and training goes on as if it had not been asked for.
        opt, ref, ours, theirs = self.both(
            lambda layers: [p for layer in layers for p in layer.parameters()
                            if p.numel() % 2 == 0], lr=1e-2)
        self.train(opt, ref, ours, theirs, steps=2)
        odd = [p for layer in ours for p in layer.parameters()
               if p.numel() % 2]
        for extra in ([], [complex_parameter()]):
            new_part = complex_parameter()
            new_part.part = 2
            with self.assertRaisesRegex(TypeError, "complex64"):
                opt.add_param_group({"params": odd[:1] + [complex_parameter()]
                                     + extra})
            self.train(opt, ref, ours, theirs, steps=1)
            with self.assertRaisesRegex(TypeError, "complex64"):
                opt.add_param_group({"params": [new_part]})
            self.train(opt, ref, ours, theirs, steps=1)
            self.assertEqual(len(opt.param_groups), 1)
        self.assert_same(ours, theirs)
        self.assertEqual(len(opt.state), len(ref.state))

    def test_a_refused_load_changes_no_part(self):
        opt, ref, ours, theirs = self.both(two_groups, lr=1e-2)
        self.train(opt, ref, ours, theirs, steps=2)
        before = opt.state_dict()
        bad = opt.state_dict()
        last = max(bad["state"])
        bad["state"][last]["exp_avg"] = torch.zeros(99)
        with self.assertRaisesRegex(RuntimeError, "parameter %d" % last):
            opt.load_state_dict(bad)
        after = opt.state_dict()
        for i, entry in before["state"].items():
            self.assertTrue(torch.equal(after["state"][i]["exp_avg"],
                                        entry["exp_avg"]))

    def test_its_own_state_dict_loads_back(self):
        # optimd's own keys come back as names in a saved state dict
        # (exp_avg_dtype "torch.bfloat16"): loaded as the dtypes they name.
        opt, ref, ours, theirs = self.both(two_groups, lr=1e-2,
                                           exp_avg_dtype=torch.bfloat16)
        self.train(opt, ref, ours, theirs, steps=2)
        saved = copy.deepcopy(opt.state_dict())
        opt.load_state_dict(saved)
        again = opt.state_dict()
        self.assertEqual(again["param_groups"], saved["param_groups"])
        for i, entry in saved["state"].items():
            for k, v in entry.items():
                self.assertTrue(torch.equal(again["state"][i][k], v), k)

    def test_a_storage_edit_one_part_refuses_steps_no_part(self):
        # master_weights=False suits the fp32 part and not the bf16 one:
        # refused before either part steps.
        fp32 = torch.nn.Parameter(torch.randn(4))  # even: part 0
        bf16 = torch.nn.Parameter(torch.randn(3).to(torch.bfloat16))
        opt = self.cls([fp32, bf16], lr=1e-2, address=self.daemon.address)
        self.opts.append(opt)
        for p in (fp32, bf16):
            p.grad = torch.ones_like(p)
        opt.step()
        before = [p.detach().clone() for p in (fp32, bf16)]
        opt.param_groups[0]["master_weights"] = False
        with self.assertRaisesRegex(ValueError, "needs a master"):
            opt.step()
        for p, was in zip((fp32, bf16), before):
            self.assertTrue(torch.equal(p.detach(), was))
            self.assertEqual(opt.state[p]["step"].item(), 1)
        opt.param_groups[0]["master_weights"] = None
        opt.step()
        self.assertEqual(opt.state[fp32]["step"].item(), 2)

    def test_both_switches_of_decoupled_decay_follow_an_edit(self):
        # Groups with adam_w_mode and torch's decoupled_weight_decay (torch
        # 2.7's AdamW has both; added by hand where it has not): an edit of
        # one switches both, in every part, as with one device.
        results = []
        for cls in (AdamW, self.cls):
            layers = model_on(self.devices)
            opt = cls([p for layer in layers for p in layer.parameters()],
                      lr=1e-2, weight_decay=0.5, address=self.daemon.address)
            self.opts.append(opt)
            opt.param_groups[0]["decoupled_weight_decay"] = True
            for step in range(4):
                if step == 1:
                    opt.param_groups[0]["decoupled_weight_decay"] = False
                opt.zero_grad()
                forward(layers, torch.ones(2, 5) * step).backward()
                opt.step()
            group = opt.param_groups[0]
            self.assertEqual((group["adam_w_mode"],
                              group["decoupled_weight_decay"]), (False, False))
            results.append(layers)
        self.assert_same(*results)

    def test_parts_resume_and_parts_made_later_start_afresh(self):
        # A trainer killed after two steps; its successor resumes each part
        # (a wrong secret for one leaves both sessions for the retry), and a
        # part made later starts afresh instead of looking for a session.
        child = (
            "import os, signal, sys, torch\n"
            "import test_several_devices as t\n"
            "layers = t.model_on(('cpu',))\n"
            "opt = t.SplitAdamW([p for l in layers for p in l.parameters()],"
            " lr=1e-2, address=sys.argv[1], job_id=sys.argv[2])\n"
            "for step in range(2):\n"
            "    opt.zero_grad()\n"
            "    t.forward(layers, torch.ones(2, 5)).backward()\n"
            "    opt.step()\n"
            "os.kill(os.getpid(), signal.SIGKILL)\n")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [os.path.dirname(os.path.abspath(__file__))] + sys.path))
        job = "resume-" + str(os.getpid())
        run = subprocess.run([sys.executable, "-c", child,
                              self.daemon.address, job], env=env,
                             stderr=subprocess.DEVNULL)
        self.assertEqual(run.returncode, -signal.SIGKILL)
        layers = model_on(self.devices)
        params = [p for layer in layers for p in layer.parameters()]
        with self.assertRaises(optimd.PermissionDeniedError):
            self.cls(params, address=self.daemon.address, job_id=job,
                     resume=True, resume_secret={"cpu-1": "wrong"})
        opt = self.cls(params, address=self.daemon.address, job_id=job,
                       resume=True)
        self.opts.append(opt)
        self.assertTrue(opt.resumed)
        self.assertEqual(len(opt.state), len(params))
        layers[0].weight.part = 7  # a new part, made afresh
        opt.zero_grad()
        forward(layers, torch.ones(2, 5)).backward()
        opt.step()
        self.assertEqual(len(opt._parts), 3)
        self.assertEqual(len(opt.state), len(params))


class OneDeviceBecomesSeveral(SeveralDevicesCase):
    def test_a_group_on_another_part_turns_the_optimizer_into_parts(self):
        # Even-sized parameters only at first: one part, one session.
        def even(layers):
            return [p for layer in layers for p in layer.parameters()
                    if p.numel() % 2 == 0]

        def odd(layers):
            return [p for layer in layers for p in layer.parameters()
                    if p.numel() % 2]

        opt, ref, ours, theirs = self.both(even, lr=1e-2)
        self.assertFalse(hasattr(opt, "_parts"))
        self.train(opt, ref, ours, theirs, steps=2)
        for o, layers in ((opt, ours), (ref, theirs)):
            o.add_param_group({"params": odd(layers), "lr": 5e-3})
        self.assertEqual(len(opt._parts), 2)
        self.train(opt, ref, ours, theirs, steps=3)
        self.assert_same(ours, theirs)


@unittest.skipUnless(HAS_CUDA, "needs a GPU")
class CpuAndCuda(SeveralParts):
    """The rows above with the parameters on the CPU and the GPU."""

    cls = AdamW
    devices = ("cpu", "cuda:0")
    nonfinite_layer = 1

    @classmethod
    def setUpClass(cls):
        cls.daemon = Daemon(backend="cuda")  # it takes CPU sessions too

    def test_a_parameter_moved_to_the_gpu_is_followed(self):
        opt, ref, ours, theirs = self.both(two_groups, lr=1e-2)
        self.train(opt, ref, ours, theirs, steps=2)
        for layers in (ours, theirs):
            layers[0].to("cuda:0")
        # torch's own state stays where it was (its step then fails): its
        # load_state_dict moves it to the parameters, as ours follows them.
        ref.load_state_dict(ref.state_dict())
        self.train(opt, ref, ours, theirs, steps=2)
        self.assert_same(ours, theirs)


class MetaDevice(SeveralDevicesCase):
    def test_meta_parameters_are_refused(self):
        with self.assertRaisesRegex(ValueError, "not meta"):
            AdamW([torch.nn.Parameter(torch.randn(2)),
                   torch.nn.Parameter(torch.randn(2, device="meta"))],
                  address=self.daemon.address)


if __name__ == "__main__":
    unittest.main()
