"""One rank of the torch.compile tests: models using every exchange and
every halocp.nn layer, compiled with fullgraph=True (any graph break is an
error) through AOTAutograd, against the same models run eagerly; uneven
shards, empty ones and ranks with no output included. tests/python/
test_compile.py starts 2 of them.

    ranks_compile.py SCENARIO...
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch._dynamo.testing import CompileCounterWithBackend

import halocp
import ranks
from ranks import expect, expect_bits


class _Model(torch.nn.Module):
    """cp_halo_exchange, halos, halo_exchange_ and CausalConv3d in a row, on
    the time axis (dim 2) of an (N, C, T, H, W) shard."""

    def __init__(self, group):
        super().__init__()
        self.group = group
        self.conv = halocp.nn.CausalConv3d(3, 4, 3, padding=1, group=group)

    def forward(self, x):
        y = halocp.cp_halo_exchange(x, 1, 2, 2, self.group)
        lh, rh = halocp.halos(x * 2, 2, 1, 2, self.group, "replicate")
        padded = torch.cat([torch.zeros_like(lh), x, torch.zeros_like(rh)], 2)
        padded = halocp.halo_exchange_(padded, 2, 1, 2, self.group)
        z = self.conv(x)
        return y.sum(2) + padded.sum(2) + lh.mean(2) + rh.mean(2), z


def _run(model, x):
    x = x.detach().requires_grad_()
    out, z = model(x)
    loss = (out * torch.arange(out.numel(), dtype=out.dtype).reshape(out.shape)).sum() + (z * z).sum()
    loss.backward()
    return out.detach(), z.detach(), x.grad, model.conv.weight.grad.clone()


def _check(group):
    torch.manual_seed(3)
    model = _Model(group)
    x = torch.randn(2, 3, 4 + ranks.RANK, 5, 4)
    want = _run(model, x)
    model.conv.weight.grad = None
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    got = _run(torch.compile(model, backend=counter, fullgraph=True), x)
    expect(counter.frame_count == 1, f"torch.compile made {counter.frame_count} graphs, not 1")
    expect_bits(got[0], want[0], "compiled exchanges' output against eager")
    # The compiled layer convolves the padded shard in one call, the eager one
    # in three pieces (nn.py's fused path): the same sums, in another order.
    for g, w, what in zip(got[1:], want[1:], ("conv output", "grad_x", "conv grad_weight")):
        expect(torch.allclose(g, w, rtol=1e-5, atol=1e-5), f"compiled {what} differs from eager")
    again = _run(torch.compile(model, backend=counter, fullgraph=True), x)  # no recompilation
    expect(counter.frame_count == 1, f"a second call compiled again ({counter.frame_count} graphs)")
    expect_bits(again[2], got[2], "the second compiled call's grad_x")


def scenario_layers():
    """CenteredConv3d (both halos) and GroupNorm across ranks compile into one
    graph too, with the eager results."""
    torch.manual_seed(7)
    model = torch.nn.Sequential(halocp.nn.CenteredConv3d(3, 4, 3, padding=1), halocp.nn.GroupNorm(2, 4))
    x = torch.randn(1, 3, 3 + ranks.RANK, 4, 4)

    def run(m):
        xx = x.detach().requires_grad_()
        y = m(xx)
        (y * y).sum().backward()
        return y.detach(), xx.grad

    want = run(model)
    model.zero_grad()
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    got = run(torch.compile(model, backend=counter, fullgraph=True))
    expect(counter.frame_count == 1, f"torch.compile made {counter.frame_count} graphs, not 1")
    for g, w, what in zip(got, want, ("output", "grad_x")):
        expect(torch.allclose(g, w, rtol=1e-5, atol=1e-5), f"compiled {what} differs from eager")


def scenario_exchanges_bits():
    """Without the layer, compiled gradients are the eager ones bit for bit."""
    torch.manual_seed(5)
    x = torch.randn(2, 3, 3 + ranks.RANK, 2, 2, dtype=torch.float64)

    def f(x):
        y = halocp.cp_halo_exchange(x, 2, 1, 2)
        lh, rh = halocp.halos(x, 1, 3, 2, None, "replicate")
        padded = halocp.halo_exchange_(torch.cat([torch.zeros_like(lh), x * 3, torch.zeros_like(rh)], 2), 1, 3, 2)
        return (y * y).sum() + (lh * 3).sum() + (rh * rh).sum() + (padded * padded).sum()

    def grad(fn):
        xx = x.detach().requires_grad_()
        fn(xx).backward()
        return xx.grad

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    expect_bits(grad(torch.compile(f, backend=counter, fullgraph=True)), grad(f), "compiled grad_x against eager")
    expect(counter.frame_count == 1, f"torch.compile made {counter.frame_count} graphs, not 1")


def scenario_default_group():
    """group=None: the default group."""
    _check(None)


def scenario_new_group():
    """An explicit group, passed to the ops by token."""
    _check(dist.new_group(list(range(ranks.WORLD))))


def _same(model, x, exact=False, what="output", backend="aot_eager"):
    """model compiled with fullgraph=True against model run eagerly: one
    graph, the eager output, input and parameter gradients (bit for bit
    when exact, else to rounding), and a second call that does not compile
    again."""

    def run(m):
        xx = x.detach().requires_grad_()
        y = m(xx)
        (y * torch.linspace(-1, 1, y.numel(), dtype=y.dtype).reshape(y.shape)).sum().backward()
        grads = [xx.grad] + [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        return [y.detach()] + grads

    want = run(model)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    got = run(compiled)
    expect(counter.frame_count == 1, f"{what}: torch.compile made {counter.frame_count} graphs, not 1")
    names = ["output", "grad_x"] + [f"grad {n}" for n, _ in model.named_parameters()]
    for g, w, name in zip(got, want, names):
        if exact:
            expect_bits(g, w, f"{what}: compiled {name} against eager")
        else:
            expect(g.shape == w.shape and torch.allclose(g, w, rtol=1e-5, atol=1e-5),
                   f"{what}: compiled {name} differs from eager ({tuple(g.shape)} vs {tuple(w.shape)})")
    again = run(compiled)
    expect(counter.frame_count == 1, f"{what}: a second call compiled again ({counter.frame_count} graphs)")
    for g, w, name in zip(again, got, names):
        expect_bits(g, w, f"{what}: the second compiled call's {name}")
    return got


def scenario_strided():
    """The general path of the temporal layers: a temporal stride and
    padding modes other than zeros, uneven shards; layers after the strided
    one (GroupNorm, a padded and a stride-1 layer) whose input length is an
    unbacked size."""
    torch.manual_seed(11)
    model = torch.nn.Sequential(
        halocp.nn.CausalConv3d(3, 4, 3, stride=(2, 1, 1), padding=1, padding_mode="replicate"),
        halocp.nn.GroupNorm(2, 4),
        halocp.nn.CenteredConv3d(4, 2, 3, padding=(1, 0), padding_mode="reflect"),
        halocp.nn.CausalConv3d(2, 2, 3, padding=1))
    _same(model, torch.randn(1, 3, 5 + 2 * ranks.RANK, 4, 3), what="strided and padded")
    x = torch.randn(2, 3, 4 + ranks.RANK, 3, 4).to(memory_format=torch.channels_last_3d)
    y = _same(model[0], x, what="channels_last_3d")[0]
    expect(y.is_contiguous(memory_format=torch.channels_last_3d), f"the output's strides {y.stride()}")


def scenario_no_output():
    """A rank whose strided convolution has no output frames (rank 1: its
    2 frames hold no multiple of the stride; GroupNorm after it gets an
    empty shard whose length the graph does not know), and an empty shard
    (rank 0): both still run their part of every exchange, forward and
    backward."""
    torch.manual_seed(13)
    model = torch.nn.Sequential(halocp.nn.CausalConv3d(2, 4, 3, stride=(3, 1, 1), padding=1), halocp.nn.GroupNorm(2, 4))
    y = _same(model, torch.randn(1, 2, 1 + ranks.RANK, 3, 3), what="rank 1 without outputs")[0]
    expect(y.shape[2] == 1 - ranks.RANK, f"rank {ranks.RANK} has {y.shape[2]} output frames")
    layer = halocp.nn.CenteredConv3d(2, 3, 3, stride=(2, 1, 1), padding=1, padding_mode="replicate")
    y = _same(layer, torch.randn(1, 2, 3 * ranks.RANK, 3, 3), what="rank 0 with an empty shard")[0]
    expect(y.shape[2] == 2 * ranks.RANK, f"rank {ranks.RANK} has {y.shape[2]} output frames")
    layer = halocp.nn.CausalConv3d(2, 3, 3, padding=1)  # stride 1, zeros: the empty shard's output is empty
    y = _same(layer, torch.randn(1, 2, 3 * ranks.RANK, 3, 3), what="stride 1, rank 0 with an empty shard")[0]
    expect(y.shape[2] == 3 * ranks.RANK, f"rank {ranks.RANK} has {y.shape[2]} output frames")


def scenario_tiled():
    """The tiled layers and the grid= form: TiledConv2d strided over uneven
    tiles of H, TiledConv3d with a padding mode over W, CausalConv3d tiled
    over T."""
    torch.manual_seed(17)
    along_h, along_w = halocp.TileGrid((2, 1)), halocp.TileGrid((1, 1, 2))
    layer = halocp.nn.TiledConv2d(2, 3, 3, stride=2, padding=1, grid=along_h)
    _same(layer, torch.randn(2, 2, 4 + ranks.RANK, 5), what="TiledConv2d")
    layer = halocp.nn.TiledConv3d(2, 2, 3, padding=1, padding_mode="circular", grid=along_w)
    _same(layer, torch.randn(1, 2, 3, 4, 2 + ranks.RANK), what="TiledConv3d")
    layer = halocp.nn.CausalConv3d(2, 2, 3, padding=1, grid=halocp.TileGrid((2, 1, 1)))
    _same(layer, torch.randn(1, 2, 3 + ranks.RANK, 3, 3), what="CausalConv3d(grid=)")


def scenario_tile_exchange():
    """tile_halo_exchange: bit for bit, with its gradient."""
    torch.manual_seed(19)
    grid = halocp.TileGrid((2, 1))

    class Tiles(torch.nn.Module):
        def forward(self, x):
            return halocp.tile_halo_exchange(x, [(1, 2), 1], [2, 3], grid, "replicate")

    _same(Tiles(), torch.randn(1, 2, 3 + ranks.RANK, 4, dtype=torch.float64), exact=True, what="tile_halo_exchange")


def scenario_mismatch():
    """Ranks whose compiled layers disagree (the temporal stride) all raise
    ERR_MISMATCH naming the ranks, as eager ones do; the group works after."""
    stride = 2 if ranks.RANK == ranks.WORLD - 1 else 3
    layer = halocp.nn.CausalConv3d(2, 2, 3, stride=(stride, 1, 1))
    torch._dynamo.reset()
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    x = torch.randn(1, 2, 4, 3, 3)
    msg = ranks.raises(lambda: compiled(x), halocp.ERR_MISMATCH, "compiled strides that differ")
    expect(f"rank {ranks.WORLD - 1}: kernel 3, stride 2" in msg and "rank 0: kernel 3, stride 3" in msg,
           f"the message: {msg}")
    tconv = torch.compile(halocp.nn.ConvTranspose3d(2, 2, 3, stride=(stride, 1, 1)), backend="aot_eager",
                          fullgraph=True)
    msg = ranks.raises(lambda: tconv(x), halocp.ERR_MISMATCH, "compiled ConvTranspose3d strides")
    expect(f"rank {ranks.WORLD - 1}: kernel 3, stride 2" in msg, f"the message: {msg}")
    groups = 2 if ranks.RANK == ranks.WORLD - 1 else 1
    tconv = torch.compile(halocp.nn.ConvTranspose3d(2, 2, 3, stride=(2, 1, 1), groups=groups), backend="aot_eager",
                          fullgraph=True)
    msg = ranks.raises(lambda: tconv(x), halocp.ERR_MISMATCH, "compiled ConvTranspose3d groups")
    expect(f"rank {ranks.WORLD - 1}: " in msg and "groups 2" in msg, f"the message: {msg}")
    tconv = torch.compile(halocp.nn.ConvTranspose3d(2, 2, 3, stride=(2, 1, 1)), backend="aot_eager", fullgraph=True)
    bad = torch.randn(1, 3, 4, 3, 3) if ranks.RANK == ranks.WORLD - 1 else x
    msg = ranks.raises(lambda: tconv(bad), halocp.ERR_INVALID_ARGUMENT,
                       "a compiled ConvTranspose3d input one rank refuses")
    expect(f"rank {ranks.WORLD - 1}: dims 5, C 3" in msg, f"the message: {msg}")
    _same(halocp.nn.CausalConv3d(2, 2, 3, stride=(2, 1, 1)), torch.randn(1, 2, 4, 3, 3), what="after the mismatch")


def scenario_norm_mismatch():
    """Compiled GroupNorms that disagree (num_groups, batch, channels, eps,
    affine, the frame, the input's gradient) all raise the eager path's
    HaloError(ERR_MISMATCH), the same on every rank, with no abort inside
    the collective (an input one rank refuses: ERR_INVALID_ARGUMENT); an
    agreeing compiled GroupNorm after them is one graph with the eager
    results."""
    from ranks_vae import check_norm_mismatch, check_norm_refused, norm_mismatch_cases, norm_refused_cases

    for what, layer, x in norm_mismatch_cases():
        torch._dynamo.reset()
        compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
        check_norm_mismatch(what, lambda: compiled(x))
    for what, said, layer, x in norm_refused_cases():
        torch._dynamo.reset()
        compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
        check_norm_refused(what, said, lambda: compiled(x))
    torch.manual_seed(37)
    _same(halocp.nn.GroupNorm(2, 4), torch.randn(2, 4, 2 + ranks.RANK, 3, 3), what="GroupNorm after the mismatches")


def scenario_transpose():
    """ConvTranspose3d over uneven shards (rank 0's empty), behind a strided
    CausalConv3d whose output count is data to the graph; cp_halo_sum bit
    for bit."""
    torch.manual_seed(23)
    layer = halocp.nn.ConvTranspose3d(2, 3, (4, 3, 3), stride=(2, 1, 1), padding=1)
    _same(layer, torch.randn(1, 2, 3 * ranks.RANK, 3, 2), what="ConvTranspose3d")
    model = torch.nn.Sequential(
        halocp.nn.CausalConv3d(2, 2, 3, stride=(2, 1, 1), padding=1),
        halocp.nn.ConvTranspose3d(2, 2, 3, stride=(2, 1, 1), padding=1, output_padding=(1, 0, 0)))
    _same(model, torch.randn(1, 2, 4 + 3 * ranks.RANK, 3, 3), what="CausalConv3d then ConvTranspose3d")

    class Sum(torch.nn.Module):
        def forward(self, y):
            return halocp.cp_halo_sum(y * 2, 2, 1, 2)

    _same(Sum(), torch.randn(2, 1, 4 + ranks.RANK, 3, dtype=torch.float64), exact=True, what="cp_halo_sum")


def scenario_group_forms():
    """Every layer under each of the three group forms: None, the default
    group by name and an explicit sub-group (DP x CP needs one)."""
    torch.manual_seed(29)
    sub = dist.new_group(list(range(ranks.WORLD)))
    for name, group in (("None", None), ("WORLD", dist.group.WORLD), ("a new group", sub)):
        layer = halocp.nn.ConvTranspose3d(2, 3, (4, 3, 3), stride=(2, 1, 1), padding=1, group=group)
        _same(layer, torch.randn(1, 2, 2 + ranks.RANK, 3, 2), what=f"ConvTranspose3d, group={name}")
        layer = halocp.nn.CausalConv3d(2, 2, 3, stride=(2, 1, 1), padding=1, group=group)
        _same(layer, torch.randn(1, 2, 3 + ranks.RANK, 3, 2), what=f"CausalConv3d, group={name}")
        norm = halocp.nn.GroupNorm(2, 4, group=group)
        _same(norm, torch.randn(1, 4, 2 + ranks.RANK, 3, 2), what=f"GroupNorm, group={name}")


def scenario_changing_lengths():
    """Shard lengths that change every step, 1-frame shards included, marked
    with halocp.mark_sharded: one graph for them all (a rank's first empty
    shard adds one), and the eager results every step."""
    torch.manual_seed(37)
    model = torch.nn.Sequential(halocp.nn.CausalConv3d(2, 4, 3, padding=1), halocp.nn.GroupNorm(2, 4),
                                halocp.nn.CausalConv3d(4, 2, 3, stride=(2, 1, 1), padding=1))
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    steps = [(3, 4), (1, 5), (2, 2), (4, 1), (1, 1), (5, 3), (0, 2), (6, 6)]
    for s, lengths in enumerate(steps):
        x = torch.randn(1, 2, lengths[ranks.RANK], 3, 3)
        want = model(x)
        got = compiled(halocp.mark_sharded(x.clone(), 2))
        expect(got.shape == want.shape and torch.allclose(got, want, rtol=1e-5, atol=1e-6),
               f"step {s}, lengths {lengths}: compiled output differs from eager")
        empty = any(steps[k][ranks.RANK] == 0 for k in range(s + 1))
        expect(counter.frame_count <= 1 + empty,
               f"step {s}, lengths {lengths}: {counter.frame_count} graphs compiled for changing shard lengths")


def scenario_pooling():
    """AvgPool3d compiles (as the depthwise convolution it is): pairs across
    shards, padded windows, rank 0's empty shard; MaxPool3d is refused there
    while dynamo traces (which reports the HaloError's message as its own
    Unsupported), saying to run it eagerly."""
    torch.manual_seed(41)
    pairs = halocp.nn.AvgPool3d((2, 1, 1), stride=(2, 1, 1))
    _same(pairs, torch.randn(1, 2, 3 + 2 * ranks.RANK, 3, 3), what="AvgPool3d pairs")
    padded = halocp.nn.AvgPool3d(3, stride=(2, 1, 1), padding=1)
    _same(padded, torch.randn(1, 2, 3 * ranks.RANK, 3, 3), what="AvgPool3d padded, rank 0 empty")
    torch._dynamo.reset()
    compiled = torch.compile(halocp.nn.MaxPool3d((2, 1, 1)), backend="aot_eager", fullgraph=True)
    try:
        compiled(torch.randn(1, 2, 4, 3, 3))
    except Exception as e:  # noqa: BLE001 - dynamo's type, the message checked
        expect("MaxPool3d over a sharded time axis does not compile yet" in str(e), f"a compiled MaxPool3d: {e}")
    else:
        raise ranks.Failure("a compiled MaxPool3d ran")


def scenario_inductor():
    """Inductor (the default backend) on a strided layer into a
    ConvTranspose3d: the convolutions over lengths that are data to the
    graph run inside halocp's ops, which inductor does not lower. (About
    20 s of compiling on a loaded 2-CPU machine with a cold cache.)"""
    torch.manual_seed(31)
    model = torch.nn.Sequential(halocp.nn.CausalConv3d(2, 2, 3, stride=(2, 1, 1), padding=1, padding_mode="replicate"),
                                halocp.nn.ConvTranspose3d(2, 2, 3, stride=(2, 1, 1), padding=1))
    _same(model, torch.randn(1, 2, 3 + 2 * ranks.RANK, 3, 3), what="inductor", backend="inductor")


if __name__ == "__main__":
    ranks.main(globals())
