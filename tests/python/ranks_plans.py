"""One rank of the tests of issue 24 §2: plans never go out of step between
ranks. tests/python/plans_layers.py starts W of them.

    ranks_plans.py SCENARIO...

No scenario calls halocp.clear_plans: a rank whose own input shape repeats
finds its cached plan while another rank makes a new one, and the exchange
must still agree. Every check compares with torch on the whole sequence.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import halocp
import ranks
from ranks import expect, offsets, oracle_backward, oracle_forward

# A rank that waits for a plan its peers never make sits out the whole
# deadline: keep it short, and each step well under it.
STEP_LIMIT = 4.0


def shard(t, lengths, dim=2):
    return t.narrow(dim, offsets(lengths)[ranks.RANK], lengths[ranks.RANK])


def close(got, want, what, tol=1e-11):
    if got.shape != want.shape:
        raise ranks.Failure(f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}")
    err = (got - want).abs().max().item() if got.numel() else 0.0
    expect(err <= tol * max(1.0, want.abs().max().item() if want.numel() else 0.0), f"{what}: max error {err:.3g}")


def summed(t):
    t = t.clone()
    dist.all_reduce(t)
    return t


class Timed:
    """Fails a step that took as long as a deadline would."""

    def __init__(self, what):
        self.what = what

    def __enter__(self):
        self.t0 = time.monotonic()

    def __exit__(self, *exc):
        took = time.monotonic() - self.t0
        if exc[0] is None:
            expect(took < STEP_LIMIT, f"{self.what}: took {took:.1f}s (a rank waited for a deadline)")


def scenario_prepend():
    """A down-sampler that repeats the sequence's first frame in front, as
    the LTX-Video VAE does: only the rank holding the first frame prepends,
    so its next conv sees a new shape while every other rank's input has the
    shape of the conv before it and finds that conv's plan. Two steps."""
    W, n = ranks.WORLD, 4
    lengths = [n] * W
    torch.manual_seed(240)
    conv_a = halocp.nn.CausalConv3d(3, 3, kernel_size=3, padding=1, dtype=torch.float64)
    conv_b = halocp.nn.CausalConv3d(3, 3, kernel_size=3, padding=1, dtype=torch.float64)
    full_a = torch.nn.Conv3d(3, 3, 3, padding=(0, 1, 1), dtype=torch.float64)
    full_b = torch.nn.Conv3d(3, 3, 3, padding=(0, 1, 1), dtype=torch.float64)
    full_a.load_state_dict(conv_a.state_dict())
    full_b.load_state_dict(conv_b.state_dict())

    def whole(x):
        h = full_a(F.pad(x, (0, 0, 0, 0, 2, 0)))
        h = torch.cat([h[:, :, :1], h], 2)
        return full_b(F.pad(h, (0, 0, 0, 0, 2, 0)))

    def sharded(x):
        h = conv_a(x)
        if ranks.RANK == 0:
            h = torch.cat([h[:, :, :1], h], 2)
        return conv_b(h)

    out_lengths = [n + 1] + [n] * (W - 1)
    for step in range(2):
        for m in (conv_a, conv_b, full_a, full_b):
            m.zero_grad()
        xg = torch.randn(1, 3, n * W, 4, 5, dtype=torch.float64, requires_grad=True)
        yg = whole(xg)
        gg = torch.randn_like(yg)
        yg.backward(gg)
        x = shard(xg.detach(), lengths).clone().requires_grad_()
        with Timed(f"step {step}"):
            y = sharded(x)
            y.backward(shard(gg, out_lengths))
        what = f"prepend step {step}"
        close(y, shard(yg.detach(), out_lengths), what + ": output")
        close(x.grad, shard(xg.grad, lengths), what + ": input grad")
        for name, m, f in (("a", conv_a, full_a), ("b", conv_b, full_b)):
            close(summed(m.weight.grad), f.weight.grad, f"{what}: conv {name} weight grad")


# Shards of 0, 1, c and c + 1 frames (c = 2, the causal conv's context)
# changing from step to step; in every change some rank keeps its length.
STEPS = {
    2: [[1, 3], [1, 2], [0, 3], [3, 3], [3, 0], [2, 3]],
    3: [[2, 3, 0], [2, 0, 3], [1, 2, 3], [2, 3, 0], [3, 1, 1]],
    4: [[1, 1, 1, 4], [0, 2, 1, 3], [2, 3, 0, 1], [3, 0, 2, 1], [1, 1, 1, 4]],
}


def scenario_changing():
    """Every halocp.nn layer and cp_halo_exchange on shards that change from
    step to step, against the whole sequence."""
    torch.manual_seed(241)
    layers = [
        (halocp.nn.CausalConv3d(2, 3, kernel_size=3, padding=1, dtype=torch.float64), (2, 0)),
        (halocp.nn.CenteredConv3d(2, 3, kernel_size=3, padding=1, dtype=torch.float64), (1, 1)),
    ]
    # The general path (any padding_mode, stride, dilation): out-of-place
    # exchanges and a table of every rank's length.
    layers.append((halocp.nn.CausalConv3d(2, 3, kernel_size=3, padding=1, padding_mode="replicate",
                                          dtype=torch.float64), (2, 0)))
    fulls = []
    for layer, (left, right) in layers:
        full = torch.nn.Conv3d(2, 3, 3, padding=(0, 1, 1), dtype=torch.float64)
        full.load_state_dict(layer.state_dict())
        fulls.append(full)

    def whole(layer, full, xg, left, right):
        if layer.padding_mode == "replicate":
            return F.conv3d(F.pad(xg, (1, 1, 1, 1, left, right), mode="replicate"), full.weight, full.bias)
        return full(F.pad(xg, (0, 0, 0, 0, left, right)))
    tconv = halocp.nn.ConvTranspose3d(2, 3, kernel_size=3, padding=1, dtype=torch.float64)
    tfull = torch.nn.ConvTranspose3d(2, 3, kernel_size=3, padding=1, dtype=torch.float64)
    tfull.load_state_dict(tconv.state_dict())
    for step, lengths in enumerate(STEPS[ranks.WORLD]):
        T = sum(lengths)
        xg = torch.randn(1, 2, T, 3, 4, dtype=torch.float64, requires_grad=True)
        x = shard(xg.detach(), lengths).clone().requires_grad_()
        what = f"step {step} shards {lengths}"
        with Timed(what):
            for (layer, (left, right)), full in zip(layers, fulls):
                layer.zero_grad()
                full.zero_grad()
                xg.grad = None
                x.grad = None
                yg = whole(layer, full, xg, left, right)
                gg = torch.randn_like(yg)
                yg.backward(gg)
                y = layer(x)
                y.backward(shard(gg, lengths))
                name = f"{type(layer).__name__} ({layer.padding_mode})"
                close(y, shard(yg.detach(), lengths), f"{what}: {name} output")
                close(x.grad, shard(xg.grad, lengths), f"{what}: {name} input grad")
                close(summed(layer.weight.grad), full.weight.grad, f"{what}: {name} weight grad")

            tconv.zero_grad()
            tfull.zero_grad()
            xg.grad = x.grad = None
            yg = tfull(xg)
            gg = torch.randn_like(yg)
            yg.backward(gg)
            y = tconv(x)
            y.backward(shard(gg, lengths))
            close(y, shard(yg.detach(), lengths), f"{what}: ConvTranspose3d output")
            close(x.grad, shard(xg.grad, lengths), f"{what}: ConvTranspose3d input grad")

            # The functional exchange, multi-hop where a shard is shorter
            # than a halo, forward and backward.
            shards = list(xg.detach().split(lengths, 2))
            xe = shards[ranks.RANK].clone().requires_grad_()
            out = halocp.cp_halo_exchange(xe, 2, 1, 2)
            close(out, oracle_forward(shards, ranks.RANK, 2, 1, 2), f"{what}: cp_halo_exchange", tol=0)
            # Every rank's gradient, drawn alike on every rank (the shapes
            # differ: drawing only its own would put the ranks' generators
            # out of step).
            grads = [torch.randn(1, 2, n + 3, 3, 4, dtype=torch.float64) for n in lengths]
            out.backward(grads[ranks.RANK])
            close(xe.grad, oracle_backward(grads, lengths, ranks.RANK, 2, 1, 2), f"{what}: cp_halo_exchange grad",
                  tol=0)


def scenario_mismatch():
    """Ranks that truly disagree (a dtype) fail at once with ERR_MISMATCH on
    every rank, and the communicator stays usable."""
    dtype = torch.float64 if ranks.RANK == 0 else torch.float32
    x = torch.ones(1, 2, 3, dtype=dtype)
    t0 = time.monotonic()
    try:
        halocp.cp_halo_exchange(x, 1, 1, 2)
    except halocp.HaloError as e:
        expect(e.code == halocp.ERR_MISMATCH, f"code {e.code}: {e}")
        expect("dtype" in str(e), f"the message does not name the dtype: {e}")
    else:
        raise ranks.Failure("no error for ranks that disagree on the dtype")
    expect(time.monotonic() - t0 < STEP_LIMIT, "the mismatch took a deadline to show")
    x = torch.full((1, 2, 3), float(ranks.RANK), dtype=torch.float64)
    out = halocp.cp_halo_exchange(x, 1, 1, 2)
    shards = [torch.full((1, 2, 3), float(r), dtype=torch.float64) for r in range(ranks.WORLD)]
    close(out, oracle_forward(shards, ranks.RANK, 1, 1, 2), "after the mismatch", tol=0)


if __name__ == "__main__":
    ranks.main(globals())
