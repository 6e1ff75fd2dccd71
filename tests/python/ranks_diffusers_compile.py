"""One rank of the torch.compile tests of halocp.diffusers: a converted VAE's
encode, decode and train step (encode, decode, a loss over both, its
backward) compiled with fullgraph=True, against the same converted model
run eagerly, forward and backward, on a split with a rank that holds the
fewest frames the compression allows (rank 0: the first frame alone) and,
on 3 ranks, an empty one. tests/python/diffusers_compile.py starts 2 and
3 of them, one model per launch.

    ranks_diffusers_compile.py [--backend=aot_eager|inductor] SCENARIO...

float64 models as ranks_diffusers.py builds them. The compiled graph and
the eager layers sum in other orders (the stride-1 layers convolve in one
call under compile; inductor fuses), so results agree to TOL relative, not
bit for bit; ranks_diffusers.py checks eager against one process.
"""

from __future__ import annotations

import sys

import torch
import torch._dynamo

import halocp.diffusers as hd
import ranks
from ranks import expect
from ranks_diffusers import (LTX090, SHIPPED_TOL, WAN22, _cogvideox, hunyuan_video, hunyuan_video15, ltx, ltx2,
                             ltx2_temb, mochi, one_frame_batch, wan)

TOL = 1e-9
BACKEND = next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--backend=")), "aot_eager")
sys.argv = [a for a in sys.argv if not a.startswith("--backend=")]
# A recompilation would be a bug here (one shape per scenario): fail at the
# second graph of a function instead of compiling on, slowly, on 2 CPUs.
torch._dynamo.config.recompile_limit = 1
torch._dynamo.config.accumulated_recompile_limit = 64

# Groups of `compression` frames per rank: uneven (on 2 ranks, what first
# failed: rank 0's 1 + 8 frames and rank 1's 16 into LTX-Video's strided
# convs); on 3 ranks, rank 0 with the first frame alone (the fewest frames a
# rank may hold) and an empty rank 1.
GROUPS = {2: [1, 2], 3: [0, 0, 1]}


class Counted:
    """BACKEND, counting the graphs it is given."""

    def __init__(self):
        from torch._dynamo.backends.registry import lookup_backend

        self.backend, self.frame_count = lookup_backend(BACKEND), 0

    def __call__(self, gm, example_inputs):
        self.frame_count += 1
        return self.backend(gm, example_inputs)


def _relative(got, want, what, tol):
    expect(got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}")
    if not want.numel():
        return
    err = (got - want).abs().max().item()
    scale = want.abs().max().item()
    expect(err <= tol * max(scale, 1.0), f"{what}: max error {err:.3g} (largest value {scale:.3g})")


def check(build, shape_hw, decode_args=lambda z: (), whole_clip=lambda vae: None, tol=TOL):
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
        # (sums: a mean over an empty rank's frames is NaN)
        return (z * z).sum() + (y * torch.linspace(-1, 1, y.shape[1], dtype=y.dtype)[:, None, None, None]).sum()

    def run(fn, arg, grad):
        with torch.set_grad_enabled(grad):
            out = fn(arg)
            if not grad:
                return [out]
            out.backward()
        grads = [p.grad for p in vae.parameters()]
        vae.zero_grad(set_to_none=True)
        return [out.detach()] + grads

    z = encode(x).detach()
    # Serving (no graph) and a train step (the clip is data; every
    # parameter's gradient): each compiled once, the second call no new graph.
    names = ["output"] + [f"grad of {n}" for n, _ in vae.named_parameters()]
    for what, fn, arg, grad in (("encode", encode, x, False), ("decode", decode, z, False),
                                ("train step", step, x, True)):
        want = run(fn, arg, grad)
        torch._dynamo.reset()
        counter = Counted()
        compiled = torch.compile(fn, backend=counter, fullgraph=True)
        got = run(compiled, arg, grad)
        again = run(compiled, arg, grad)
        expect(counter.frame_count == 1, f"{name} {what}: {counter.frame_count} graphs")
        for g, w, n in zip(got, want, names):
            if g is None or w is None:
                expect(g is None and w is None, f"{name} {what}: {n}: compiled {g is None}, eager {w is None}")
                continue
            _relative(g, w, f"{name} {what} ({BACKEND}): {n}", tol)
        expect(torch.equal(again[0], got[0]), f"{name} {what}: a second compiled call differs")
    expect(z.shape[2] == split.latent_lengths[ranks.RANK], f"rank {ranks.RANK}: {z.shape[2]} latent frames")


def scenario_ltx():
    """LTX-Video 0.9.0's layout as shipped (strided causal convs into
    RMSNorms and LayerNorms over (N, T, H, W, C)): the failure this started
    from. Its RMSNorm's variance is float32 (see SHIPPED_TOL): the graph's
    sums round apart from eager's by float32 steps."""
    check(ltx(**LTX090), (8, 8), tol=SHIPPED_TOL)


def scenario_cogvideox():
    """CogVideoX: GroupNorm over time, the temporal average of pairs, the
    decoder's spatial norm and its doubling of frames."""
    check(_cogvideox, (8, 8), whole_clip=one_frame_batch)


def scenario_wan():
    """Wan 2.1: the frame check (an op: it reads every rank's length on the
    host), the down-sampler's first frame kept, the up-sampler's doubling;
    and the compiled check refusing a bad shard on every rank alike."""
    check(wan(), (8, 8))
    refused_compiled(wan())


def scenario_wan22():
    """Wan 2.2's layout: the residual blocks' average and repeat shortcuts,
    which treat the first frame apart (on 3 ranks rank 0 holds it alone,
    rank 1 nothing); 2x2 patches."""
    check(wan(**WAN22), (16, 16))


def scenario_hunyuan_video15():
    """HunyuanVideo 1.5: space-to-depth down-samplers and depth-to-space
    up-samplers folding the first frame in space only, per-frame RMS norms,
    its attention block (cp_attention)."""
    check(hunyuan_video15(), (8, 8))


def scenario_ltx2():
    """LTX-2: LTX's blocks, its decoder centred and timestep-conditioned."""
    check(ltx2(decoder_causal=False), (8, 8), decode_args=ltx2_temb)


def refused_compiled(build):
    """A compiled frame check (the op alone: a model's graph compiles for
    minutes) refuses the last rank's frame too many, on every rank, as the
    eager one does (ranks_diffusers.py's *_bad_shard, *_errors)."""
    from halocp.diffusers import _convert as cv

    vae = hd.parallelize_vae(build().double())
    r = hd.temporal_compression(vae)
    last = ranks.WORLD - 1
    frames = (1 if ranks.RANK == 0 else r) + (ranks.RANK == last)
    torch._dynamo.reset()
    checked = torch.compile(lambda x: cv.check_frames(vae, x, False) * 2, backend=Counted(), fullgraph=True)
    try:
        checked(torch.zeros(1, 3, frames, 8, 8, dtype=torch.float64))
    except hd.FrameCountError as e:
        expect(f"rank {last} holds {(1 if last == 0 else r) + 1} frames" in str(e), str(e))
    else:
        raise ranks.Failure("the compiled frame check took a shard the split does not allow")


def scenario_mochi():
    """Mochi: the frame check, causal attention over time (cp_attention, an
    op), the decoder's first r-1 frames dropped by rank 0."""
    check(mochi(), (8, 8))


def scenario_hunyuan_video():
    """HunyuanVideo: the frame check, the mid-blocks' attention over every
    (frame, h, w) token, causal by frame (cp_attention)."""
    check(hunyuan_video(), (8, 8))


if __name__ == "__main__":
    ranks.main(globals())
