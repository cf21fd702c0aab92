"""optimd.torch.AdamW inside real trainers: Hugging Face Trainer,
accelerate and Lightning, each run against the same run with
torch.optim.AdamW (same model, data and seed), with the framework's own
checkpoint and resume. Skipped where a framework is not installed (the
GPU machine has all three; Debian's CI image none).

    LD_LIBRARY_PATH=.gpu/lib OPTIMD_BINARY=.gpu/optimd \\
        PYTHONPATH=client/python python3 -m unittest -v \\
        tests/python/test_frameworks.py

Tolerance: the two optimizers agree to about 1e-7 relative per step; over
the few steps here on a small GPT-2 each tensor's weights must agree to
5e-3 of how far the reference moved them from their initial values.
"""
import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import unittest
from types import SimpleNamespace

import torch

from optimd.testing import Daemon
from optimd.torch import AdamW

# The resume secrets of these tests' sessions stay in their own scratch.
os.environ.setdefault("OPTIMD_SECRETS_DIR",
                      tempfile.mkdtemp(prefix="optimd-secrets-"))

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
STEPS = 8


def _have(*names):
    """Whether every module named is installed (a dotted name whose parent
    package is missing counts as missing, not as an error)."""
    try:
        return all(importlib.util.find_spec(n) is not None for n in names)
    except ModuleNotFoundError:
        return False


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128,
                        n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
                        attn_pdrop=0.0)
    return GPT2LMHeadModel(config)


def _data(n=64):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (n, 32), generator=g)
    return [dict(input_ids=x, labels=x) for x in ids]


def _loader():
    """_data() in batches of 4, unshuffled."""
    return torch.utils.data.DataLoader(
        _data(), batch_size=4, collate_fn=lambda b: {
            k: torch.stack([x[k] for x in b]) for k in b[0]})


def _script_model():
    """The script's seeded modules on DEVICE, and its two kinds of params."""
    torch.manual_seed(0)
    emb = torch.nn.Embedding(64, 32).to(DEVICE)
    body = torch.nn.Sequential(torch.nn.Linear(32, 32),
                               torch.nn.GELU(),
                               torch.nn.LayerNorm(32)).to(DEVICE)
    experts = torch.nn.ModuleList(
        torch.nn.Linear(32, 32) for _ in range(2)).to(DEVICE)
    head = torch.nn.Linear(32, 64, bias=False).to(DEVICE)
    head.weight = emb.weight  # tied
    side = torch.nn.Linear(32, 1).to(DEVICE)
    body[2].requires_grad_(False)  # frozen, unfrozen at step 6
    decay = [p for m in (emb, body, experts) for p in m.parameters()
             if p.dim() > 1]
    other = [p for m in (body, experts) for p in m.parameters()
             if p.dim() <= 1]
    return SimpleNamespace(emb=emb, body=body, experts=experts, head=head,
                           side=side, decay=decay, other=other)


def _script_groups(m):
    """The script's param groups: decay on m's matrices, none on the rest."""
    return [dict(params=m.decay, weight_decay=0.1),
            dict(params=m.other, weight_decay=0.0)]


def _script_step(i, m, data, opt, opt2, sched, scaler):
    """Step i of the script: fp16 autocast, GradScaler, clipping, sched."""
    if i == 6:
        m.body[2].requires_grad_(True)
    opt.zero_grad()
    opt2.zero_grad()
    with torch.autocast("cuda", dtype=torch.float16):
        x = m.body(m.emb(data[i]))
        x = x + m.experts[0](x)  # expert 1 never routed
        loss = torch.nn.functional.cross_entropy(
            m.head(x).float(), data[(i + 1) % 20])
        loss = loss + m.side(x.detach()).float().square().mean()
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(m.decay + m.other, 1.0)
    scaler.step(opt)
    scaler.step(opt2)
    scaler.update()
    sched.step()


class FrameworkTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.daemon = Daemon(backend="cuda" if DEVICE == "cuda" else "cpu")

    @classmethod
    def tearDownClass(cls):
        assert cls.daemon.stop() == 0

    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="optimd-fw-")

    def tearDown(self):
        shutil.rmtree(self.dir, ignore_errors=True)

    def make_opt(self, kind, params, job):
        if kind == "torch":
            return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)
        return AdamW(params, lr=1e-3, weight_decay=0.01,
                     address=self.daemon.address, job_id=job)

    def assert_close(self, a, b):
        """a and b, both trained from _gpt2()'s weights, moved alike: per
        tensor, the largest difference is at most 5e-3 of b's largest move
        from the initial weights. The optimizers agree to about 1e-7 of a
        step per step, but the two runs' gradients differ in their last
        bits (the parameters live in other memory, so the GPU's kernels may
        sum in another order), and Adam's normalized update turns that into
        up to about 1e-3 of a move over a few steps (run 41)."""
        init = dict(_gpt2().named_parameters())
        for (name, p), q in zip(a.named_parameters(), b.parameters()):
            p, q = p.detach().float().cpu(), q.detach().float().cpu()
            err = (p - q).abs().max().item()
            moved = (q - init[name].detach()).abs().max().item()
            self.assertGreater(moved, 0.0, name)
            self.assertLessEqual(err, 5e-3 * moved,
                                 "%s differs by %g, %.2g of its move %g" % (
                                     name, err, err / moved, moved))

    # Hugging Face Trainer.
    def hf_run(self, kind, out, resume=False, job=None):
        from transformers import Trainer, TrainingArguments
        model = _gpt2().to(DEVICE)
        opt = self.make_opt(kind, model.parameters(), job or self.id() + kind)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - s / 20)
        args = TrainingArguments(
            output_dir=out, max_steps=STEPS, per_device_train_batch_size=4,
            logging_steps=1, save_steps=STEPS // 2, report_to=[], seed=0,
            use_cpu=DEVICE == "cpu", max_grad_norm=1.0,
            dataloader_drop_last=True)
        trainer = Trainer(model=model, args=args, train_dataset=_data(),
                          optimizers=(opt, sched))
        trainer.train(resume_from_checkpoint=resume or None)
        return model, opt

    @unittest.skipUnless(_have("transformers", "accelerate"),
                         "needs transformers")
    def test_hf_trainer_matches_torch_and_resumes(self):
        ref, _ = self.hf_run("torch", os.path.join(self.dir, "torch"))
        out = os.path.join(self.dir, "optimd")
        ours, opt = self.hf_run("optimd", out)
        self.assert_close(ours, ref)
        opt.close()
        # Resume from the mid-run checkpoint (Trainer's own optimizer.pt,
        # saved from our state_dict) in a fresh optimizer: same weights.
        mid = os.path.join(out, "checkpoint-%d" % (STEPS // 2))
        self.assertTrue(os.path.isdir(mid))
        again, opt = self.hf_run("optimd", out, resume=mid, job="resumed")
        self.assert_close(again, ref)
        opt.close()

    # accelerate.
    def accelerate_run(self, kind, save=None, load=None):
        from accelerate import Accelerator
        accelerator = Accelerator(cpu=DEVICE == "cpu")
        # The usual pattern: the optimizer is made over the model on the
        # CPU; prepare() moves the model, and the optimizer follows.
        model = _gpt2()
        opt = self.make_opt(kind, model.parameters(), self.id() + kind +
                            str(bool(load)))
        loader = _loader()
        model, opt, loader = accelerator.prepare(model, opt, loader)
        if load:
            accelerator.load_state(load)
        for i, batch in enumerate(loader):
            if i == STEPS:
                break
            if load and i < STEPS // 2:
                continue
            loss = model(**batch).loss
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            if save and i == STEPS // 2 - 1:
                accelerator.save_state(save)  # safetensors, tied weights
        unwrapped = accelerator.unwrap_model(model)
        return unwrapped, opt

    @unittest.skipUnless(_have("accelerate", "transformers"),
                         "needs accelerate")
    def test_accelerate_matches_torch_and_resumes(self):
        ref, _ = self.accelerate_run("torch")
        state = os.path.join(self.dir, "acc")
        ours, opt = self.accelerate_run("optimd", save=state)
        self.assert_close(ours, ref)
        opt.optimizer.close()
        again, opt = self.accelerate_run("optimd", load=state)
        self.assert_close(again, ref)
        opt.optimizer.close()

    def fsdp_run(self, kind, fsdp_version=2, use_orig_params=1):
        """accelerate_fsdp_run.py in a process of its own (a torch.distributed
        group of one rank): its exit status, its stderr, and the final
        weights by name (None if it failed)."""
        with socket.socket() as s:  # a free port for the group's store
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
        out = os.path.join(self.dir, kind + ".pt")
        cmd = [sys.executable, os.path.join(os.path.dirname(__file__),
                                            "accelerate_fsdp_run.py"),
               kind, out, self.daemon.address,
               "--fsdp_version", str(fsdp_version),
               "--use_orig_params", str(use_orig_params),
               "--state_dir", os.path.join(self.dir, "%s-state-%d-%d" % (
                   kind, fsdp_version, use_orig_params))]
        run = subprocess.run(cmd, env=env, timeout=300, text=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        weights = torch.load(out) if run.returncode == 0 else None
        return run.returncode, run.stderr, weights

    @unittest.skipUnless(_have("accelerate", "transformers") and
                         DEVICE == "cuda", "needs accelerate and a GPU")
    def test_accelerate_fsdp1_matches_torch(self):
        # FSDP version 1 keeps the values in flat buffers of its own; the
        # daemon steps them there (in place: the FlatParameters, or with
        # use_orig_params=True the parameters' views of them), so training
        # matches torch's both ways, accelerate's clipping included.
        for use_orig_params in (0, 1):
            with self.subTest(use_orig_params=use_orig_params):
                code, err, ref = self.fsdp_run(
                    "torch", 1, use_orig_params)
                self.assertEqual(code, 0, err[-2000:])
                code, err, ours = self.fsdp_run(
                    "optimd", 1, use_orig_params)
                self.assertEqual(code, 0, err[-2000:])
                self.assert_matches_fsdp_reference(ours, ref)

    @unittest.skipUnless(_have("accelerate", "transformers") and
                         DEVICE == "cuda", "needs accelerate and a GPU")
    def test_accelerate_fsdp2_matches_torch(self):
        # prepare() replaces the model's parameters with FSDP2's DTensors
        # and puts them into the optimizer's param_groups: optimd.torch
        # registers their local shards anew (in place on CUDA) and trains
        # as torch's optimizer does, clipping included.
        code, err, ref = self.fsdp_run("torch")
        self.assertEqual(code, 0, err[-2000:])
        code, err, ours = self.fsdp_run("optimd")
        self.assertEqual(code, 0, err[-2000:])
        self.assert_matches_fsdp_reference(ours, ref)

    def assert_matches_fsdp_reference(self, ours, ref):
        """Final weights by name as torch's run left them: every weight
        moved, and ours within 0.5% of its movement."""
        self.assertEqual(sorted(ours), sorted(ref))
        init = {k: v.detach().float() for k, v in _gpt2().state_dict().items()}
        for name, q in ref.items():
            moved = (q - init[name]).abs().max().item()
            err = (ours[name] - q).abs().max().item()
            self.assertGreater(moved, 0.0, name)
            self.assertLessEqual(err, 5e-3 * moved, name)

    @unittest.skipUnless(_have("safetensors", "transformers"),
                         "needs safetensors")
    def test_safetensors_saves_tied_weights_of_optimd_parameters(self):
        # Each parameter has a storage of its own over the group's flat
        # buffer, so safetensors' tied-weight check passes as with torch.
        from safetensors.torch import load_model, save_model
        model = _gpt2().to(DEVICE)
        opt = self.make_opt("optimd", model.parameters(), self.id())
        loss = model(**{k: v[None].to(DEVICE)
                        for k, v in _data(1)[0].items()}).loss
        loss.backward()
        opt.step()
        opt.synchronize()
        path = os.path.join(self.dir, "model.safetensors")
        save_model(model, path)
        again = _gpt2().to(DEVICE)
        load_model(again, path)
        for p, q in zip(model.parameters(), again.parameters()):
            self.assertTrue(torch.equal(p, q))
        self.assertIs(again.lm_head.weight, again.transformer.wte.weight)
        opt.close()

    @unittest.skipUnless(_have("torch.distributed.checkpoint.state_dict",
                               "transformers"),
                         "needs torch.distributed.checkpoint.state_dict")
    def test_distributed_checkpoint_state_dict_helpers(self):
        # torch.distributed.checkpoint's get/set_optimizer_state_dict: on a
        # fresh optimizer (they initialize its state with one lr=0 step, as
        # for torch's), after training (the same FQN-keyed state as
        # torch's), and back into a new optimizer.
        from torch.distributed.checkpoint.state_dict import (
            get_optimizer_state_dict, set_optimizer_state_dict)
        models = {k: _gpt2().to(DEVICE) for k in ("torch", "optimd")}
        opts = {k: self.make_opt(k, m.parameters(), self.id() + k)
                for k, m in models.items()}
        fresh = {k: get_optimizer_state_dict(models[k], opts[k])
                 for k in models}
        self.assertEqual(sorted(fresh["optimd"]["state"]),
                         sorted(fresh["torch"]["state"]))
        batch = {k: v[None].to(DEVICE) for k, v in _data(1)[0].items()}
        for k in models:
            for _ in range(3):
                opts[k].zero_grad()
                models[k](**batch).loss.backward()
                opts[k].step()
        sds = {k: get_optimizer_state_dict(models[k], opts[k])
               for k in models}
        for name, ref in sds["torch"]["state"].items():
            ours = sds["optimd"]["state"][name]
            self.assertEqual(float(ours["step"]), float(ref["step"]))
            for key in ("exp_avg", "exp_avg_sq"):
                self.assertTrue(torch.allclose(ours[key].float().cpu(),
                                               ref[key].float().cpu(),
                                               rtol=1e-4, atol=1e-6), name)
        again = _gpt2().to(DEVICE)
        again.load_state_dict(models["optimd"].state_dict())
        opt = self.make_opt("optimd", again.parameters(), self.id() + "again")
        set_optimizer_state_dict(again, opt, sds["optimd"])
        back = get_optimizer_state_dict(again, opt)
        for name, ref in sds["optimd"]["state"].items():
            for key in ("exp_avg", "exp_avg_sq"):
                self.assertTrue(torch.equal(back["state"][name][key],
                                            ref[key]), name)
        for o in (opts["optimd"], opt):
            o.close()

    def run_training_script(self, make):
        """Runs the script with make(params, name)'s optimizers; its weights."""
        m = _script_model()
        opt = make(_script_groups(m), "main")
        opt2 = make(m.side.parameters(), "side")
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3,
                                                    total_steps=40)
        scaler = torch.cuda.amp.GradScaler()
        data = torch.randint(0, 64, (20, 16), generator=torch.Generator()
                             .manual_seed(3)).to(DEVICE)
        for i in range(10):
            _script_step(i, m, data, opt, opt2, sched, scaler)
        path = os.path.join(self.dir, "ckpt-%s.pt" % make.__name__)
        torch.save(dict(opt=opt.state_dict(), opt2=opt2.state_dict(),
                        sched=sched.state_dict()), path)
        # A new optimizer (as in a new process) resumes from the file.
        if hasattr(opt, "close"):
            opt.close()
            opt2.close()
        opt = make(_script_groups(m), "main-resumed")
        opt2 = make(m.side.parameters(), "side-resumed")
        saved = torch.load(path, weights_only=False)
        opt.load_state_dict(saved["opt"])
        opt2.load_state_dict(saved["opt2"])
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3,
                                                    total_steps=40)
        sched.load_state_dict(saved["sched"])
        for i in range(10, 20):
            _script_step(i, m, data, opt, opt2, sched, scaler)
        params = [p.detach().float().cpu().clone() for mod in
                  (m.emb, m.body, m.experts, m.side) for p in mod.parameters()]
        self.assertTrue(torch.equal(params[0], m.emb.weight.detach()
                                    .float().cpu()))
        for o in (opt, opt2):
            if hasattr(o, "close"):
                o.close()
        return params

    @unittest.skipUnless(DEVICE == "cuda", "needs a GPU")
    def test_a_torch_training_script_runs_unchanged(self):
        # One script written for torch.optim.AdamW, run with each optimizer
        # class: param groups, a scheduler, fp16 autocast with GradScaler,
        # clip_grad_norm_, a layer frozen then unfrozen, an MoE-style expert
        # that gets no gradient, tied weights, a second optimizer, and a
        # checkpoint saved with torch.save and resumed by a new optimizer.
        # The weights end as torch's, within the per-step tolerance.
        def torch_adamw(params, name):
            return torch.optim.AdamW(params, lr=1e-3)

        def optimd_adamw(params, name):
            return AdamW(params, lr=1e-3, address=self.daemon.address,
                         job_id=self.id() + name)

        ref = self.run_training_script(torch_adamw)
        ours = self.run_training_script(optimd_adamw)
        for i, (p, q) in enumerate(zip(ours, ref)):
            scale = q.abs().max().clamp_min(1e-6)
            self.assertLessEqual(((p - q).abs().max() / scale).item(), 1e-4,
                                 "parameter %d" % i)

    @unittest.skipUnless(DEVICE == "cuda", "needs a GPU")
    def test_model_moved_after_construction_is_followed(self):
        # model.to() after the optimizer was made, as torch allows before
        # the first step: the session follows the parameters to the GPU
        # and trains as torch does.
        batch = {k: v[None].to(DEVICE) for k, v in _data(1)[0].items()}
        runs = {}
        for kind in ("torch", "optimd"):
            model = _gpt2()
            opt = self.make_opt(kind, model.parameters(), self.id() + kind)
            model.to(DEVICE)
            for _ in range(3):
                opt.zero_grad()
                model(**batch).loss.backward()
                opt.step()
            runs[kind] = (model, opt)
        self.assert_close(runs["optimd"][0], runs["torch"][0])
        p = next(runs["optimd"][0].parameters())
        self.assertEqual(p.device.type, "cuda")
        self.assertEqual(int(runs["optimd"][1].state[p]["step"]), 3)
        runs["optimd"][1].close()

    # Lightning.
    @unittest.skipUnless(_have("lightning", "transformers"),
                         "needs lightning")
    def test_lightning_matches_torch_and_resumes(self):
        import lightning as L

        test = self

        class Module(L.LightningModule):
            def __init__(self, kind):
                super().__init__()
                self.model = _gpt2()
                self.kind = kind

            def training_step(self, batch, i):
                return self.model(**batch).loss

            def configure_optimizers(self):
                return test.make_opt(self.kind, self.parameters(),
                                     test.id() + self.kind +
                                     str(id(self)))

        def run(kind, steps, ckpt=None, save=None):
            module = Module(kind)
            loader = _loader()
            trainer = L.Trainer(
                max_steps=steps, accelerator="gpu" if DEVICE == "cuda"
                else "cpu", devices=1, logger=False,
                enable_checkpointing=False, enable_progress_bar=False,
                gradient_clip_val=1.0, enable_model_summary=False)
            trainer.fit(module, loader, ckpt_path=ckpt)
            if save:
                trainer.save_checkpoint(save)
            return module, trainer

        ref, _ = run("torch", STEPS)
        ours, trainer = run("optimd", STEPS)
        self.assert_close(ours.model, ref.model)
        trainer.optimizers[0].close()
        # Lightning's own checkpoint mid-run and a resume (its dataloader
        # restarts the epoch, so the reference resumes the same way).
        resumed = {}
        for kind in ("torch", "optimd"):
            half = os.path.join(self.dir, kind + ".ckpt")
            _, trainer = run(kind, STEPS // 2, save=half)
            if kind == "optimd":
                trainer.optimizers[0].close()
            resumed[kind], trainer = run(kind, STEPS, ckpt=half)
        self.assert_close(resumed["optimd"].model, resumed["torch"].model)
        trainer.optimizers[0].close()


if __name__ == "__main__":
    unittest.main()
