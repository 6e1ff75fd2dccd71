"""One rank of the torch.compile tests of halocp.diffusers: a converted VAE's
encode, decode and train step (encode, decode, a loss over both, its
backward) compiled with fullgraph=True, against the same converted model
run eagerly, forward and backward, on a split with a rank that holds the
fewest frames the compression allows (rank 0: the first frame alone) and,
on 3 ranks, an empty one. tests/python/diffusers_compile.py starts 2 and
3 of them, one model per launch.

    ranks_diffusers_compile.py [--backend=decompositions|aot_eager|inductor] SCENARIO...

decompositions (the default): AOTAutograd with inductor's decomposition
table, the graph run eagerly: what inductor traces (where a strided layer's
unbacked output count made LayerNorm's backward guard on Eq(u, 0)),
without its minutes of C++ compiling on 2 CPUs.

float64 models as ranks_diffusers.py builds them. The compiled graph and
the eager layers sum in other orders (the stride-1 layers convolve in one
call under compile; inductor fuses), so results agree to TOL relative, not
bit for bit; ranks_diffusers.py checks eager against one process.
"""

from __future__ import annotations

import copy
import sys

import torch
import torch._dynamo

import halocp.diffusers as hd
import ranks
from ranks import expect
from ranks_diffusers import (LTX090, _cogvideox, float64_fourier_features, float64_rms_norm, hunyuan_video, ltx,
                             mochi, one_frame_batch, wan)

TOL = 1e-9
BACKEND = next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--backend=")), "decompositions")
sys.argv = [a for a in sys.argv if not a.startswith("--backend=")]
# A recompilation would be a bug here (one shape per scenario): fail at the
# second graph of a function instead of compiling on, slowly, on 2 CPUs.
torch._dynamo.config.recompile_limit = 1
torch._dynamo.config.accumulated_recompile_limit = 64

# Groups of `compression` frames per rank: rank 0 with the first frame alone
# (1 frame), and on 3 ranks an empty rank 1.
GROUPS = {2: [0, 1], 3: [0, 0, 1]}


class Counted:
    """BACKEND, counting the graphs it is given."""

    def __init__(self):
        from torch._dynamo.backends.registry import lookup_backend

        if BACKEND == "decompositions":
            from functorch.compile import make_boxed_func
            from torch._dynamo.backends.common import aot_autograd
            from torch._inductor.decomposition import select_decomp_table

            def eager(gm, _):
                return make_boxed_func(gm.forward)

            self.backend = aot_autograd(fw_compiler=eager, bw_compiler=eager, decompositions=select_decomp_table())
        else:
            self.backend = lookup_backend(BACKEND)
        self.frame_count = 0

    def __call__(self, gm, example_inputs):
        self.frame_count += 1
        return self.backend(gm, example_inputs)


def _relative(got, want, what):
    expect(got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}")
    if not want.numel():
        return
    err = (got - want).abs().max().item()
    scale = want.abs().max().item()
    expect(err <= TOL * max(scale, 1.0), f"{what}: max error {err:.3g} (largest value {scale:.3g})")


def check(build, shape_hw, decode_args=lambda z: (), whole_clip=lambda vae: None):
    """encode, decode and a train step compiled (one graph each, no
    recompilation on a second call) against the eager converted model."""
    torch.manual_seed(1)
    vae = build().double()
    whole_clip(vae)
    vae = hd.parallelize_vae(vae)
    r = hd.temporal_compression(vae)
    split = hd.split_clip(1 + r * sum(GROUPS[ranks.WORLD]), ranks.WORLD, r, groups=GROUPS[ranks.WORLD])
    x = hd.shard_clip(torch.randn(1, 3, split.num_frames, *shape_hw, dtype=torch.float64), split)
    name = type(vae).__name__

    def encode(x):
        return vae.encode(x).latent_dist.mode()

    def decode(z):
        return vae.decode(z, *decode_args(z)).sample

    def step(x):  # what a train step runs forward; its backward is AOTAutograd's
        z = encode(x)
        y = decode(z)
        return (z * z).mean() + (y * torch.linspace(-1, 1, y.shape[1], dtype=y.dtype)[:, None, None, None]).mean()

    def run(fn, arg):
        arg = arg.detach().requires_grad_()
        out = fn(arg)
        out.backward(torch.ones_like(out))  # every parameter's part of the sum over out
        grads = [arg.grad] + [p.grad for p in vae.parameters()]
        vae.zero_grad(set_to_none=True)
        return [out.detach()] + grads

    z = encode(x).detach()
    for what, fn, arg in (("encode", encode, x), ("decode", decode, z), ("train step", step, x)):
        want = run(fn, arg)
        torch._dynamo.reset()
        counter = Counted()
        compiled = torch.compile(fn, backend=counter, fullgraph=True)
        got = run(compiled, arg)
        again = run(compiled, arg)
        expect(counter.frame_count == 1, f"{name} {what}: {counter.frame_count} graphs")
        names = ["output", "input grad"] + [f"grad of {n}" for n, _ in vae.named_parameters()]
        for g, w, n in zip(got, want, names):
            if g is None or w is None:
                expect(g is None and w is None, f"{name} {what}: {n}: compiled {g is None}, eager {w is None}")
                continue
            _relative(g, w, f"{name} {what} ({BACKEND}): {n}")
        expect(torch.equal(again[0], got[0]), f"{name} {what}: a second compiled call differs")
    expect(z.shape[2] == split.latent_lengths[ranks.RANK], f"rank {ranks.RANK}: {z.shape[2]} latent frames")


def scenario_ltx():
    """LTX-Video 0.9.0's layout (strided causal convs into RMSNorms over
    (N, T, H, W, C)): the failure this started from."""
    with float64_rms_norm():
        check(ltx(**LTX090), (8, 8))


def scenario_cogvideox():
    """CogVideoX: GroupNorm over time, the temporal average of pairs, the
    decoder's spatial norm and its doubling of frames."""
    check(_cogvideox, (8, 8), whole_clip=one_frame_batch)


def scenario_wan():
    check(wan(), (8, 8))


def scenario_mochi():
    with float64_fourier_features():
        check(mochi(), (8, 8))


def scenario_hunyuan_video():
    check(hunyuan_video(), (8, 8))


if __name__ == "__main__":
    ranks.main(globals())
