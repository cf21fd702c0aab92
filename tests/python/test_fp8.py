"""FP8 parameters (optimd.fp8) through the real daemon (CPU backend): the
masters follow torch's AdamW, the codes and scale inverses the daemon
writes dequantize to the masters within FP8's precision, checkpoints
restore them, and bad registrations are refused. Works on torch without
float8 dtypes (codes as uint8). Inputs are fresh random values each run;
the seed is printed.
"""
import os
import random
import shutil
import tempfile
import unittest

import torch

import optimd
from optimd.fp8 import Fp8AdamW, Fp8Parameter
from optimd.testing import DaemonTestCase
from optimd.v1 import optimd_pb2 as pb

SEED = int(os.environ.get("OPTIMD_TEST_SEED", random.randrange(1 << 30)))
print("seed", SEED)

# Half a unit of the last place, relative, of each format's normals, and
# half its subnormal step.
HALF_ULP = {"e4m3": 2.0 ** -4, "e5m2": 2.0 ** -3}
HALF_SUBNORMAL = {"e4m3": 2.0 ** -10, "e5m2": 2.0 ** -17}


class Fp8Test(DaemonTestCase):
    seed = SEED

    def masters(self, opt):
        reply = opt._client.get_state(("fp8",))
        out = {}
        for t in reply.groups[0].tensors:
            if t.kind == "master":
                out[t.tensor] = torch.frombuffer(
                    bytearray(t.data), dtype=torch.float32).clone()
        return [out[n] for n in opt.names]

    def check_quantized(self, p, master):
        """Each element of p within half an ulp (plus the fp32 roundings
        of scaling and reading back), or within FP8's subnormal step, of
        its master."""
        deq = p.dequantize().reshape(-1)
        scale = p._expand(p.scale_inv_values()).reshape(-1)
        err = (deq - master).abs()
        bound = (master.abs() * HALF_ULP[p.fmt] * (1 + 2.0 ** -10) +
                 scale * HALF_SUBNORMAL[p.fmt])
        self.assertTrue(bool((err <= bound).all()),
                        "%s %s: worst %g" % (p.fmt, p.recipe,
                                             (err - bound).max()))

    def test_steps_follow_torch_adamw_every_recipe(self):
        for fmt in ("e4m3", "e5m2"):
            for recipe in ("tensor", "block_1x128", "block_128x128",
                           "mxfp8"):
                weights = [torch.randn(130, 160, generator=self.gen),
                           torch.randn(3, 1000, generator=self.gen)]
                params = [Fp8Parameter.from_float(
                    w, fmt, recipe,
                    grad_dtype=torch.bfloat16 if i else torch.float32)
                    for i, w in enumerate(weights)]
                opt = Fp8AdamW(params, lr=1e-2, weight_decay=0.1,
                               address=self.daemon.address)
                self.opts.append(opt)
                ref = [w.clone().requires_grad_() for w in weights]
                torch_opt = torch.optim.AdamW(ref, lr=1e-2,
                                              weight_decay=0.1)
                for _ in range(3):
                    for p, r in zip(params, ref):
                        g = torch.randn(r.shape, generator=self.gen)
                        p.grad.copy_(g)
                        r.grad = p.grad.float().clone()
                    reply = opt.step()
                    self.assertFalse(reply.skipped)
                    torch_opt.step()
                    for p, r, m in zip(params, ref, self.masters(opt)):
                        torch.testing.assert_close(
                            m, r.detach().reshape(-1), rtol=1e-5,
                            atol=1e-6)
                        self.check_quantized(p, m)

    def test_checkpoint_restores_codes_and_scales(self):
        d = tempfile.mkdtemp(prefix="optimd-fp8-")
        self.addCleanup(shutil.rmtree, d, True)
        p = Fp8Parameter.from_float(torch.randn(64, 256, generator=self.gen),
                                    "e4m3", "mxfp8")
        opt = Fp8AdamW([p], lr=1e-2, address=self.daemon.address)
        self.opts.append(opt)
        p.grad.copy_(torch.randn(64, 256, generator=self.gen))
        opt.step()
        opt.save_checkpoint(d)
        codes, scales = p.codes.clone(), p.scale_inv.clone()
        opt.step()
        self.assertFalse(torch.equal(p.codes, codes))
        opt.load_checkpoint(d)
        self.assertTrue(torch.equal(p.codes, codes))
        self.assertTrue(torch.equal(p.scale_inv, scales))
        from optimd.checkpoint import read_checkpoint
        meta, tensors = read_checkpoint(
            os.path.join(d, "rank-0.safetensors"))
        self.assertEqual(list(tensors["fp8.0.scale_inv"].shape), [64, 8])
        self.assertEqual(
            meta["groups"][0]["tensors"][0]["layout"]["fp8_recipe"], "mxfp8")

    def test_wrong_scale_buffer_is_refused(self):
        p = Fp8Parameter((4, 256), "e4m3", "block_1x128")
        client = optimd.Client(self.daemon.address)
        self.addCleanup(client.close)
        client.create_session("fp8-refused")
        request = pb.RegisterGroupRequest(group_id="g")
        request.hyperparameters.lr = 1e-3
        t = p.spec("w")
        t.scale_inv.shared_memory.size -= 4
        request.tensors.append(t)
        with self.assertRaises(optimd.OptimdError) as e:
            client.register_group(request)
        self.assertIn("scale_inv buffer is", str(e.exception))
        client.close_session()


if __name__ == "__main__":
    unittest.main()
