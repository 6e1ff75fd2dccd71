"""One rank of the tests of issue 21: the summing exchange, GroupNorm across
ranks, the context-parallel ConvTranspose3d and a causal video VAE's encoder
and decoder blocks; tests/python/vae_layers.py starts W of them (helpers and
the exchange's oracle are ranks.py's).

    ranks_vae.py SCENARIO...

Every check compares a rank's part with the same module run by torch on the
whole tensor, which every rank builds from the same seed.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

import halocp
import ranks
from ranks import expect, expect_bits, offsets, oracle_backward, oracle_forward, random_values

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "python"))

# Shard lengths along T for each world size: uneven, empty shards, shards
# shorter than the layers' halos.
SPLITS = {1: [[5], [2]], 2: [[3, 6], [0, 4], [5, 1]], 3: [[2, 0, 5], [4, 1, 3]], 4: [[1, 3, 0, 4], [3, 2, 2, 1]]}


def splits():
    return SPLITS[ranks.WORLD]


def shard(t, lengths, dim=2):
    return t.narrow(dim, offsets(lengths)[ranks.RANK], lengths[ranks.RANK])


def summed(t):
    """A per-rank weight or bias gradient summed over the group."""
    t = t.clone()
    dist.all_reduce(t)
    return t


def close(got, want, tol, what):
    if got.shape != want.shape:
        raise ranks.Failure(f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}")
    err = (got.double() - want.double()).abs().max().item() if got.numel() else 0.0
    scale = max(want.double().abs().max().item() if want.numel() else 0.0, 1.0)
    expect(err <= tol * scale, f"{what}: max error {err:.3g} > {tol:g} x {scale:.3g}")


# ------------------------------------------------------------- cp_halo_sum


def scenario_halo_sum():
    """cp_halo_sum is the exchange's backward, bit for bit (the oracle of
    ranks.py), multi-hop and with empty shards; its backward is the exchange.
    Then the path of CUDA tensors, with CPU tensors through the staging code."""
    check_halo_sum(((1, 2), (0, 3), (2, 0), (4, 1)))
    with halocp._cuda.stage_cpu():
        check_halo_sum(((1, 2),))
    ranks.raises(lambda: halocp.cp_halo_sum(torch.zeros(2, 3, 2, 4), 2, 1, 2), halocp.ERR_INVALID_ARGUMENT,
                 "a y shorter than its halos")


def check_halo_sum(halos):
    gen = torch.Generator().manual_seed(7)
    for lengths in splits():
        for left, right in halos:
            ys = [random_values((2, 3, n + left + right, 4), torch.float32, gen) for n in lengths]
            y = ys[ranks.RANK].clone().requires_grad_()
            out = halocp.cp_halo_sum(y, left, right, 2)
            what = f"cp_halo_sum L={left} R={right} shards {lengths}"
            expect_bits(out.detach(), oracle_backward(ys, lengths, ranks.RANK, left, right, 2), what)
            gs = [random_values((2, 3, n, 4), torch.float32, gen) for n in lengths]
            out.backward(gs[ranks.RANK])
            expect_bits(y.grad, oracle_forward(gs, ranks.RANK, left, right, 2), what + ": backward")


# --------------------------------------------------------------- GroupNorm


class _LargestAllocation(TorchDispatchMode):
    """The most elements any op's output had (every allocation torch makes
    for a tensor is some op's output), and the collectives run."""

    def __init__(self):
        super().__init__()
        self.largest = 0
        self.collectives = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            self.collectives.append(func.__name__.split(".")[0])
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


# dtype -> (tolerance relative to the reference's largest value, offset of
# the data's mean): the reference is torch's GroupNorm in float64. A mean
# far from 0 beside a spread of 1 is what a naive E[x^2] - E[x]^2 gets wrong.
NORM_CASES = [(torch.float32, 2e-5, 0.0), (torch.float32, 2e-4, 500.0), (torch.float64, 1e-12, 0.0),
              (torch.bfloat16, 3e-2, 0.0), (torch.float16, 5e-3, 3.0)]


def scenario_groupnorm():
    """halocp.nn.GroupNorm == torch.nn.GroupNorm on the whole tensor: the
    output, the input gradient and the weight and bias gradients summed
    over ranks; the statistics are the same bits on every rank; no op
    allocates more than the shard."""
    for lengths in splits():
        for i, (dtype, tol, offset) in enumerate(NORM_CASES):
            torch.manual_seed(200 + i)
            layer = halocp.nn.GroupNorm(3, 6, eps=1e-5)
            with torch.no_grad():
                layer.weight.normal_()
                layer.bias.normal_()
            full = torch.nn.GroupNorm(3, 6, eps=1e-5, dtype=torch.float64)
            full.load_state_dict(layer.state_dict())
            layer.to(dtype)
            xg = (torch.randn(2, 6, sum(lengths), 3, 4, dtype=torch.float64) + offset).to(dtype)
            gg = torch.randn(2, 6, sum(lengths), 3, 4, dtype=torch.float64).to(dtype)
            xg64 = xg.double().clone().requires_grad_()
            full(xg64).backward(gg.double())

            x = shard(xg, lengths).clone().requires_grad_()
            with _LargestAllocation() as seen:
                y = layer(x)
                forward_collectives = list(seen.collectives)
                y.backward(shard(gg, lengths))
            what = f"GroupNorm {dtype} mean {offset} shards {lengths}"
            expect(y.dtype == dtype and x.grad.dtype == dtype, f"{what}: dtypes {y.dtype}, {x.grad.dtype}")
            close(y, shard(full(xg64).detach(), lengths), tol, what + ": output")
            close(x.grad, shard(xg64.grad, lengths), tol, what + ": input grad")
            close(summed(layer.weight.grad.double()), full.weight.grad, tol, what + ": weight grad")
            close(summed(layer.bias.grad.double()), full.bias.grad, tol, what + ": bias grad")
            if ranks.WORLD > 1:
                backward_collectives = seen.collectives[len(forward_collectives):]
                expect(forward_collectives == ["allgather_"] and backward_collectives == ["allreduce_"],
                       f"{what}: collectives {forward_collectives} forward, {backward_collectives} backward")
            if ranks.WORLD > 1 and xg.numel() > x.numel() and x.numel():
                # Or the statistics' message: a header and room for a few
                # numbers per (sample, group), from every rank (norm.py).
                from halocp import norm
                bound = max(x.numel(), ranks.WORLD * (norm._HEADER + norm._capacity[dist.group.WORLD]))
                expect(seen.largest <= bound, f"{what}: an op allocated {seen.largest} elements, more than "
                                              f"the shard's {x.numel()} (the whole tensor has {xg.numel()})")
    # No affine parameters, a channels_last_3d shard.
    lengths = splits()[0]
    layer, full = halocp.nn.GroupNorm(2, 6, affine=False), torch.nn.GroupNorm(2, 6, affine=False)
    xg = torch.randn(2, 6, sum(lengths), 3, 4, requires_grad=True)
    gg = torch.randn(2, 6, sum(lengths), 3, 4)
    yg = full(xg)
    yg.backward(gg)
    x = shard(xg.detach(), lengths).contiguous(memory_format=torch.channels_last_3d).requires_grad_()
    y = layer(x)
    y.backward(shard(gg, lengths))
    close(y, shard(yg.detach(), lengths), 2e-5, "GroupNorm without affine, channels_last_3d: output")
    close(x.grad, shard(xg.grad, lengths), 2e-5, "GroupNorm without affine, channels_last_3d: input grad")
    # The statistics every rank uses: the same bits everywhere. And the same
    # bits from run to run, forward and backward.
    from halocp.norm import _global_statistics
    x = torch.randn(2, 6, splits()[0][ranks.RANK], 3, 4) * 3 + 1
    stats = torch.stack(_global_statistics(x, 3, None))
    for other in ranks.gather(stats):
        expect_bits(other, stats, "the statistics of another rank")
    layer = halocp.nn.GroupNorm(3, 6)
    runs = []
    for _ in range(2):
        xr = x.clone().requires_grad_()
        y = layer(xr)
        y.backward(torch.ones_like(y) + torch.arange(y.shape[2]).view(1, 1, -1, 1, 1))
        runs.append((y.detach(), xr.grad))
    expect_bits(runs[1][0], runs[0][0], "GroupNorm's output, run twice")
    expect_bits(runs[1][1], runs[0][1], "GroupNorm's input gradient, run twice")
    layer = halocp.nn.GroupNorm(3, 6)
    ranks.raises(lambda: layer(torch.zeros(2, 4, 3, 3)), halocp.ERR_INVALID_ARGUMENT, "a GroupNorm of the wrong C")


# Each disagreement a GroupNorm can meet, on the last rank: (what, the
# layer's arguments there and on the others, the input's shape there and on
# the others, whether the input needs a gradient there and on the others).
# The last num_groups case needs more numbers than the statistics' first
# message holds (64 groups on the odd rank): it must fail as cleanly.
NORM_MISMATCHES = [
    ("num_groups", (dict(num_groups=4, num_channels=4), dict(num_groups=2, num_channels=4)), ((1, 4, 2, 3, 3),) * 2),
    ("batch", (dict(num_groups=2, num_channels=4),) * 2, ((2, 4, 2, 3, 3), (1, 4, 2, 3, 3))),
    ("channels", (dict(num_groups=2, num_channels=6), dict(num_groups=2, num_channels=4)),
     ((1, 6, 2, 3, 3), (1, 4, 2, 3, 3))),
    ("eps", (dict(num_groups=2, num_channels=4, eps=1e-3), dict(num_groups=2, num_channels=4)), ((1, 4, 2, 3, 3),) * 2),
    ("affine", (dict(num_groups=2, num_channels=4, affine=False), dict(num_groups=2, num_channels=4)),
     ((1, 4, 2, 3, 3),) * 2),
    ("frame", (dict(num_groups=2, num_channels=4),) * 2, ((1, 4, 2, 3, 4), (1, 4, 2, 4, 3))),
    ("input grad", (dict(num_groups=2, num_channels=4),) * 2, ((1, 4, 2, 3, 3),) * 2),
    ("num_groups, 64 of them", (dict(num_groups=64, num_channels=64), dict(num_groups=32, num_channels=64)),
     ((1, 64, 2, 2, 2),) * 2),
]

# What each rank's part of the message says: the field's value on the last
# rank, then on the others.
NORM_SAID = {"num_groups": ("num_groups 4", "num_groups 2"), "batch": ("batch 2", "batch 1"),
             "channels": ("channels 6", "channels 4"), "eps": ("eps 0.001", "eps 1e-05"),
             "affine": ("affine False", "affine True"), "frame": ("frame 3x4", "frame 4x3"),
             "input grad": ("input grad False", "input grad True"),
             "num_groups, 64 of them": ("num_groups 64", "num_groups 32")}


# An input that one rank's layer refuses (its C is not the layer's, too
# few dims for the sharded one): every rank raises the same
# ERR_INVALID_ARGUMENT naming it, rather than the others waiting for it in
# the collective. (what, the input's shape there and on the others, said.)
NORM_REFUSED = [("input channels", (1, 6, 2, 3, 3), (1, 4, 2, 3, 3), "channels 6, num_channels 4"),
                ("input dims", (1, 4), (1, 4, 2, 3, 3), "dims 2")]


def norm_refused_cases():
    odd = ranks.RANK == ranks.WORLD - 1
    for what, there, here, said in NORM_REFUSED:
        yield what, said, halocp.nn.GroupNorm(2, 4), torch.randn(there if odd else here)


def check_norm_refused(what, said, call):
    msg = ranks.raises(call, halocp.ERR_INVALID_ARGUMENT, f"a GroupNorm whose {what} one rank refuses")
    every = [None] * ranks.WORLD
    dist.all_gather_object(every, msg)
    expect(all(m == msg for m in every), f"{what}: the ranks' messages differ: {every}")
    expect(f"rank {ranks.WORLD - 1}: " in msg and said in msg and "rank 0:" not in msg, f"{what}: the message: {msg}")


def norm_mismatch_cases():
    """(what, layer, x) of each disagreement, as this rank holds it."""
    odd = ranks.RANK == ranks.WORLD - 1
    for what, layer_args, shapes in NORM_MISMATCHES:
        x = torch.randn(shapes[0] if odd else shapes[1])
        x.requires_grad_(not (odd and what == "input grad"))
        yield what, halocp.nn.GroupNorm(**layer_args[0 if odd else 1]), x


def check_norm_mismatch(what, call):
    """call raises the same HaloError(ERR_MISMATCH) on every rank, at once,
    naming the last rank, the field and both values."""
    msg = ranks.raises(call, halocp.ERR_MISMATCH, f"GroupNorms whose {what} differs")
    said = [None] * ranks.WORLD
    dist.all_gather_object(said, msg)
    expect(all(m == msg for m in said), f"{what}: the ranks' messages differ: {said}")
    odd, rest = NORM_SAID[what]
    expect(f"rank {ranks.WORLD - 1}: {odd}" in msg and f"rank 0: {rest}" in msg, f"{what}: the message: {msg}")
    for r in range(1, ranks.WORLD - 1):  # ranks that agree with rank 0 are not named
        expect(f"rank {r}:" not in msg, f"{what}: the message names rank {r}, which agrees: {msg}")
    return msg


def check_norm_after(what):
    """An agreeing GroupNorm after a disagreement: torch's results, one
    collective each way."""
    lengths = splits()[0]
    torch.manual_seed(250)
    layer, full = halocp.nn.GroupNorm(2, 4), torch.nn.GroupNorm(2, 4)
    xg = torch.randn(1, 4, sum(lengths), 3, 3, requires_grad=True)
    yg = full(xg)
    yg.backward(torch.ones_like(yg))
    x = shard(xg.detach(), lengths).clone().requires_grad_()
    y = layer(x)
    y.backward(torch.ones_like(y))
    close(y, shard(yg.detach(), lengths), 2e-5, f"GroupNorm after the {what} mismatch: output")
    close(x.grad, shard(xg.grad, lengths), 2e-5, f"GroupNorm after the {what} mismatch: input grad")


def scenario_norm_mismatch():
    """Ranks whose GroupNorms disagree (num_groups, batch, channels, eps,
    affine, the frame's shape, whether the input needs a gradient) all raise
    the same HaloError(ERR_MISMATCH) naming the rank and the values that
    differ: no abort inside the collective, no hang, no silent wrong result;
    an input one rank refuses is ERR_INVALID_ARGUMENT on every rank; the
    group works after each. Then a layer whose statistics outgrow the
    first message: one more message on its first call only."""
    if ranks.WORLD == 1:
        return
    for what, layer, x in norm_mismatch_cases():
        check_norm_mismatch(what, lambda: layer(x))
        check_norm_after(what)
    for what, said, layer, x in norm_refused_cases():
        check_norm_refused(what, said, lambda: layer(x))
        check_norm_after(what)
    torch.manual_seed(260)
    lengths = splits()[0]
    layer, full = halocp.nn.GroupNorm(64, 128), torch.nn.GroupNorm(64, 128)
    xg = torch.randn(3, 128, sum(lengths), 2, 2)
    x = shard(xg, lengths)
    for call in range(2):
        with _LargestAllocation() as seen:
            y = layer(x)
        want = ["allgather_", "allgather_"] if call == 0 else ["allgather_"]
        expect(seen.collectives == want, f"GroupNorm(64) of 3 samples, call {call}: collectives {seen.collectives}")
        close(y, shard(full(xg).detach(), lengths), 2e-5, f"GroupNorm(64) of 3 samples, call {call}")


# ----------------------------------------------------------- ConvTranspose3d

# (kernel, stride, padding, output_padding, dilation, groups): temporal
# first; some with spatial arguments of their own.
TRANSPOSE_CASES = [
    dict(kernel_size=(4, 3, 3), stride=(2, 1, 1), padding=(1, 1, 1)),  # the decoders' x2 upsampling
    dict(kernel_size=3, stride=2, padding=1, output_padding=1),
    dict(kernel_size=(3, 2, 3), stride=(2, 2, 1), padding=(1, 0, 1), output_padding=(0, 1, 0)),  # one frame short
    dict(kernel_size=(5, 1, 1), stride=(1, 1, 1), padding=(0, 0, 0)),  # 4 frames go right: several hops
    dict(kernel_size=(5, 3, 1), stride=(3, 1, 1), padding=(3, 1, 0), output_padding=(2, 0, 0)),
    dict(kernel_size=(3, 1, 1), stride=(2, 1, 1), dilation=(2, 1, 1), groups=2),
    dict(kernel_size=(2, 1, 1), stride=(2, 1, 1)),  # no overlap, no exchange
    dict(kernel_size=(1, 1, 1), stride=(3, 1, 1), output_padding=(2, 0, 0)),  # gaps between the frames
]


def transposed_range(lengths, rank, s, out_len):
    """The output frames rank holds: [a*s, (a+n)*s), the last rank's to the
    end, clipped to the output."""
    a = offsets(lengths)[rank]
    start = min(a * s, out_len)
    end = out_len if rank == len(lengths) - 1 else min((a + lengths[rank]) * s, out_len)
    return start, end - start


def scenario_transpose():
    """halocp.nn.ConvTranspose3d == torch.nn.ConvTranspose3d on the whole
    tensor: outputs, input gradients, weight and bias gradients summed."""
    for lengths in splits():
        for i, kw in enumerate(TRANSPOSE_CASES):
            dtypes = ((torch.float64, 1e-12),) + (((torch.float32, 1e-5), (torch.bfloat16, 3e-2)) if i < 2 else ())
            for dtype, tol in dtypes:
                torch.manual_seed(300 + i)
                layer = halocp.nn.ConvTranspose3d(4, 6, dtype=dtype, **kw)
                full = torch.nn.ConvTranspose3d(4, 6, dtype=dtype, **kw)
                full.load_state_dict(layer.state_dict())
                xg = torch.randn(2, 4, sum(lengths), 3, 4, dtype=dtype, requires_grad=True)
                yg = full(xg)
                gg = torch.randn_like(yg)
                yg.backward(gg)

                x = shard(xg.detach(), lengths).clone().requires_grad_()
                y = layer(x)
                start, count = transposed_range(lengths, ranks.RANK, layer.stride[0], yg.shape[2])
                y.backward(gg.narrow(2, start, count))
                what = f"{layer} {dtype} shards {lengths}"
                close(y, yg.detach().narrow(2, start, count), tol, what + ": output")
                close(x.grad, shard(xg.grad, lengths), tol, what + ": input grad")
                close(summed(layer.weight.grad), full.weight.grad, tol, what + ": weight grad")
                close(summed(layer.bias.grad), full.bias.grad, tol, what + ": bias grad")
    if ranks.WORLD > 1:  # ranks that disagree on the layer all say so
        layer = halocp.nn.ConvTranspose3d(2, 2, 3, stride=2 + (ranks.RANK == ranks.WORLD - 1))
        msg = ranks.raises(lambda: layer(torch.randn(1, 2, 2, 3, 3)), halocp.ERR_MISMATCH, "strides that differ")
        expect(f"rank {ranks.WORLD - 1}: kernel 3, stride 3" in msg, f"the message: {msg}")
        # What the boundary frames a rank sends were computed with, though the
        # output's shape is the same: groups, the spatial arguments.
        odd = ranks.RANK == ranks.WORLD - 1
        for what, kw, said in (("groups", dict(groups=2 if odd else 1), "groups 2"),
                               ("spatial kernels", dict(kernel_size=(3, 3, 3) if odd else (3, 1, 1),
                                                        padding=(1, 1, 1) if odd else (1, 0, 0)), "kernel h 3")):
            layer = halocp.nn.ConvTranspose3d(4, 4, kw.pop("kernel_size", 3), stride=2, **dict(dict(padding=1), **kw))
            msg = ranks.raises(lambda: layer(torch.randn(1, 4, 3, 4, 4)), halocp.ERR_MISMATCH,
                               f"ConvTranspose3d {what} that differ")
            expect(f"rank {ranks.WORLD - 1}: " in msg and said in msg, f"{what}: the message: {msg}")
        # An input one rank refuses: every rank says so, the same words (the
        # others would otherwise wait for it in the shard table's collective).
        layer = halocp.nn.ConvTranspose3d(2, 2, 3, stride=2, padding=1)
        x = torch.randn(1, 3 if odd else 2, 3, 4, 4)
        msg = ranks.raises(lambda: layer(x), halocp.ERR_INVALID_ARGUMENT, "a ConvTranspose3d input one rank refuses")
        every = [None] * ranks.WORLD
        dist.all_gather_object(every, msg)
        expect(all(m == msg for m in every), f"ConvTranspose3d's refusal: the ranks' messages differ: {every}")
        expect(f"rank {ranks.WORLD - 1}: dims 5, C 3" in msg and "rank 0:" not in msg,
               f"ConvTranspose3d's refusal: the message: {msg}")


def scenario_subgroups():
    """DP x CP: at W = 4, groups [0, 1] and [2, 3] each run GroupNorm and
    ConvTranspose3d on their own clip, at once (shard lengths by group rank)."""
    if ranks.WORLD != 4:
        return
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # collective: every rank makes both
    pair, me = ranks.RANK // 2, ranks.RANK % 2
    group = pairs[pair]
    lengths = [[2, 5], [4, 1]][pair]
    a, n = sum(lengths[:me]), lengths[me]
    torch.manual_seed(500 + pair)  # each pair its own weights and clip
    norm, conv = halocp.nn.GroupNorm(2, 4, group=group), halocp.nn.ConvTranspose3d(4, 3, 4, stride=2, padding=1,
                                                                                     group=group)
    full_norm, full_conv = torch.nn.GroupNorm(2, 4), torch.nn.ConvTranspose3d(4, 3, 4, stride=2, padding=1)
    full_norm.load_state_dict(norm.state_dict())
    full_conv.load_state_dict(conv.state_dict())
    xg = torch.randn(1, 4, sum(lengths), 3, 3, requires_grad=True)
    yg = full_conv(full_norm(xg))
    gg = torch.randn_like(yg)
    yg.backward(gg)
    x = xg.detach().narrow(2, a, n).clone().requires_grad_()
    y = conv(norm(x))
    y.backward(gg.narrow(2, 2 * a, 2 * n))
    what = f"group {pair} rank {me}"
    close(y, yg.detach().narrow(2, 2 * a, 2 * n), 1e-5, what + ": output")
    close(x.grad, xg.grad.narrow(2, a, n), 1e-5, what + ": input grad")


# ---------------------------------------------------------- the VAE blocks


def scenario_temporal_padding():
    """CausalConv3d and CenteredConv3d (stride 1 and 2) with a temporal
    padding mode apart from the spatial one, CogVideoX's and LTX-Video's
    way: F.pad along T with temporal_padding_mode, then torch's Conv3d with
    zero (or reflect) spatial padding, on the whole clip. Uneven and empty
    shards; outputs, input gradients and summed weight gradients."""
    import torch.nn.functional as F

    configs = [
        (halocp.nn.CausalConv3d, dict(kernel_size=3, padding=1), "replicate", "zeros"),
        (halocp.nn.CausalConv3d, dict(kernel_size=3, padding=1, stride=(2, 1, 1)), "replicate", "zeros"),
        (halocp.nn.CenteredConv3d, dict(kernel_size=3, padding=1), "replicate", "zeros"),
        (halocp.nn.CenteredConv3d, dict(kernel_size=3, padding=1), "zeros", "reflect"),
    ]
    for lengths in splits():
        total = sum(lengths)
        for i, (cls, kw, tmode, smode) in enumerate(configs):
            torch.manual_seed(700 + i)
            layer = cls(2, 3, dtype=torch.float64, padding_mode=smode, temporal_padding_mode=tmode, **kw)
            full = torch.nn.Conv3d(2, 3, layer.kernel_size, layer.stride, 0, layer.dilation, dtype=torch.float64)
            full.load_state_dict(layer.state_dict())
            xg = torch.randn(1, 2, total, 4, 3, dtype=torch.float64, requires_grad=True)
            t = F.pad(xg, (0, 0, 0, 0, layer.left, layer.right), "constant" if tmode == "zeros" else tmode)
            ph, pw = layer.padding[1], layer.padding[2]
            yg = full(F.pad(t, (pw, pw, ph, ph, 0, 0), "constant" if smode == "zeros" else smode))
            gg = torch.randn_like(yg)
            yg.backward(gg)
            x = shard(xg.detach(), lengths).clone().requires_grad_()
            y = layer(x)
            # This rank's outputs: those of the inputs j*s it holds.
            s, a, n = layer.stride[0], offsets(lengths)[ranks.RANK], lengths[ranks.RANK]
            first, count = -(-a // s), -(-(a + n) // s) - -(-a // s)
            what = f"{layer} over {lengths}"
            close(y, yg.detach().narrow(2, first, count), 1e-12, f"{what}: output")
            y.backward(gg.narrow(2, first, count))
            close(x.grad, shard(xg.grad, lengths), 1e-12, f"{what}: input grad")
            close(summed(layer.weight.grad), full.weight.grad, 1e-12, f"{what}: weight grad")
            close(summed(layer.bias.grad), full.bias.grad, 1e-12, f"{what}: bias grad")


# Shards of a float32 activation whose every rank with two outputs or more
# falls under torch's batch-of-one cut to slow_conv3d (C*T*H <= 20480).
KERNEL_SPLITS = {1: [20], 2: [9, 12], 3: [7, 0, 13], 4: [5, 6, 1, 9]}


def scenario_conv_kernels():
    """Issue 32: the temporal convolutions (the padded path: replicate in
    time, stride 1 and 2; the fused one: zeros) keep torch's oneDNN kernels on float32 shards of a
    batch of one, where torch would take slow_conv3d (10-15x slower), and
    still give the whole clip's outputs and gradients (float64 oracle).
    torch.profiler names the kernels; one thread, as each rank of a CP run."""
    import torch.nn.functional as F
    from torch.profiler import profile

    lengths = KERNEL_SPLITS[ranks.WORLD]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        # (frames-major: (N, T, C, H, W) in memory, as a per-frame 2-d layer's output viewed back as 3-d)
        # (zeros in time: the fused path, which convolves the shard and the halos' windows apart)
        for i, (cls, stride, tmode, frames_major) in enumerate([
                (halocp.nn.CausalConv3d, 1, "replicate", False), (halocp.nn.CenteredConv3d, 1, "replicate", False),
                (halocp.nn.CausalConv3d, (2, 1, 1), "replicate", False), (halocp.nn.CausalConv3d, 1, "replicate", True),
                (halocp.nn.CausalConv3d, 1, "zeros", False), (halocp.nn.CenteredConv3d, 1, "zeros", True)]):
            torch.manual_seed(900 + i)
            layer = cls(16, 8, 3, stride=stride, padding=1, temporal_padding_mode=tmode)
            full = torch.nn.Conv3d(16, 8, 3, layer.stride, (0, 1, 1), dtype=torch.float64)
            full.load_state_dict(layer.state_dict())
            xg = torch.randn(1, 16, sum(lengths), 32, 32, dtype=torch.float64, requires_grad=True)
            yg = full(F.pad(xg, (0, 0, 0, 0, layer.left, layer.right), "constant" if tmode == "zeros" else tmode))
            gg = torch.randn_like(yg)
            yg.backward(gg)
            x = shard(xg.detach(), lengths).float()
            if frames_major:
                x = x.transpose(1, 2).contiguous().transpose(1, 2)
            x.requires_grad_()
            s, a, n = layer.stride[0], offsets(lengths)[ranks.RANK], lengths[ranks.RANK]
            first, count = -(-a // s), -(-(a + n) // s) - -(-a // s)
            with profile() as prof:
                y = layer(x)
                y.backward(gg.narrow(2, first, count).float())
            what = f"{layer} over {lengths}, float32{', frames-major' if frames_major else ''}"
            slow = sorted({e.key for e in prof.key_averages() if "slow_conv3d" in e.key})
            expect(count < 2 or not slow, f"{what}: rank {ranks.RANK} ({count} output frames) ran {slow}")
            close(y, yg.detach().narrow(2, first, count), 1e-5, f"{what}: output")
            close(x.grad, shard(xg.grad, lengths), 1e-5, f"{what}: input grad")
            close(summed(layer.weight.grad), full.weight.grad, 1e-5, f"{what}: weight grad")
            close(summed(layer.bias.grad), full.bias.grad, 1e-5, f"{what}: bias grad")
    finally:
        torch.set_num_threads(threads)


def scenario_conv_agreed_once():
    """A stride-1 conv that keeps the count (causal, centred) makes its
    shard table once, to agree: its later calls, with other lengths on every
    rank, need nothing of the others' (halocp.nn._split_once) and still give
    the whole clip's outputs. A layer changed on one rank after that makes
    the table alone: every rank fails with ERR_MISMATCH, none hangs."""
    import torch.nn.functional as F

    import halocp._splits as splits

    calls, real = [0], splits.ShardTable.rows

    def counted(group, row):
        calls[0] += 1
        return real(group, row)

    splits.ShardTable.rows = staticmethod(counted)
    try:
        torch.manual_seed(5)
        layer = halocp.nn.CausalConv3d(2, 3, 3, padding=1, temporal_padding_mode="replicate").double()
        full = torch.nn.Conv3d(2, 3, 3, 1, (0, 1, 1), dtype=torch.float64)
        full.load_state_dict(layer.state_dict())
        for step, lengths in enumerate(([2, 3, 1, 2], [1, 0, 4, 2], [3, 3, 3, 3])):
            lengths = lengths[:ranks.WORLD]
            xg = torch.randn(1, 2, sum(lengths), 4, 4, dtype=torch.float64)
            yg = full(F.pad(xg, (0, 0, 0, 0, 2, 0), "replicate"))
            close(layer(shard(xg, lengths)), shard(yg, lengths), 1e-12, f"step {step}: output over {lengths}")
        expect(calls[0] == 1, f"{calls[0]} shard tables for 3 calls of a stride-1 conv (want the first's alone)")
    finally:
        splits.ShardTable.rows = staticmethod(real)
    if ranks.WORLD > 1:
        if ranks.RANK == ranks.WORLD - 1:
            layer.stride = (2, 1, 1)
        ranks.raises(lambda: layer(torch.randn(1, 2, 4, 4, 4, dtype=torch.float64)), halocp.ERR_MISMATCH,
                     "a conv changed on one rank after its agreement", within=15)


def scenario_pooling():
    """AvgPool3d and MaxPool3d over a sharded T (CogVideoX's pairwise
    temporal average, padded, strided and dilated windows), uneven and
    empty shards, against torch's layer on the whole clip: outputs and
    input gradients, bit for bit where the same frames are pooled in the
    same order (they are: a window is never split across ranks' sums)."""
    configs = [
        (halocp.nn.AvgPool3d, torch.nn.AvgPool3d, dict(kernel_size=(2, 1, 1), stride=(2, 1, 1))),
        (halocp.nn.AvgPool3d, torch.nn.AvgPool3d, dict(kernel_size=3, stride=(2, 2, 1), padding=1)),
        (halocp.nn.AvgPool3d, torch.nn.AvgPool3d, dict(kernel_size=(3, 2, 2), stride=1, padding=(0, 1, 0),
                                                       count_include_pad=False)),
        (halocp.nn.AvgPool3d, torch.nn.AvgPool3d, dict(kernel_size=(2, 2, 1), stride=(1, 2, 1), padding=(1, 0, 0),
                                                       divisor_override=3)),
        (halocp.nn.MaxPool3d, torch.nn.MaxPool3d, dict(kernel_size=(3, 2, 2), stride=(2, 2, 2), padding=(1, 0, 0))),
        (halocp.nn.MaxPool3d, torch.nn.MaxPool3d, dict(kernel_size=(2, 3, 3), stride=1, padding=1, dilation=(2, 1, 1))),
    ]
    for lengths in splits():
        total = sum(lengths)
        a, n = offsets(lengths)[ranks.RANK], lengths[ranks.RANK]
        for i, (ours, theirs, kw) in enumerate(configs):
            layer, full = ours(**kw), theirs(**kw)
            torch.manual_seed(800 + i)
            xg = torch.randn(2, 3, total, 4, 5, dtype=torch.float64, requires_grad=True)
            k, s = layer._k[0], layer._s[0]
            try:
                yg = full(xg)
            except RuntimeError:  # torch refuses a clip this short (every rank alike)
                continue
            gg = torch.randn_like(yg)
            yg.backward(gg)
            first = min(-(-a // s), yg.shape[2])
            last = yg.shape[2] if ranks.RANK == ranks.WORLD - 1 else min(-(-(a + n) // s), yg.shape[2])
            x = shard(xg.detach(), lengths).clone().requires_grad_()
            y = layer(x)
            what = f"{layer} over {lengths}"
            expect_bits(y, yg.detach().narrow(2, first, max(last - first, 0)), f"{what}: output")
            y.backward(gg.narrow(2, first, max(last - first, 0)))
            close(x.grad, shard(xg.grad, lengths), 1e-12, f"{what}: input grad")
    # Ranks that disagree on the window all fail alike.
    if ranks.WORLD > 1:
        layer = halocp.nn.AvgPool3d((2 + ranks.RANK % 2, 1, 1), stride=(2, 1, 1))
        try:
            layer(torch.randn(1, 1, 4, 2, 2))
        except halocp.HaloError as e:
            expect(e.code == halocp.ERR_MISMATCH and "disagree on the window" in str(e), f"mismatch: {e}")
        else:
            raise ranks.Failure("ranks with different pooling windows raised nothing")


def scenario_vae():
    """The example's causal encoder and decoder blocks, sharded, == the same
    blocks on one process: outputs and every gradient."""
    import vae_block

    lengths = {1: [7], 2: [3, 6], 3: [4, 1, 4], 4: [3, 2, 0, 4]}[ranks.WORLD]
    for i, padding_mode in enumerate(("replicate", "zeros")):
        torch.manual_seed(400 + i)
        whole = vae_block.VAEBlocks(4, 8, padding_mode=padding_mode).double()
        sharded = vae_block.VAEBlocks(4, 8, padding_mode=padding_mode, group=dist.group.WORLD).double()
        sharded.load_state_dict(whole.state_dict())
        xg = torch.randn(1, 4, sum(lengths), 6, 6, dtype=torch.float64, requires_grad=True)
        latent_g, yg = whole(xg)
        gl, gy = torch.randn_like(latent_g), torch.randn_like(yg)
        torch.autograd.backward((latent_g, yg), (gl, gy))

        x = shard(xg.detach(), lengths).clone().requires_grad_()
        latent, y = sharded(x)
        # The encoder's stride-2 conv gives output j to the rank holding
        # input 2j; the decoder maps a shard of m latent frames to 2m.
        lat_len = [len(range(-(-a // 2), -(-(a + n) // 2))) for a, n in zip(offsets(lengths), lengths)]
        lat_g = shard(latent_g.detach(), lat_len)
        out_len = [2 * m for m in lat_len]
        torch.autograd.backward((latent, y), (shard(gl, lat_len), shard(gy, out_len)))
        what = f"VAE blocks ({padding_mode}) shards {lengths}"
        tol = 1e-10
        close(latent, lat_g, tol, what + ": latent")
        close(y, shard(yg.detach(), out_len), tol, what + ": decoded")
        close(x.grad, shard(xg.grad, lengths), tol, what + ": input grad")
        for (name, p), q in zip(sharded.named_parameters(), whole.parameters()):
            close(summed(p.grad), q.grad, tol, f"{what}: grad of {name}")


# ------------------------------------------------------------- cp_attention


def scenario_attention():
    """cp_attention against torch's scaled_dot_product_attention over the
    whole sequence, causal and not, forward and backward (queries, keys and
    values), under no_grad too, on uneven and empty shards; keys and values
    of different widths; shards whose lengths differ refused on every rank."""
    import torch.nn.functional as F

    for i, lengths in enumerate(splits()):
        for causal in (True, False):
            gen = torch.Generator().manual_seed(500 + i)
            t = sum(lengths)
            qg, kg = (torch.randn(3, 2, t, 8, generator=gen, dtype=torch.float64, requires_grad=True) for _ in "qk")
            vg = torch.randn(3, 2, t, 5, generator=gen, dtype=torch.float64, requires_grad=True)
            yg = F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal, scale=0.3)
            gy = torch.randn(yg.shape, generator=gen, dtype=torch.float64)
            yg.backward(gy)
            q, k, v = (shard(a.detach(), lengths).clone().requires_grad_() for a in (qg, kg, vg))
            y = halocp.cp_attention(q, k, v, causal=causal, scale=0.3)
            y.backward(shard(gy, lengths))
            what = f"cp_attention (causal {causal}) shards {lengths}"
            close(y, shard(yg.detach(), lengths), 1e-12, what)
            for name, a, ag in (("query", q, qg), ("key", k, kg), ("value", v, vg)):
                close(a.grad, shard(ag.grad, lengths), 1e-12, f"{what}: grad of {name}")
            with torch.no_grad():
                close(halocp.cp_attention(q, k, v, causal=causal, scale=0.3), shard(yg.detach(), lengths), 1e-12,
                      what + " under no_grad")
    bad = ranks.WORLD - 1
    q = torch.zeros(1, 2, 3, 4)
    try:
        halocp.cp_attention(q, q[:, :, :2] if ranks.RANK == bad else q, q)
    except halocp.HaloError as e:
        expect(e.code == halocp.ERR_INVALID_ARGUMENT and f"not on rank(s) {bad}" in str(e), str(e))
    else:
        raise ranks.Failure("cp_attention took a key shorter than its query")


if __name__ == "__main__":
    ranks.main(globals())
