"""optimd.torch.AdamW side by side with torch.optim.AdamW where a training
script touches what torch's optimizer leaves to it: gradient tensors the
trainer owns, zero_grad over edited param_groups, parameter memory shared
with other tensors. Each test runs the same script through both and asserts
the same result (or the same exception).

The real daemon (CPU backend) over its socket, real shared memory.
"""
import copy
import functools
import os
import tempfile
import unittest

import torch

from optimd import errors
from optimd._grads import GradRouter
from optimd._names import torch_takes_names
from optimd.testing import Daemon, DaemonTestCase
from optimd.torch import SGD, Adam, AdamW

# OPTIMD_TEST_DEVICE=cuda runs the tests on CUDA tensors and the daemon's
# CUDA backend (GPU machine: tools/gpu_test.sh); the CPU backend's own
# (shared memory between processes) are skipped there.
DEVICE = torch.device(os.environ.get("OPTIMD_TEST_DEVICE", "cpu"))
cpu_only = unittest.skipIf(DEVICE.type != "cpu", "CPU shared memory")

os.environ.setdefault("OPTIMD_SECRETS_DIR",
                      tempfile.mkdtemp(prefix="optimd-secrets-"))

# Per step, AdamW's numerics agree with torch's to float32 rounding.
TOL = dict(rtol=1e-5, atol=1e-6)


def one_param(*shape):
    """make_params for DropIn.both: one parameter of `shape`."""
    return lambda: [torch.nn.Parameter(torch.randn(*shape))]


class DropIn(DaemonTestCase):
    @classmethod
    def setUpClass(cls):
        cls.daemon = Daemon(backend=DEVICE.type)

    def both(self, make_params, **kw):
        """(ours, theirs): optimd's and torch's AdamW, each over its own
        copy of make_params()'s parameters (the same values), on DEVICE."""
        copies = []
        for _ in range(2):
            torch.manual_seed(0)
            with torch.device(DEVICE) if hasattr(torch, "get_default_device") \
                    else _cpu():
                copies.append(make_params())
        opt = AdamW(copies[0], address=self.daemon.address, **kw)
        self.opts.append(opt)
        return opt, torch.optim.AdamW(copies[1], **kw)

    def assert_same(self, opt, ref):
        for g, h in zip(opt.param_groups, ref.param_groups):
            for p, q in zip(g["params"], h["params"]):
                torch.testing.assert_close(p.detach(), q.detach(), **TOL)

    def test_a_loaded_group_without_an_option_takes_torchs_value(self):
        # An older torch's state dict lacks options added since (maximize,
        # nesterov...): torch's load gives them its own defaults, not the
        # values the optimizer was made with.
        for kw, cls in ((dict(maximize=True), None),
                        (dict(momentum=0.9, nesterov=True), "SGD")):
            made = []
            for c in ((SGD, torch.optim.SGD) if cls else
                      (AdamW, torch.optim.AdamW)):
                torch.manual_seed(0)
                p = torch.nn.Parameter(torch.randn(5))
                extra = dict(address=self.daemon.address) \
                    if c.__module__.startswith("optimd") else {}
                o = c([p], lr=0.1, **kw, **extra)
                if extra:
                    self.opts.append(o)
                made.append((o, p))
            saved = made[1][0].state_dict()
            key = next(iter(kw.keys() - {"momentum"}))
            del saved["param_groups"][0][key]
            for o, p in made:
                o.load_state_dict(copy.deepcopy(saved))
                p.grad = torch.ones(5)
                o.step()
            self.assertEqual(made[0][0].param_groups[0][key],
                             made[1][0].param_groups[0][key])
            torch.testing.assert_close(made[0][1].detach(),
                                       made[1][1].detach(), **TOL)

    def test_defaults_are_torchs_values_and_types(self):
        # torch's defaults as its constructors give them (weight_decay 0,
        # an int, for Adam and SGD): code that prints or compares configs
        # sees the same.
        p = torch.nn.Parameter(torch.zeros(2))
        for ours, theirs, kw in ((Adam, torch.optim.Adam, {}),
                                 (AdamW, torch.optim.AdamW, {}),
                                 (SGD, torch.optim.SGD, dict(lr=0.1))):
            o = ours([p], address=self.daemon.address, **kw)
            self.opts.append(o)
            t = theirs([p], **kw)
            for k, v in t.defaults.items():
                self.assertIn(k, o.defaults)
                self.assertEqual((o.defaults[k], type(o.defaults[k])),
                                 (v, type(v)), (ours.__name__, k))

    def test_a_backward_through_a_graph_from_before_the_step_fails(self):
        # torch's step writes the parameters in place, which autograd
        # counts: a backward through a graph that saved a parameter before
        # the step raises instead of using the new values (a GAN's
        # generator loss through the discriminator just stepped). The
        # daemon's writes move that count too; a parameter without a
        # gradient is not stepped and keeps its count.
        for o in self.both(lambda: [torch.nn.Parameter(torch.randn(3)),
                                    torch.nn.Parameter(torch.randn(3))]):
            w, idle = o.param_groups[0]["params"]
            (w * w).sum().backward()
            kept = (w * w).sum()  # saves w
            idle_count = idle._version
            o.step()
            self.assertEqual(idle._version, idle_count, type(o))
            with self.assertRaisesRegex(RuntimeError, "inplace operation"):
                kept.backward()
            o.step()  # and again with the same gradients

    def test_gradients_in_a_buffer_of_the_trainers_stay_there(self):
        # A trainer that keeps every gradient in one flat buffer of its own
        # (p.grad = a view of it) and clears that buffer itself.
        shapes = [(4, 3), (5,), (2, 2)]

        def params():
            return [torch.nn.Parameter(torch.randn(s)) for s in shapes]

        opt, ref = self.both(params, lr=1e-2, weight_decay=0.1)
        runs = []
        for o in (opt, ref):
            ps = o.param_groups[0]["params"]
            flat = torch.zeros(sum(p.numel() for p in ps), device=DEVICE)
            offset = 0
            for p in ps:
                p.grad = flat[offset:offset + p.numel()].view_as(p)
                offset += p.numel()
            runs.append((o, ps, flat))
        for step in range(4):
            for o, ps, flat in runs:
                flat.zero_()
                torch.manual_seed(step)
                sum((p * torch.randn(p.shape, device=DEVICE)).sum()
                    for p in ps).backward()
                o.step()
                # The gradients are still views of the trainer's buffer.
                self.assertEqual(ps[1].grad.data_ptr(),
                                 flat.data_ptr() + 12 * 4)
        self.assert_same(opt, ref)
        torch.testing.assert_close(runs[0][2], runs[1][2])

    @cpu_only
    def test_autograds_own_gradients_are_taken_into_shared_memory(self):
        # What autograd made and nobody holds becomes the tensor's view of
        # the shared gradient segment: later backwards accumulate there and
        # the step copies nothing (the CPU backend's fast path).
        params = one_param(5, 2)

        opt, ref = self.both(params, lr=1e-2)
        p = opt.param_groups[0]["params"][0]
        for _ in range(2):
            for o in (opt, ref):
                (o.param_groups[0]["params"][0] ** 2).sum().backward()
                o.step()
                o.zero_grad(set_to_none=False)
            self.assertEqual(p.grad.data_ptr(),
                             opt._groups[0]["tensors"][0].gview.data_ptr())
        self.assert_same(opt, ref)

    def test_a_gradient_the_trainer_keeps_is_zeroed_in_place(self):
        params = one_param(6)

        opt, ref = self.both(params, lr=1e-2)
        held = []
        for o in (opt, ref):
            p = o.param_groups[0]["params"][0]
            p.grad = torch.ones(6, device=DEVICE)
            held.append(p.grad)
            o.step()
            o.zero_grad(set_to_none=False)
            self.assertIs(p.grad, held[-1])
        torch.testing.assert_close(held[0], torch.zeros(6, device=DEVICE))
        self.assert_same(opt, ref)

    def test_detach_and_zero_a_gradient_as_in_torch(self):
        # Older training loops clear gradients by hand.
        params = one_param(3, 3)

        opt, ref = self.both(params, lr=1e-2)
        for o in (opt, ref):
            p = o.param_groups[0]["params"][0]
            for _ in range(3):
                (p * p).sum().backward()
                o.step()
                o.zero_grad(set_to_none=False)
                p.grad.detach_()
                p.grad.zero_()
        self.assert_same(opt, ref)

    def test_zero_grad_acts_on_the_param_groups_as_they_are_now(self):
        def params():
            return [torch.nn.Parameter(torch.randn(4)) for _ in range(3)]

        opt, ref = self.both(params, lr=1e-2)
        for set_to_none in (True, False):
            seen = []
            for o in (opt, ref):
                ps = o.param_groups[0]["params"]
                for p in ps:
                    p.grad = torch.ones(4, device=DEVICE)
                o.step()
                removed = ps.pop()  # taken out of the group
                added = torch.nn.Parameter(torch.ones(2, device=DEVICE))
                added.grad = torch.ones(2, device=DEVICE)
                ps.append(added)
                o.zero_grad(set_to_none=set_to_none)
                seen.append([None if p.grad is None else p.grad.tolist()
                             for p in (ps[0], removed, added)])
                ps.pop()
                ps.append(removed)
            self.assertEqual(seen[0], seen[1], set_to_none)

    def test_parameters_that_are_views_of_a_flat_buffer_stay_views(self):
        # Parameters over one flat buffer of the trainer's (as contiguous
        # parameter buffers are built): the buffer sees every step.
        flats = []

        def params():
            flat = torch.randn(20)
            flats.append(flat)
            return [torch.nn.Parameter(flat[0:12].view(3, 4)),
                    torch.nn.Parameter(flat[12:20])]

        opt, ref = self.both(params, lr=1e-2, weight_decay=0.1)
        for step in range(3):
            for o in (opt, ref):
                torch.manual_seed(step)
                for p in o.param_groups[0]["params"]:
                    p.grad = torch.randn(p.shape, device=DEVICE)
                o.step()
        self.assert_same(opt, ref)
        torch.testing.assert_close(flats[0], flats[1], **TOL)
        ours = opt.param_groups[0]["params"]
        self.assertEqual(ours[1].data_ptr(), flats[0].data_ptr() + 48)

    def test_weights_tied_through_data_stay_tied(self):
        # torch steps w, then v from w's new values (each with its own
        # gradient and state); the daemon updates them in that order too,
        # also where its threads or thread blocks would otherwise meet.
        # torch's for-loop step is the reference: its foreach step (the
        # default on CUDA) updates both in one kernel over one memory,
        # whose blocks race.
        for shape in ((4, 4), (512, 300)):
            def params():
                w = torch.nn.Parameter(torch.randn(*shape))
                v = torch.nn.Parameter(torch.empty(*shape))
                v.data = w.data
                return [w, v]

            opt, ref = self.both(params, lr=1e-2, foreach=False)
            for step in range(3):
                for o in (opt, ref):
                    torch.manual_seed(step)
                    for p in o.param_groups[0]["params"]:
                        p.grad = torch.randn(p.shape, device=DEVICE)
                    o.step()
            w, v = opt.param_groups[0]["params"]
            self.assertEqual(w.data_ptr(), v.data_ptr())
            self.assert_same(opt, ref)

    @unittest.skipUnless(DEVICE.type == "cuda", "overlap is for CUDA")
    def test_overlap_refuses_tied_weights_and_views_with_gaps(self):
        w = torch.nn.Parameter(torch.randn(4, 4, device=DEVICE))
        v = torch.nn.Parameter(torch.empty(4, 4, device=DEVICE))
        v.data = w.data
        with self.assertRaisesRegex(NotImplementedError, "one memory"):
            AdamW([("w", w), ("v", v)], overlap=True,
                  address=self.daemon.address)
        gappy = torch.nn.Parameter(torch.randn(4, 6, device=DEVICE)[:, ::2])
        with self.assertRaisesRegex(NotImplementedError, "gaps"):
            AdamW([("gappy", gappy)], overlap=True,
                  address=self.daemon.address)

    @cpu_only
    def test_share_memory_after_construction_is_followed_or_refused(self):
        params = one_param(8)

        strategy = torch.multiprocessing.get_sharing_strategy()
        self.addCleanup(torch.multiprocessing.set_sharing_strategy, strategy)
        # torch's default: memory only file descriptors reach.
        torch.multiprocessing.set_sharing_strategy("file_descriptor")
        opt, ref = self.both(params, lr=1e-2)
        p = opt.param_groups[0]["params"][0]
        p.grad = torch.ones(8)
        p.share_memory_()
        with self.assertRaisesRegex(RuntimeError, "file_system"):
            opt.step()
        # Shared so before construction: refused by the constructor.
        shared = torch.nn.Parameter(torch.randn(8))
        shared.share_memory_()
        with self.assertRaisesRegex(RuntimeError, "file_system"):
            AdamW([shared], address=self.daemon.address)
        # With named shared memory the daemon steps it where it is now.
        torch.multiprocessing.set_sharing_strategy("file_system")
        opt, ref = self.both(params, lr=1e-2)
        for o in (opt, ref):
            q = o.param_groups[0]["params"][0]
            q.grad = torch.ones(8)
            o.step()
            q.share_memory_()
            q.grad = torch.ones(8)
            o.step()
        self.assert_same(opt, ref)

    def test_a_schedule_below_zero_steps_as_torch(self):
        # A lambda past its end: the learning rate goes negative and
        # torch's step ascends.
        params = one_param(5)

        opt, ref = self.both(params, lr=1e-2)
        for o in (opt, ref):
            sched = torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1 - s)
            p = o.param_groups[0]["params"][0]
            for step in range(4):
                torch.manual_seed(step)
                p.grad = torch.randn(5, device=DEVICE)
                o.step()
                sched.step()
            self.assertLess(o.param_groups[0]["lr"], 0)
        self.assert_same(opt, ref)

    def test_views_with_gaps_are_stepped_where_they_are(self):
        # Every other column of a buffer of the trainer's: torch steps the
        # view in place, strides and all, and the buffer sees it; so does
        # optimd (the daemon steps a dense copy, copied back each step),
        # given at construction or appended to a group later.
        bases = [torch.randn(4, 6, device=DEVICE)]
        bases.append(bases[0].clone())
        views = [torch.nn.Parameter(b[:, ::2]) for b in bases]
        extra = [torch.nn.Parameter(b[1:, 1::2]) for b in bases]
        plain = [torch.nn.Parameter(torch.ones(3, device=DEVICE))
                 for _ in range(2)]
        opt = AdamW([views[0], plain[0]], lr=1e-2,
                    address=self.daemon.address)
        self.opts.append(opt)
        ref = torch.optim.AdamW([views[1], plain[1]], lr=1e-2)
        for step in range(4):
            if step == 2:
                opt.param_groups[0]["params"].append(extra[0])
                ref.param_groups[0]["params"].append(extra[1])
            for o in (opt, ref):
                torch.manual_seed(step)
                for p in o.param_groups[0]["params"]:
                    p.grad = torch.randn(p.shape, device=DEVICE)
                o.step()
        self.assertEqual(views[0].stride(), (6, 2))
        self.assertEqual(views[0].data_ptr(), bases[0].data_ptr())
        torch.testing.assert_close(bases[0], bases[1], **TOL)
        self.assert_same(opt, ref)
        torch.testing.assert_close(opt.state[views[0]]["exp_avg"],
                                   ref.state[views[1]]["exp_avg"], **TOL)

    def test_a_group_taken_out_of_param_groups_is_no_longer_stepped(self):
        # `del opt.param_groups[0]`: torch steps the groups left; the
        # parameters of the one taken out keep their state for a return.
        def params():
            return [torch.nn.Parameter(torch.randn(3)) for _ in range(3)]

        opt, ref = self.both(params, lr=1e-2)
        every = {o: list(o.param_groups[0]["params"]) for o in (opt, ref)}
        for o in (opt, ref):
            o.param_groups[0]["params"] = every[o][:2]
            o.add_param_group({"params": every[o][2:], "lr": 3e-2})
        for step in range(5):
            for o in (opt, ref):
                if step == 2:
                    del o.param_groups[0]
                if step == 4:
                    o.add_param_group({"params": [every[o][0]]})
                for p in every[o]:
                    p.grad = torch.full_like(p, 0.5 + step)
                o.step()
        for p, q in zip(every[opt], every[ref]):
            torch.testing.assert_close(p.detach(), q.detach(), **TOL)
        torch.testing.assert_close(opt.state[every[opt][0]]["exp_avg"],
                                   ref.state[every[ref][0]]["exp_avg"],
                                   **TOL)
        # Taken out and another added before any step: the same.
        for o in (opt, ref):
            del o.param_groups[0]
            o.add_param_group({"params": [every[o][1]], "lr": 2e-2})
            for p in every[o]:
                p.grad = torch.full_like(p, -1.0)
            o.step()
        for p, q in zip(every[opt], every[ref]):
            torch.testing.assert_close(p.detach(), q.detach(), **TOL)

    def test_a_parameter_resized_after_steps_raises_as_in_torch(self):
        # p.data = torch.cat(...) once p has state: torch's step raises
        # RuntimeError (its moments of the old size); so does ours.
        opt, ref = self.both(one_param(3, 4), lr=1e-2)
        for o in (opt, ref):
            p = o.param_groups[0]["params"][0]
            p.grad = torch.ones_like(p)
            o.step()
            p.data = torch.cat([p.data, p.data])
            p.grad = torch.ones_like(p)
            with self.assertRaises(RuntimeError):
                o.step()

    def test_state_of_another_shape_raises_and_loads_nothing(self):
        params = one_param(4, 3)

        opt, ref = self.both(params, lr=1e-2)
        for o in (opt, ref):
            o.param_groups[0]["params"][0].grad = torch.ones(
                4, 3, device=DEVICE)
            o.step()
        # Copies: torch's load keeps the given step tensors and its step
        # counts them up in place.
        before = copy.deepcopy(opt.state_dict())
        ref_before = copy.deepcopy(ref.state_dict())
        for shape in ((3, 4), (5, 3), (2, 3)):
            for o in (opt, ref):
                sd = o.state_dict()
                sd["state"][0]["exp_avg"] = torch.zeros(shape, device=DEVICE)
                if o is opt:
                    with self.assertRaisesRegex(RuntimeError, "shape"):
                        o.load_state_dict(sd)
                else:
                    # torch takes it, and its next step fails on the shapes.
                    o.load_state_dict(sd)
                    o.param_groups[0]["params"][0].grad = torch.ones(
                        4, 3, device=DEVICE)
                    with self.assertRaises(RuntimeError):
                        o.step()
            ref.load_state_dict(copy.deepcopy(ref_before))
        after = opt.state_dict()
        torch.testing.assert_close(after["state"], before["state"])

    def test_keys_of_the_trainers_own_in_state_stay(self):
        # Libraries keep counters of their own in optimizer.state[p].
        def params():
            return [torch.nn.Parameter(torch.randn(3)),
                    torch.nn.Parameter(torch.randn(2))]

        opt, ref = self.both(params, lr=1e-2)
        seen = []
        for o in (opt, ref):
            p, q = o.param_groups[0]["params"]
            p.grad = torch.ones(3, device=DEVICE)
            o.step()
            o.state[p]["calls"] = 1
            o.state[q]["note"] = 7  # torch 1.13 loads no str values
            p.grad = torch.ones(3, device=DEVICE)
            o.step()
            o.state[p]["calls"] += 1
            note = o.state[q]["note"], o.state_dict()["state"][1]["note"]
            # torch 2 loads no entry without "step": q's goes first.
            del o.state[q]
            sd = o.state_dict()
            o.load_state_dict(sd)
            o.step()
            seen.append((o.state[p]["calls"], sd["state"][0]["calls"]) +
                        note)
        self.assertEqual(seen[0], seen[1])
        self.assertEqual(seen[0], (2, 2, 7, 7))
        self.assert_same(opt, ref)

    def test_state_under_keys_that_are_no_parameters_stays(self):
        # torch's optimizer.state takes any key, and its load keeps an
        # entry of an index no group holds under that index; state_dict()
        # gives both back.
        opt, ref = self.both(one_param(3), lr=1e-2)
        seen = []
        for o in (opt, ref):
            p = o.param_groups[0]["params"][0]
            p.grad = torch.ones(3, device=DEVICE)
            o.step()
            o.state["schedule"] = {"warmup": 5}
            p.grad = torch.ones(3, device=DEVICE)
            o.step()
            sd = o.state_dict()
            state = dict(sd["state"])
            state[9] = {k: v.clone() for k, v in sd["state"][0].items()}
            o.load_state_dict(dict(sd, state=state))
            p.grad = torch.ones(3, device=DEVICE)
            o.step()
            sd = o.state_dict()
            seen.append((sd["state"]["schedule"], o.state["schedule"],
                         sorted(sd["state"][9]),
                         float(sd["state"][9]["step"]),
                         float(sd["state"][0]["step"])))
        self.assertEqual(seen[0], seen[1])
        self.assertEqual(seen[0][0], {"warmup": 5})
        self.assertEqual(seen[0][3:], (2.0, 3.0))
        self.assert_same(opt, ref)

    def test_a_loaded_steps_dtype_stays(self):
        # torch's load leaves the step of a group without fused or
        # capturable as it was (an int64 count from a hand-made or older
        # state dict), and its steps count on in that dtype.
        opt, ref = self.both(one_param(3), lr=1e-2, foreach=False)
        seen = []
        for o in (opt, ref):
            p = o.param_groups[0]["params"][0]
            p.grad = torch.ones(3, device=DEVICE)
            o.step()
            sd = o.state_dict()
            sd["state"][0]["step"] = torch.tensor(1, dtype=torch.int64)
            o.load_state_dict(sd)
            p.grad = torch.ones(3, device=DEVICE)
            o.step()
            step = o.state_dict()["state"][0]["step"]
            seen.append((step.dtype, int(step), o.state[p]["step"].dtype))
        self.assertEqual(seen[0], seen[1])
        self.assertEqual(seen[0], (torch.int64, 2, torch.int64))
        self.assert_same(opt, ref)

    def test_a_schedulers_state_dict_saves_and_loads(self):
        # torch 1.13's OneCycleLR keeps a bound method in its state dict,
        # which pickles the optimizer along.
        import io

        params = one_param(4)

        opt, ref = self.both(params, lr=1e-2)
        lrs = []
        for o in (opt, ref):
            sched = torch.optim.lr_scheduler.OneCycleLR(
                o, max_lr=0.1, total_steps=10)
            p = o.param_groups[0]["params"][0]
            for _ in range(3):
                p.grad = torch.ones(4, device=DEVICE)
                o.step()
                sched.step()
            buf = io.BytesIO()
            torch.save(sched.state_dict(), buf)
            buf.seek(0)
            again = torch.optim.lr_scheduler.OneCycleLR(
                o, max_lr=0.1, total_steps=10)
            again.load_state_dict(torch.load(buf))
            p.grad = torch.ones(4, device=DEVICE)
            o.step()
            again.step()
            lrs.append(o.param_groups[0]["lr"])
        self.assertEqual(lrs[0], lrs[1])
        self.assert_same(opt, ref)

    @unittest.skipUnless(hasattr(torch.optim.Optimizer,
                                 "register_state_dict_pre_hook"),
                         "torch 2's optimizer hooks")
    def test_step_and_state_dict_hooks_run_as_torch_runs_them(self):
        # Step hooks, state_dict hooks (the post-hook's result is what
        # state_dict returns) and load hooks (the pre-hook's result is what
        # is loaded: here the lr it sets), each called once, in order.
        opt, ref = self.both(one_param(4), lr=1e-2)
        runs = []
        for o in (opt, ref):
            calls = []
            o.register_step_pre_hook(
                lambda o_, a, k: calls.append("step pre"))
            o.register_step_post_hook(
                lambda o_, a, k: calls.append("step post"))
            o.register_state_dict_pre_hook(
                lambda o_: calls.append("sd pre"))

            def post(o_, sd):
                calls.append("sd post")
                return dict(sd, extra="kept")
            o.register_state_dict_post_hook(post)

            def load_pre(o_, sd):
                calls.append("load pre")
                groups = [dict(g, lr=0.5) for g in sd["param_groups"]]
                return dict(sd, param_groups=groups)
            o.register_load_state_dict_pre_hook(load_pre)
            o.register_load_state_dict_post_hook(
                lambda o_: calls.append("load post"))
            p = o.param_groups[0]["params"][0]
            p.grad = torch.ones(4, device=DEVICE)
            o.step()
            sd = o.state_dict()
            self.assertEqual(sd["extra"], "kept")
            o.load_state_dict(sd)
            p.grad = torch.ones(4, device=DEVICE)
            o.step()
            runs.append((calls, o.param_groups[0]["lr"]))
        self.assertEqual(runs[0], runs[1])
        self.assertEqual(runs[1][1], 0.5)
        self.assert_same(opt, ref)

    def test_torchs_schedulers_and_averaging_train_as_torch(self):
        # What a script puts around the optimizer: ReduceLROnPlateau,
        # SequentialLR over a warm-up and warm restarts, SWA's averaged
        # model and SWALR, an lr given as a tensor: the same lrs and weights.
        sched = torch.optim.lr_scheduler
        setups = {
            "plateau": lambda o: sched.ReduceLROnPlateau(
                o, patience=0, factor=0.5),
            "sequential": lambda o: sched.SequentialLR(o, [
                sched.LinearLR(o, 0.1, total_iters=2),
                sched.CosineAnnealingWarmRestarts(o, 2)], milestones=[2]),
            "swa": lambda o: torch.optim.swa_utils.SWALR(o, swa_lr=0.05),
            "tensor lr": None,
        }
        for name, setup in setups.items():
            with self.subTest(name):
                lr = torch.tensor(1e-2) if setup is None else 1e-2
                opt, ref = self.both(one_param(3, 4), lr=lr)
                runs = []
                for o in (opt, ref):
                    s = setup(o) if setup else None
                    p = o.param_groups[0]["params"][0]
                    avg = torch.optim.swa_utils.AveragedModel(
                        torch.nn.ParameterList([p]))
                    for i in range(5):
                        p.grad = torch.full_like(p, 0.5 - 0.2 * i)
                        o.step()
                        avg.update_parameters(torch.nn.ParameterList([p]))
                        if name == "plateau":
                            s.step(1.0)
                        elif s is not None:
                            s.step()
                    runs.append((float(o.param_groups[0]["lr"]),
                                 next(avg.parameters()).detach().clone()))
                self.assertEqual(runs[0][0], runs[1][0])
                torch.testing.assert_close(runs[0][1], runs[1][1], **TOL)
                self.assert_same(opt, ref)

    def test_state_read_before_a_first_step_stays_an_empty_entry(self):
        # torch's state is a defaultdict: reading opt.state[q] for a
        # parameter not stepped yet leaves {} there, in len(state) and in
        # state_dict(), across steps of the others.
        def params():
            return [torch.nn.Parameter(torch.randn(3)) for _ in range(2)]
        opt, ref = self.both(params, lr=1e-2)
        runs = []
        for o in (opt, ref):
            p, q = o.param_groups[0]["params"]
            self.assertEqual(o.state[q], {})
            p.grad = torch.ones(3, device=DEVICE)
            o.step()
            runs.append((len(o.state), q in o.state, sorted(
                (i, sorted(e)) for i, e in o.state_dict()["state"].items())))
        self.assertEqual(runs[0], runs[1])
        self.assertEqual(runs[1][2][1], (1, []))

    def test_state_read_after_a_step_of_another_stays_an_empty_entry(self):
        # Read once another parameter has stepped (the state fetched), in
        # the same group and in a group added after the step: {} is in
        # len(state) and in state_dict(), as in torch's.
        for added in (False, True):
            def params():
                return [torch.nn.Parameter(torch.randn(3)) for _ in range(2)]
            opt, ref = self.both(params, lr=1e-2)
            runs = []
            for o in (opt, ref):
                p, q = o.param_groups[0]["params"]
                if added:
                    o.param_groups[0]["params"] = [p]
                p.grad = torch.ones(3, device=DEVICE)
                o.step()
                if added:
                    o.add_param_group({"params": [q]})
                self.assertEqual(o.state[q], {})
                runs.append((len(o.state), q in o.state,
                             o.state_dict()["state"].get(1)))
            self.assertEqual(runs[0], runs[1])
            self.assertEqual(runs[0][2], {})

    def test_a_state_entry_missing_a_key_raises_at_the_step_as_torch(self):
        # A step alone before the first step, or a moment or the step
        # deleted after steps: torch's step raises KeyError and changes
        # nothing; so does optimd's (MissingStateError), every step until
        # the entry is whole again or emptied, which starts it afresh.
        def set_step(o, p):
            o.state[p]["step"] = torch.tensor(10.0)

        def deleter(key):
            return lambda o, p: o.state[p].pop(key)

        # state_dict() and load_state_dict() do not raise on it, and a
        # good state dict loaded makes the state whole again.
        for edit, steps in ((set_step, 0), (deleter("exp_avg_sq"), 2),
                            (deleter("exp_avg"), 2), (deleter("step"), 2)):
            for recover in ("empty", "load"):
                opt, ref = self.both(one_param(4), lr=0.1)
                for o in (opt, ref):
                    p = o.param_groups[0]["params"][0]
                    for _ in range(steps):
                        p.grad = torch.ones(4, device=DEVICE)
                        o.step()
                    good = copy.deepcopy(o.state_dict())
                    edit(o, p)
                    before = p.detach().clone()
                    p.grad = torch.ones(4, device=DEVICE)
                    for _ in range(2):
                        with self.assertRaises(KeyError):
                            o.step()
                    self.assertTrue(torch.equal(p.detach(), before))
                    if recover == "empty":
                        o.state[p] = {}
                    else:
                        o.state_dict()
                        o.load_state_dict(good)
                    o.step()
                self.assert_same(opt, ref)

    def test_copies_raise_and_a_pickled_optimizer_holds_nothing(self):
        import pickle

        opt, _ = self.both(one_param(2))
        for how in (copy.copy, copy.deepcopy):
            with self.assertRaisesRegex(TypeError, "load_state_dict"):
                how(opt)
        stand_in = pickle.loads(pickle.dumps(opt))
        with self.assertRaisesRegex(AttributeError, "no daemon session"):
            stand_in.step()

    def test_sgd_steps_sparse_gradients_as_torch(self):
        for momentum in (0.0, 0.9):
            models = []
            for make in (lambda ps: SGD(ps, lr=0.1, momentum=momentum,
                                        address=self.daemon.address),
                         lambda ps: torch.optim.SGD(ps, lr=0.1,
                                                    momentum=momentum)):
                torch.manual_seed(0)
                emb = torch.nn.Embedding(10, 3, sparse=True).to(DEVICE)
                opt = make(list(emb.parameters()))
                for ids in ([1, 2, 2], [3, 1], [7]):
                    opt.zero_grad()
                    emb(torch.tensor(ids, device=DEVICE)).pow(2).sum() \
                        .backward()
                    self.assertTrue(emb.weight.grad.is_sparse)
                    opt.step()
                models.append(emb.weight.detach())
                if isinstance(opt, SGD):
                    opt.close()
            torch.testing.assert_close(models[0], models[1], **TOL)

    def _twins(self, make, steps, **kw):
        """Runs `steps(opt)` for optimd's and torch's AdamW over twin
        copies of make()'s parameters; returns what each run gave."""
        opt, ref = self.both(make, lr=1e-2, **kw)
        return opt, ref, [steps(o) for o in (opt, ref)]

    def test_lazy_parameters_load_state_and_zero_as_torch(self):
        # A lazy module's state loaded before its first forward, and
        # zero_grad(set_to_none=False) once its parameters exist.
        def make():
            return list(torch.nn.LazyLinear(2).to(DEVICE).parameters())

        def steps(o):
            ps = o.param_groups[0]["params"]
            sd = o.state_dict()
            for i, shape in enumerate(((2, 3), (2,))):
                sd["state"][i] = {"step": torch.tensor(3.0),
                                  "exp_avg": torch.full(shape, 0.1),
                                  "exp_avg_sq": torch.full(shape, 0.2)}
            o.load_state_dict(sd)
            w, b = ps
            w.materialize((2, 3))
            b.materialize((2,))
            with torch.no_grad():
                w.fill_(0.5)
                b.fill_(0.1)
            (w.sum() + b.sum()).backward()
            o.zero_grad(set_to_none=False)
            return [p.grad.abs().sum().item() for p in ps]

        _, _, (ours, theirs) = self._twins(make, steps)
        self.assertEqual(ours, theirs)

    def test_state_dicts_torch_loads_with_keys_of_other_shapes(self):
        # A step of shape (1,) (torch 1.13/2.0 capturable or fused) and a
        # key of the trainer's own of any shape load as in torch.
        make = one_param(4, 3)

        def steps(o):
            p = o.param_groups[0]["params"][0]
            p.grad = torch.ones(4, 3, device=DEVICE)
            o.step()
            sd = copy.deepcopy(o.state_dict())
            sd["state"][0]["step"] = torch.tensor([1.0])
            sd["state"][0]["row_stats"] = torch.zeros(4)
            o.load_state_dict(sd)
            return tuple(o.state[p]["row_stats"].shape)

        _, _, (ours, theirs) = self._twins(make, steps)
        self.assertEqual(ours, theirs)

    @unittest.skipUnless(DEVICE.type == "cuda",
                         "torch 1.13 fuses CUDA parameters only")
    def test_a_fused_groups_step_lives_where_torchs_fused_keeps_it(self):
        # torch's fused AdamW keeps each step as a float32 tensor on the
        # parameter's device; so does optimd's for a group with
        # fused=True (its own step is fused whatever the flag says).
        make = one_param(4, 3)

        def steps(o):
            p = o.param_groups[0]["params"][0]
            for _ in range(2):
                p.grad = torch.ones(4, 3, device=DEVICE)
                o.step()
            step = o.state[p]["step"]
            sd_step = o.state_dict()["state"][0]["step"]
            return (step.dtype, step.device, tuple(step.shape), step.item(),
                    sd_step.device)

        _, _, (ours, theirs) = self._twins(make, steps, fused=True)
        self.assertEqual(ours, theirs)

    def test_a_negative_lr_survives_a_group_registered_anew(self):
        make = one_param(3)

        def steps(o):
            sched = torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1 - s)
            p = o.param_groups[0]["params"][0]
            for _ in range(3):
                p.grad = torch.ones(3, device=DEVICE)
                o.step()
                sched.step()
            o.param_groups[0]["maximize"] = True  # registered anew
            p.grad = torch.ones(3, device=DEVICE)
            o.step()
            return o.param_groups[0]["lr"]

        opt, ref, (ours, theirs) = self._twins(make, steps)
        self.assertEqual(ours, theirs)
        self.assert_same(opt, ref)

    def test_a_gradient_of_other_strides_the_trainer_set_stays(self):
        def make():
            return [torch.nn.Parameter(torch.randn(3, 4).t())]

        def steps(o):
            p = o.param_groups[0]["params"][0]
            flat = torch.zeros(12, device=DEVICE)
            p.grad = flat.view(4, 3)
            for step in range(3):
                flat.zero_()
                (p * (step + 1)).sum().backward()
                o.step()
                self.assertEqual(p.grad.data_ptr(), flat.data_ptr())
            return flat.tolist()

        opt, ref, (ours, theirs) = self._twins(make, steps)
        self.assertEqual(ours, theirs)
        self.assert_same(opt, ref)

    def test_a_refused_step_leaves_the_next_steps_torchs(self):
        # A step the daemon refuses (here for its learning rate) still
        # leaves the daemon where the gradients are (one parameter had
        # none): the client sends only what moved since, and the next
        # steps are torch's on the same gradients without the refused one.
        opt, ref = self.both(lambda: [torch.nn.Parameter(torch.randn(6)),
                                      torch.nn.Parameter(torch.randn(4))],
                             lr=1e-2)
        a, b = opt.param_groups[0]["params"]
        a.grad, b.grad = torch.ones_like(a), torch.ones_like(b)
        opt.step()
        a.grad = None
        b.grad = torch.full_like(b, 2.0)
        opt.param_groups[0]["lr"] = float("nan")
        with self.assertRaisesRegex(errors.InvalidArgumentError,
                                    "learning rate"):
            opt.step()
            opt.synchronize()
        opt.param_groups[0]["lr"] = 1e-2
        for step, scale in enumerate((3.0, 4.0)):
            # ref skips the refused step; a has no gradient at the first.
            for o in (opt, ref) if step else (opt,):
                ps = o.param_groups[0]["params"]
                ps[0].grad = None if not step else torch.full_like(ps[0],
                                                                   scale)
                ps[1].grad = torch.full_like(ps[1], scale)
            if not step:
                ra, rb = ref.param_groups[0]["params"]
                ra.grad, rb.grad = torch.ones_like(ra), torch.ones_like(rb)
                ref.step()
                ra.grad, rb.grad = None, torch.full_like(rb, scale)
            opt.step()
            ref.step()
        opt.synchronize()
        self.assert_same(opt, ref)

    def test_a_step_refused_before_it_runs_leaves_the_next_steps_torchs(self):
        # A step refused for its options before the session runs it (here
        # its grad_scale) still tells the daemon where the gradients are
        # (one parameter had none): the parameter without a gradient is
        # not stepped with its old one at the next steps. Twice: the
        # client then tells the daemon every gradient again, and (with
        # that switched off) the daemon applied the refused step's buffer
        # updates; either keeps the steps torch's.
        for client_forgets in (True, False):
            with self.subTest(client_forgets=client_forgets):
                if not client_forgets:
                    self.patch(GradRouter, "forget", lambda router: None)
                self.refuse_a_step_by_its_options()

    def patch(self, owner, name, value):
        old = getattr(owner, name)
        setattr(owner, name, value)
        self.addCleanup(setattr, owner, name, old)

    def refuse_a_step_by_its_options(self):
        opt, ref = self.both(lambda: [torch.nn.Parameter(torch.randn(6)),
                                      torch.nn.Parameter(torch.randn(4))],
                             lr=1e-2)
        for o in (opt, ref):
            a, b = o.param_groups[0]["params"]
            a.grad, b.grad = torch.ones_like(a), torch.ones_like(b)
            o.step()
        a, b = opt.param_groups[0]["params"]
        a.grad, b.grad = None, torch.full_like(b, 2.0)
        opt.grad_scale = float("inf")
        with self.assertRaisesRegex(errors.InvalidArgumentError,
                                    "grad_scale"):
            opt.step()
            opt.synchronize()
        opt.grad_scale = None
        for scale in (3.0, 4.0):
            for o in (opt, ref):
                a, b = o.param_groups[0]["params"]
                a.grad, b.grad = None, torch.full_like(b, scale)
                o.step()
        opt.synchronize()
        self.assert_same(opt, ref)

    def test_a_gradient_kept_after_set_to_none_keeps_its_values(self):
        # A trainer that keeps each step's gradients (gradient noise
        # estimates, say).
        make = one_param(5)

        def steps(o):
            p = o.param_groups[0]["params"][0]
            kept = []
            for step in range(3):
                o.zero_grad(set_to_none=True)
                (p * (step + 1)).sum().backward()
                o.step()
                kept.append(p.grad)
            return [k.tolist() for k in kept]

        opt, ref, (ours, theirs) = self._twins(make, steps)
        self.assertEqual(ours, theirs)
        self.assert_same(opt, ref)

    @cpu_only
    def test_gradients_kept_every_step_renew_the_segment_once(self):
        # Keeping each step's gradients makes them the trainer's: the flat
        # gradient segment is made anew once, not at every step (each new
        # one is another mapping in the daemon).
        make = one_param(6)

        opt, ref = self.both(make, lr=1e-2)
        segments = set()
        results = []
        for o in (opt, ref):
            p = o.param_groups[0]["params"][0]
            kept = []
            for step in range(8):
                o.zero_grad(set_to_none=True)
                (p * (step + 1)).sum().backward()
                o.step()
                kept.append(p.grad)
                del kept[:-2]
                if o is opt:
                    segments.add(opt._groups[0]["segments"][1].name)
            results.append([k.tolist() for k in kept])
        self.assertEqual(results[0], results[1])
        self.assertLessEqual(len(segments), 2)
        self.assert_same(opt, ref)

    def test_a_kept_gradient_is_not_zeroed_with_the_others(self):
        def make():
            return [torch.nn.Parameter(torch.randn(2, 2)),
                    torch.nn.Parameter(torch.randn(2))]

        def steps(o):
            w, b = o.param_groups[0]["params"]
            kept = []
            for i in range(4):
                (w.sum() * 2 + b.sum() * (i + 1)).backward()
                o.step()
                kept.append(b.grad)
                b.grad = None
                if i % 2:
                    o.zero_grad(set_to_none=False)
            return [k.tolist() for k in kept]

        opt, ref, (ours, theirs) = self._twins(make, steps)
        self.assertEqual(ours, theirs)
        self.assert_same(opt, ref)

    def test_a_parameter_over_a_flat_buffer_given_new_memory(self):
        flats = []

        def make():
            flat = torch.randn(8)
            flats.append(flat)
            return [torch.nn.Parameter(flat[:4]),
                    torch.nn.Parameter(flat[4:])]

        def steps(o):
            a = o.param_groups[0]["params"][0]
            for p in o.param_groups[0]["params"]:
                p.grad = torch.ones(4, device=DEVICE)
            o.step()
            a.data = torch.zeros(4, device=DEVICE)  # the buffer is left
            o.step()
            return a.tolist()

        opt, ref, (ours, theirs) = self._twins(make, steps)
        self.assertEqual(ours, theirs)
        torch.testing.assert_close(flats[0], flats[1], **TOL)

    def stepped_once(self, params):
        """optimd's AdamW over `params`, stepped once (gradients of ones)."""
        opt = AdamW(params, lr=1e-2, address=self.daemon.address)
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()
        return opt

    def test_a_parameter_stepped_in_place_given_memory_in_another_order(self):
        # A parameter over a flat buffer (stepped where it is) given memory
        # of its shape whose elements lie in another order: its moments lie
        # in the order it was registered in, so following it would give
        # each element another's. Refused by name, with both layouts.
        flat = torch.randn(12, device=DEVICE)
        a = torch.nn.Parameter(flat[:6].view(2, 3))
        opt = self.stepped_once([a, torch.nn.Parameter(flat[6:])])
        a.data = a.detach().t().contiguous().t()  # strides (1, 2)
        with self.assertRaises(errors.ParameterChangedError) as cm:
            opt.step()
        self.assertIn("strides (1, 2)", str(cm.exception))
        self.assertIn("strides (3, 1)", str(cm.exception))
        opt.close()

    def test_parameters_stepped_in_place_tied_after_the_optimizer(self):
        # Two parameters over one flat buffer (stepped where they are), one
        # then given the other's memory: their update passes were planned
        # apart, so following it would update one memory twice at once.
        # Refused by name.
        flat = torch.randn(8, device=DEVICE)
        a, b = torch.nn.Parameter(flat[:4]), torch.nn.Parameter(flat[4:])
        opt = self.stepped_once([a, b])
        b.data = a.data
        with self.assertRaises(errors.ParameterChangedError) as cm:
            opt.step()
        self.assertIn("shares memory", str(cm.exception))
        opt.close()

    def test_state_of_a_parameter_appended_then_written_before_its_step(self):
        make = one_param(2)

        def steps(o):
            p = o.param_groups[0]["params"][0]
            p.grad = torch.ones(2, device=DEVICE)
            o.step()
            q = torch.nn.Parameter(torch.ones(2, device=DEVICE))
            o.param_groups[0]["params"].append(q)
            o.state[q] = {"step": torch.tensor(10.0),
                          "exp_avg": torch.full((2,), 0.5, device=DEVICE),
                          "exp_avg_sq": torch.full((2,), 0.25,
                                                   device=DEVICE),
                          "tag": 3}
            q.grad = torch.ones(2, device=DEVICE)
            o.step()
            out = (float(o.state[q]["step"]), o.state[q]["tag"], q.tolist())
            o.param_groups[0]["params"].pop()  # out, and back
            p.grad = torch.ones(2, device=DEVICE)
            o.step()
            o.param_groups[0]["params"].append(q)
            q.grad = torch.ones(2, device=DEVICE)
            o.step()
            return out + (o.state[q]["tag"], float(o.state[q]["step"]))

        _, _, (ours, theirs) = self._twins(make, steps)
        self.assertEqual(ours[:2] + ours[3:], theirs[:2] + theirs[3:])
        torch.testing.assert_close(ours[2], theirs[2], **TOL)

    @cpu_only
    def test_share_memory_after_construction_then_zero_grad(self):
        strategy = torch.multiprocessing.get_sharing_strategy()
        self.addCleanup(torch.multiprocessing.set_sharing_strategy, strategy)
        torch.multiprocessing.set_sharing_strategy("file_system")
        model = []

        def make():
            model.append(torch.nn.Linear(3, 1))
            return list(model[-1].parameters())

        def steps(o):
            m = model[0] if o is not steps.ref else model[1]
            x = torch.ones(2, 3)
            m(x).sum().backward()
            o.step()
            m.share_memory()
            o.zero_grad(set_to_none=False)
            m(x).sum().backward()
            o.step()
            return m.weight.grad.tolist()

        opt, ref = self.both(make, lr=1e-2)
        steps.ref = ref
        self.assertEqual(steps(opt), steps(ref))
        self.assert_same(opt, ref)

    @unittest.skipIf(not hasattr(torch._C, "_storage_Use_Count"),
                     "torch 1.13 cannot tell who else uses a storage")
    def test_a_view_of_a_gradient_the_trainer_keeps_stays_its(self):
        make = one_param(4)

        def steps(o):
            p = o.param_groups[0]["params"][0]
            (p * 2).sum().backward()
            k = p.grad.view(-1)
            for _ in range(3):
                k.mul_(0.5)
                o.step()
                o.zero_grad(set_to_none=False)
                (p * 2).sum().backward()
            return p.grad.tolist()

        opt, ref, (ours, theirs) = self._twins(make, steps)
        self.assertEqual(ours, theirs)
        self.assert_same(opt, ref)

    def _edit_state_then(self, edit, then):
        """One step each, `edit(opt, p)` of the state, `then(opt)`, and a
        step; returns what `then` gave for ours and torch's."""
        params = one_param(6)

        opt, ref = self.both(params, lr=1e-2)
        seen = []
        for o in (opt, ref):
            p = o.param_groups[0]["params"][0]
            p.grad = torch.ones(6, device=DEVICE)
            o.step()
            edit(o, p)
            seen.append(then(o))
            p.grad = torch.full((6,), 0.5, device=DEVICE)
            o.step()
        self.assert_same(opt, ref)
        return seen

    def test_a_state_write_shows_in_state_dict_before_the_step(self):
        def zero(o, p):
            o.state[p]["exp_avg"].zero_()
        ours, theirs = self._edit_state_then(
            zero, lambda o: o.state_dict()["state"][0]["exp_avg"].clone())
        torch.testing.assert_close(ours, theirs)
        self.assertEqual(ours.abs().sum().item(), 0.0)

    def test_state_cleared_then_state_dict_then_step(self):
        ours, theirs = self._edit_state_then(
            lambda o, p: o.state.clear(),
            lambda o: dict(o.state_dict()["state"]))
        self.assertEqual(ours, theirs)

    def test_a_state_write_with_a_group_key_that_reregisters(self):
        # maximize is registered with the group: the edit re-registers it,
        # carrying the written state over.
        def zero_and_maximize(o, p):
            o.state[p]["exp_avg"].zero_()
            o.param_groups[0]["maximize"] = True
        self._edit_state_then(zero_and_maximize, lambda o: None)

    @cpu_only
    def test_hogwild_workers_step_the_shared_model(self):
        # torch's Hogwild recipe: the model in shared memory, an optimizer
        # in each worker process; the parent's model sees their steps.
        strategy = torch.multiprocessing.get_sharing_strategy()
        self.addCleanup(torch.multiprocessing.set_sharing_strategy, strategy)
        torch.multiprocessing.set_sharing_strategy("file_system")
        results = []
        for use_optimd in (True, False):
            torch.manual_seed(0)
            model = torch.nn.Linear(3, 2)
            model.share_memory()
            ctx = torch.multiprocessing.get_context("spawn")
            worker = ctx.Process(target=_hogwild_worker, args=(
                model, self.daemon.address if use_optimd else None))
            worker.start()
            worker.join(120)
            self.assertEqual(worker.exitcode, 0)
            results.append([p.detach().clone() for p in model.parameters()])
        for a, b in zip(*results):
            torch.testing.assert_close(a, b, **TOL)
        torch.manual_seed(0)
        initial = torch.nn.Linear(3, 2).weight.detach()
        self.assertFalse(torch.equal(results[0][0], initial))


    def test_a_slot_turned_off_and_on_again_resumes_as_in_torch(self):
        # torch's step leaves a slot it stops using in the state (SGD's
        # momentum_buffer at momentum 0, max_exp_avg_sq with amsgrad off),
        # where state_dict() shows it, and takes it up again when the
        # option comes back on.
        cases = {"momentum": (SGD, torch.optim.SGD, 0.9, 0.0),
                 "amsgrad": (AdamW, torch.optim.AdamW, True, False)}
        for key, (ours, theirs, on, off) in cases.items():
            with self.subTest(key):
                runs = []
                for make in (functools.partial(
                        ours, address=self.daemon.address), theirs):
                    torch.manual_seed(0)
                    p = torch.nn.Parameter(torch.randn(4, 3, device=DEVICE))
                    o = make([p], lr=0.1, **{key: on})
                    if make is not theirs:
                        self.opts.append(o)
                    for step in range(8):
                        if step in (3, 5):
                            o.param_groups[0][key] = off if step == 3 else on
                        p.grad = torch.randn(4, 3, device=DEVICE)
                        o.step()
                        if step == 4:
                            while_off = {k: v.clone() for k, v in
                                         o.state_dict()["state"][0].items()
                                         if v is not None}
                    runs.append((p.detach().clone(), while_off))
                torch.testing.assert_close(runs[0][0], runs[1][0], **TOL)
                self.assertEqual(sorted(runs[0][1]), sorted(runs[1][1]))
                for k in runs[1][1]:
                    torch.testing.assert_close(runs[0][1][k], runs[1][1][k],
                                               **TOL)

    def test_loaded_groups_are_copies_as_in_torch(self):
        # torch's load_state_dict deep-copies the saved param_groups: a
        # value the state dict holds (a list, a tensor lr a scheduler
        # fills in place) is not the optimizer's.
        opt, ref = self.both(one_param(4), lr=1e-2)
        runs = []
        for o in (opt, ref):
            p = o.param_groups[0]["params"][0]
            p.grad = torch.ones(4, device=DEVICE)
            o.step()
            sd = o.state_dict()
            sd["param_groups"][0].update(tags=["a"], lr=torch.tensor(0.1))
            o.load_state_dict(sd)
            sd["param_groups"][0]["tags"].append("b")
            sd["param_groups"][0]["lr"].fill_(0.5)
            p.grad = torch.ones(4, device=DEVICE)
            o.step()
            runs.append((o.param_groups[0]["tags"],
                         float(o.param_groups[0]["lr"])))
        self.assertEqual(runs[0], runs[1])
        self.assertEqual(runs[1][0], ["a"])
        self.assert_same(opt, ref)

    def test_adamw_loading_adams_state_stays_adamw_as_in_torch(self):
        # torch's AdamW steps as AdamW after loading an Adam state dict
        # (torch 2.7 and later set decoupled_weight_decay in each loaded
        # group): torch.optim.Adam's and optimd.torch.Adam's alike.
        for source in ("torch", "optimd"):
            with self.subTest(source):
                torch.manual_seed(0)
                q = torch.nn.Parameter(torch.randn(4, 3, device=DEVICE))
                if source == "torch":
                    adam = torch.optim.Adam([q], lr=0.1, weight_decay=0.5)
                else:
                    adam = Adam([q], lr=0.1, weight_decay=0.5,
                                address=self.daemon.address)
                    self.opts.append(adam)
                q.grad = torch.randn(4, 3, device=DEVICE)
                adam.step()
                sd = adam.state_dict()
                opt, ref = self.both(one_param(4, 3), lr=0.1,
                                     weight_decay=0.5)
                for o in (opt, ref):
                    o.load_state_dict(sd)
                    p = o.param_groups[0]["params"][0]
                    for _ in range(3):
                        p.grad = torch.ones(4, 3, device=DEVICE)
                        o.step()
                self.assert_same(opt, ref)


    def test_a_group_put_into_param_groups_by_hand_is_stepped(self):
        # A group inserted into (or appended to) param_groups without
        # add_param_group: torch steps every group there is, zeroes its
        # gradients, and the groups after it keep their state.
        def params():
            return [torch.nn.Parameter(torch.randn(3)) for _ in range(3)]
        opt, ref = self.both(params, lr=0.1)
        for o in (opt, ref):
            a, b, c = o.param_groups[0]["params"]
            o.param_groups[0]["params"] = [a]
            a.grad = torch.ones(3, device=DEVICE)
            o.step()
            o.param_groups.insert(0, dict(o.param_groups[0], params=[b]))
            o.param_groups.append(dict(o.param_groups[0], params=[c],
                                       lr=0.2))
            for i in range(3):
                o.zero_grad(set_to_none=False)
                for p in (a, b, c):
                    if p.grad is None:
                        p.grad = torch.zeros(3, device=DEVICE)
                    p.grad += torch.full((3,), 1.0 - i, device=DEVICE)
                o.step()
        self.assert_same(opt, ref)
        self.assertEqual(len(opt.state_dict()["state"]), 3)

    def test_a_parameter_moved_into_an_earlier_group_keeps_its_state(self):
        # A parameter taken out of a later group and put into an earlier
        # one: its state goes with it, as torch's is keyed by the
        # parameter; state_dict() shows the state it is stepped with, and
        # a later edit of that group carries the live state, not the one
        # it had when it moved.
        def params():
            return [{"params": [torch.nn.Parameter(torch.randn(3))
                                for _ in range(2)]},
                    {"params": [torch.nn.Parameter(torch.randn(4))],
                     "lr": 0.2}]
        opt, ref = self.both(params, lr=0.1)
        runs = []
        for o in (opt, ref):
            first, second = o.param_groups
            for i in range(6):
                if i == 2:
                    first["params"].append(second["params"].pop())
                elif i == 4:
                    second["params"].append(first["params"].pop(0))
                for p in first["params"] + second["params"]:
                    p.grad = torch.full_like(p, 1.0 - 0.3 * i)
                o.step()
                runs.append(sorted(float(e["step"]) for e in
                                   o.state_dict()["state"].values()))
        self.assertEqual(runs[:6], runs[6:])
        self.assert_same(opt, ref)

    def test_a_parameter_put_into_a_second_group_raises(self):
        # torch raises ValueError for a parameter in two groups when made
        # or in add_param_group, but an edit of param_groups gets past
        # that, and its step then updates the parameter once per group.
        # optimd.torch raises torch's ValueError at that step instead,
        # changing nothing: with the edit undone it goes on as torch.
        def params():
            return [{"params": [torch.nn.Parameter(torch.randn(3))]},
                    {"params": [torch.nn.Parameter(torch.randn(3))],
                     "lr": 0.2}]
        opt, ref = self.both(params, lr=0.1)
        for o in (opt, ref):
            for i in range(3):
                if o is opt and i == 1:
                    shared = o.param_groups[0]["params"][0]
                    o.param_groups[1]["params"].append(shared)
                    with self.assertRaisesRegex(
                            ValueError, "more than one parameter group"):
                        o.step()
                    o.param_groups[1]["params"].pop()
                for g in o.param_groups:
                    g["params"][0].grad = torch.full((3,), 1.0 - i,
                                                     device=DEVICE)
                o.step()
        self.assert_same(opt, ref)

    def test_betas_given_as_a_list_are_what_torch_makes_of_them(self):
        # torch 1.13 keeps `betas` as given (a list from a config file: the
        # groups, defaults and state dicts hold that list, and a script may
        # set an item of it in place); later torch makes it a tuple. A load
        # keeps the saved one's type.
        for cls, ref_cls in ((AdamW, torch.optim.AdamW),
                             (Adam, torch.optim.Adam)):
            with self.subTest(cls.__name__):
                runs = []
                for make in (functools.partial(
                        cls, address=self.daemon.address), ref_cls):
                    torch.manual_seed(0)
                    p = torch.nn.Parameter(torch.randn(4, device=DEVICE))
                    o = make([p], lr=0.1, betas=[0.9, 0.99])
                    if make is not ref_cls:
                        self.opts.append(o)
                    seen = [o.defaults["betas"], o.param_groups[0]["betas"],
                            o.state_dict()["param_groups"][0]["betas"]]
                    for i in range(3):
                        p.grad = torch.full_like(p, 1.0 - 0.4 * i)
                        o.step()
                        betas = o.param_groups[0]["betas"]
                        if isinstance(betas, list):
                            betas[0] = 0.5
                        else:
                            o.param_groups[0]["betas"] = (0.5, betas[1])
                    o.load_state_dict(o.state_dict())
                    seen.append(o.param_groups[0]["betas"])
                    p.grad = torch.ones_like(p)
                    o.step()
                    runs.append(([(type(b), list(b)) for b in seen],
                                 p.detach().clone()))
                self.assertEqual(runs[0][0], runs[1][0])
                torch.testing.assert_close(runs[0][1], runs[1][1], **TOL)

    @unittest.skipUnless(torch_takes_names(), "torch 2.6's param_names")
    def test_names_stay_when_a_state_dict_without_them_loads(self):
        # torch's load keeps a group's "param_names" when the saved group
        # has none (a state dict of an optimizer made over bare tensors).
        def params():
            return [("w", torch.nn.Parameter(torch.randn(3)))]
        opt, ref = self.both(params, lr=0.1)
        bare = torch.optim.AdamW([torch.nn.Parameter(torch.randn(3))])
        for o in (opt, ref):
            o.load_state_dict(bare.state_dict())
        self.assertEqual(opt.param_groups[0].get("param_names"), ["w"])
        self.assertEqual(opt.state_dict()["param_groups"][0]["param_names"],
                         ref.state_dict()["param_groups"][0]["param_names"])

    def test_a_state_assigned_by_the_trainer_is_the_state(self):
        # `opt.state = defaultdict(dict)` (a reset some scripts do):
        # torch's next step starts every parameter afresh.
        import collections

        opt, ref = self.both(one_param(3), lr=0.1)
        for o in (opt, ref):
            p = o.param_groups[0]["params"][0]
            for i in range(4):
                if i == 2:
                    o.state = collections.defaultdict(dict)
                    self.assertEqual(len(o.state), 0)
                p.grad = torch.full((3,), 1.0 + i, device=DEVICE)
                o.step()
        self.assert_same(opt, ref)
        self.assertEqual(float(opt.state_dict()["state"][0]["step"]), 2.0)

    def test_step_has_torchs_dtype_under_a_low_precision_default(self):
        # torch 2 keeps "step" in its scalar dtype (float32 unless the
        # default is float64) whatever the default dtype; torch 1.13 in
        # the default dtype. A mixed-precision script may set bf16 as the
        # default.
        before = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            opt, ref = self.both(lambda: [torch.nn.Parameter(
                torch.randn(3, dtype=torch.float32))], lr=0.1)
            for o in (opt, ref):
                p = o.param_groups[0]["params"][0]
                for _ in range(3):
                    p.grad = torch.ones(3, dtype=torch.float32,
                                        device=DEVICE)
                    o.step()
            mine = opt.state_dict()["state"][0]["step"]
            theirs = ref.state_dict()["state"][0]["step"]
        finally:
            torch.set_default_dtype(before)
        self.assertEqual(mine.dtype, theirs.dtype)
        self.assertEqual(float(mine), float(theirs))

    def test_a_loaded_entry_missing_a_moment_is_refused(self):
        # torch's load takes an entry without exp_avg_sq and its next step
        # fails (KeyError); optimd's load raises that KeyError at once and
        # changes nothing (the daemon would otherwise restart the moment
        # at zero under the saved step count).
        opt, ref = self.both(one_param(4), lr=0.1)
        for o in (opt, ref):
            o.param_groups[0]["params"][0].grad = torch.ones(4, device=DEVICE)
            o.step()
        for cut in (("exp_avg_sq",), ("exp_avg", "exp_avg_sq")):
            bad = copy.deepcopy(opt.state_dict())
            bad["param_groups"][0]["lr"] = 0.5
            for k in cut:
                del bad["state"][0][k]
            with self.assertRaisesRegex(KeyError, "exp_avg_sq"):
                opt.load_state_dict(bad)
            theirs = torch.optim.AdamW(
                [torch.nn.Parameter(torch.zeros(4, device=DEVICE))], lr=0.1)
            theirs.load_state_dict(bad)
            theirs.param_groups[0]["params"][0].grad = torch.ones(
                4, device=DEVICE)
            with self.assertRaises(KeyError):
                theirs.step()
        self.assertEqual(opt.param_groups[0]["lr"], 0.1)
        for o in (opt, ref):
            o.param_groups[0]["params"][0].grad = torch.ones(4, device=DEVICE)
            o.step()
        self.assert_same(opt, ref)

    def test_a_loaded_step_that_is_no_count_is_refused(self):
        # A step the daemon cannot count (negative, fractional, past 2**53)
        # raises ValueError naming the parameter before anything changes
        # (torch corrects its bias by any float; truncating it would step
        # differently, silently).
        opt, ref = self.both(one_param(4), lr=0.1)
        for o in (opt, ref):
            o.param_groups[0]["params"][0].grad = torch.ones(4, device=DEVICE)
            o.step()
        for step in (-5.0, 3.7, 1e20, float("nan")):
            bad = copy.deepcopy(opt.state_dict())
            bad["param_groups"][0]["lr"] = 0.5
            bad["state"][0]["step"] = torch.tensor(step)
            with self.assertRaisesRegex(ValueError, "parameter 0 has step"):
                opt.load_state_dict(bad)
        self.assertEqual(opt.param_groups[0]["lr"], 0.1)
        for o in (opt, ref):
            o.param_groups[0]["params"][0].grad = torch.ones(4, device=DEVICE)
            o.step()
        self.assert_same(opt, ref)


class _cpu:
    """torch 1.13 has no device context: tensors are made on the CPU."""

    def __enter__(self):
        assert DEVICE.type == "cpu", "CUDA tests need torch 2"

    def __exit__(self, *exc):
        return False


def _hogwild_worker(model, address):
    """A Hogwild worker: two steps of AdamW (optimd's at `address`, or
    torch's) on the shared model."""
    torch.multiprocessing.set_sharing_strategy("file_system")
    if address is None:
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    else:
        opt = AdamW(model.parameters(), lr=0.1, address=address)
    for _ in range(2):
        opt.zero_grad()
        model(torch.ones(4, 3)).sum().backward()
        opt.step()


if __name__ == "__main__":
    unittest.main()
