"""One rank of the tests of memory formats, tiles and the strided, dilated,
padded and tiled nn layers; tests/python/test_tiles.py starts W of them (the
helpers and the oracle are ranks.py's).

    ranks_tiles.py SCENARIO...
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import halocp
import ranks
from ranks import expect, expect_bits, gather, offsets, oracle_backward, oracle_forward, random_values

# Grids of W ranks, tested for each W (2-D and 3-D), with their uneven tiles.
GRIDS = {1: [(1, 1), (1, 1, 1)], 2: [(2, 1), (1, 2), (1, 1, 2)], 3: [(3, 1), (1, 3)],
         4: [(2, 2), (1, 4), (2, 1, 2)]}
SPLITS = [[5, 2, 4, 3], [3, 4, 2, 5], [4, 2, 3, 1]]  # tile sizes along grid dim i: SPLITS[i][:ranks]; offsets vary mod 2 and 3

_grids = {}


def grid(shape) -> halocp.TileGrid:
    """The grid of that shape, made once (collectively: the same order on every rank)."""
    if shape not in _grids:
        _grids[shape] = halocp.TileGrid(shape)
    return _grids[shape]


class _Copies(TorchDispatchMode):
    """The copying ops torch runs (a layout conversion is one of these)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.copy_.default, torch.ops.aten.clone.default, torch.ops.aten._to_copy.default):
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def in_format(t: torch.Tensor, fmt) -> bool:
    """t is dense in fmt: a torch memory format, or a dim order (outermost first)."""
    if isinstance(fmt, torch.memory_format):
        return t.is_contiguous(memory_format=fmt)
    return t.permute(*fmt).is_contiguous()


def to_format(t: torch.Tensor, fmt) -> torch.Tensor:
    if isinstance(fmt, torch.memory_format):
        return t.contiguous(memory_format=fmt)
    inv = [fmt.index(d) for d in range(t.dim())]
    return t.permute(*fmt).contiguous().permute(*inv)


FORMATS = [  # (rank of the tensor, memory format)
    (4, torch.channels_last),
    (5, torch.channels_last_3d),
    (3, (2, 0, 1)),  # any dense permutation
]


def scenario_formats():
    """Every exchange keeps x's memory format, for every dim: outputs and
    gradients, with no copying op in the call (so no conversion), bit for bit
    against the oracle."""
    R, W = ranks.RANK, ranks.WORLD
    lengths = [3, 1, 4, 2][:W]
    left, right = 2, 1  # 2 > a shard of 1: halos from two ranks
    for (nd, fmt), dim in ((f, d) for f in FORMATS for d in range(f[0])):
        what = f"{fmt} dim {dim}"
        shape = [2, 3, 4, 3, 2][:nd]
        shape[dim] = lengths[R]
        gen = torch.Generator().manual_seed(10 * dim + R)
        x = to_format(random_values(shape, torch.float32, gen), fmt).requires_grad_()
        if x.is_contiguous():  # a size-1 dim makes x both: torch calls that contiguous
            fmt = torch.contiguous_format
        want = oracle_forward(gather(x), R, left, right, dim)
        grad = to_format(random_values(want.shape, torch.float32, gen), fmt)
        want_grad = oracle_backward(gather(grad), lengths, R, left, right, dim)

        with _Copies() as copies:
            y = halocp.cp_halo_exchange(x, left, right, dim)
            (gx,) = torch.autograd.grad(y, x, grad)
        expect(not copies.ops, f"{what}: cp_halo_exchange copied: {copies.ops}")
        expect(in_format(y, fmt) and in_format(gx, fmt), f"{what}: out {y.stride()}, grad x {gx.stride()}")
        expect_bits(y, want, f"{what}: forward")
        expect_bits(gx, want_grad, f"{what}: backward")

        y = halocp.cp_halo_exchange_start(x, left, right, dim).wait()
        (gx,) = torch.autograd.grad(y, x, grad)
        expect(in_format(y, fmt) and in_format(gx, fmt), f"{what}: started: out {y.stride()}, grad x {gx.stride()}")
        expect_bits(y, want, f"{what}: started forward")

        with _Copies() as copies:
            lh, rh = halocp.halos(x, left, right, dim)
        expect(not copies.ops, f"{what}: halos copied: {copies.ops}")
        gl, gr = grad.narrow(dim, 0, left), grad.narrow(dim, left + lengths[R], right)
        gl, gr = to_format(gl, fmt), to_format(gr, fmt)
        (gx,) = torch.autograd.grad((lh, rh), x, (gl, gr))
        expect(all(in_format(t, fmt) for t in (lh, rh, gx)), f"{what}: halos {lh.stride()}, grad x {gx.stride()}")
        expect_bits(lh, want.narrow(dim, 0, left), f"{what}: left halo")
        lh, rh = halocp.halos_start(x, left, right, dim).wait()
        expect(in_format(lh, fmt) and in_format(rh, fmt), f"{what}: started halos {lh.stride()}")

        for start in (False, True):
            base = to_format(torch.zeros(want.shape), fmt).requires_grad_()
            padded = base.clone()
            with torch.no_grad():
                padded.narrow(dim, left, lengths[R]).copy_(x)
            if start:
                out = halocp.halo_exchange_start_(padded, left, right, dim).wait()
            else:
                out = halocp.halo_exchange_(padded, left, right, dim)
            (gp,) = torch.autograd.grad(out, base, grad)
            expect(in_format(gp, fmt), f"{what}: in place (started {start}): grad {gp.stride()}")
            expect_bits(out, want, f"{what}: in place (started {start})")
            expect_bits(gp.narrow(dim, left, lengths[R]), want_grad, f"{what}: in place (started {start}): backward")

    # The layers: the exchange keeps the layout, the output is in the layout
    # torch's convolution gives, the input gradient in x's.
    torch.manual_seed(3)
    for layer, fmt, shape in [
        (halocp.nn.CausalConv3d(3, 4, 3, padding=1), torch.channels_last_3d, (2, 3, lengths[R], 4, 3)),
        (halocp.nn.CausalConv3d(3, 4, 3, stride=(2, 1, 1), padding=1), torch.channels_last_3d, (2, 3, lengths[R], 4, 3)),
        (halocp.nn.TiledConv2d(3, 4, 3, padding=1, grid=grid((W, 1))), torch.channels_last, (2, 3, lengths[R], 5)),
    ]:
        x = to_format(torch.randn(shape), fmt).requires_grad_()
        y = layer(x)
        (gx,) = torch.autograd.grad(y, x, torch.ones_like(y))
        like = F.conv3d if x.dim() == 5 else F.conv2d
        local = like(x.detach(), layer.weight.detach(), padding=1)
        expect(dim_order(y) == dim_order(local) or y.numel() == 0, f"{layer}: output strides {y.stride()}")
        expect(in_format(gx, fmt), f"{layer}: grad x strides {gx.stride()}")


def dim_order(t):
    return halocp._shapes.dim_order(t)


def tiles_of(shape, sizes, coords, dims):
    """The slices of this rank's tile: along dims[i], the coords[i]-th of sizes[i]."""
    idx = [slice(None)] * len(shape)
    for i, d in enumerate(dims):
        off = offsets(sizes[i])
        idx[d] = slice(off[coords[i]], off[coords[i] + 1])
    return tuple(idx)


def _scatter(xg, g, dims, sizes):
    return xg[tiles_of(xg.shape, sizes, g.coords, dims)]


def scenario_tiles(modes=("zeros",)):
    """tile_halo_exchange == F.pad of the global tensor sliced at the tile,
    corners included; its backward == autograd through that on the global
    tensor; on 2-D and 3-D grids with uneven tiles and multi-hop halos."""
    for gshape in GRIDS[ranks.WORLD]:
        g = grid(gshape)
        k = len(gshape)
        sizes = [SPLITS[i][:gshape[i]] for i in range(k)]
        dims = list(range(2, 2 + k))
        halos = [(2, 1), (1, 2), (0, 2)][:k]  # below every global size: reflect wants that
        formats = (torch.contiguous_format, torch.channels_last if k == 2 else torch.channels_last_3d)
        for fmt, mode in itertools.product(formats, modes):
            what = f"grid {gshape}, {fmt}, {mode}"
            torch.manual_seed(7)
            xg = torch.randn([2, 3] + [sum(s) for s in sizes], dtype=torch.float64, requires_grad=True)
            yg = F.pad(xg, [p for lr in reversed(halos) for p in lr], "constant" if mode == "zeros" else mode)
            gg = torch.randn_like(yg)

            def padded_tile(coords):
                """The tile at coords, padded, in the padded global tensor: the
                padded tiles overlap (the halos are the neighbours' slices)."""
                idx = [slice(None)] * (2 + k)
                for i, d in enumerate(dims):
                    a = offsets(sizes[i])[coords[i]]
                    idx[d] = slice(a, a + sizes[i][coords[i]] + sum(halos[i]))
                return tuple(idx)

            # The oracle's loss: every rank's padded tile times its gradient.
            every = itertools.product(*[range(n) for n in gshape])
            sum((yg[padded_tile(c)] * gg[padded_tile(c)]).sum() for c in every).backward()
            x = to_format(_scatter(xg.detach(), g, dims, sizes), fmt).requires_grad_()
            y = halocp.tile_halo_exchange(x, halos, dims, g, mode)
            mine = padded_tile(g.coords)
            expect_bits(y, yg.detach()[mine], f"{what}: forward")
            expect(in_format(y, fmt), f"{what}: the output is not in x's memory format: {y.stride()}")
            y.backward(to_format(gg[mine], fmt))
            want = _scatter(xg.grad, g, dims, sizes)
            expect(torch.allclose(x.grad, want, rtol=1e-13, atol=1e-13), f"{what}: backward differs")


def _gather_tiles(y, g, dims):
    """The global tensor of every rank's tile y, put together along dims."""
    tiles = gather(y)
    coords = [tuple(ranks_coords) for ranks_coords in itertools.product(*[range(n) for n in g.shape])]
    by = dict(zip(coords, tiles))

    def build(prefix, i):
        if i == len(g.shape):
            return by[prefix]
        return torch.cat([build(prefix + (c,), i + 1) for c in range(g.shape[i])], dims[i])

    return build((), 0)


class _TimeGrid:
    """The default group as a T x 1 x 1 grid, for the temporal layers."""

    def __init__(self):
        self.shape, self.coords = (ranks.WORLD, 1, 1), (ranks.RANK, 0, 0)


LAYERS = [  # (class, arguments, tiled dims' sizes)
    (halocp.nn.CausalConv3d, dict(kernel_size=3, stride=(2, 1, 1), padding=1)),
    (halocp.nn.CausalConv3d, dict(kernel_size=(3, 1, 3), stride=(3, 1, 2), dilation=(2, 1, 1), padding=(0, 1))),
    (halocp.nn.CenteredConv3d, dict(kernel_size=(5, 3, 1), stride=(2, 1, 1), padding=(1, 0))),
    (halocp.nn.CenteredConv3d, dict(kernel_size=3, dilation=(2, 1, 1), padding=1)),
    (halocp.nn.CenteredConv3d, dict(kernel_size=(3, 1, 1), stride=(5, 1, 1))),  # W = 4: rank 3 has no output
    (halocp.nn.CausalConv3d, dict(kernel_size=3, stride=(2, 2, 1), padding=1, grid=True)),  # T x H x W tiles
    (halocp.nn.CenteredConv3d, dict(kernel_size=(3, 2, 3), dilation=(2, 1, 1), padding=(0, 1), grid=True)),
    (halocp.nn.TiledConv2d, dict(kernel_size=3, stride=2, padding=1)),
    (halocp.nn.TiledConv2d, dict(kernel_size=3, dilation=2, padding=2)),
    (halocp.nn.TiledConv2d, dict(kernel_size=(4, 2), padding="same")),
    (halocp.nn.TiledConv2d, dict(kernel_size=3, padding=0)),  # fewer outputs than inputs
    (halocp.nn.TiledConv2d, dict(kernel_size=2, stride=3, padding=3)),  # outputs past the end
    (halocp.nn.TiledConv3d, dict(kernel_size=3, stride=(1, 2, 2), padding=1)),
    (halocp.nn.TiledConv3d, dict(kernel_size=(2, 3, 3), dilation=(1, 2, 1), padding=(1, 2, 0))),
]


def _reference(layer, kw):
    """(function, module holding its parameters): the single-process layer on
    the whole tensor. torch's own for the tiled layers; for the causal and
    centred temporal ones F.pad with their temporal halo and spatial
    padding, in their padding mode, then torch's Conv3d."""
    if isinstance(layer, (halocp.nn.TiledConv2d, halocp.nn.TiledConv3d)):
        cls = torch.nn.Conv2d if isinstance(layer, halocp.nn.TiledConv2d) else torch.nn.Conv3d
        full = cls(layer.in_channels, layer.out_channels, dtype=torch.float64, **kw)
        full.load_state_dict(layer.state_dict())
        return full, full
    full = torch.nn.Conv3d(layer.in_channels, layer.out_channels, layer.kernel_size, layer.stride, 0,
                           layer.dilation, dtype=torch.float64)
    full.load_state_dict(layer.state_dict())
    mode = "constant" if layer.padding_mode == "zeros" else layer.padding_mode
    ph, pw = layer.padding[1:]
    return (lambda x: full(F.pad(x, (pw, pw, ph, ph, layer.left, layer.right), mode))), full


def scenario_layers(modes=("zeros",)):
    """The layers == the single-process layer on the whole tensor: the ranks'
    outputs put together, the input gradients, the weight and bias gradients
    summed over the ranks; uneven shards and tiles."""
    W = ranks.WORLD
    for (cls, kw), mode in itertools.product(LAYERS, modes):
        kw = dict(kw)
        temporal = cls in (halocp.nn.CausalConv3d, halocp.nn.CenteredConv3d) and not kw.pop("grid", False)
        nsp = 2 if cls is halocp.nn.TiledConv2d else 3
        shapes = [(W,) + (1,) * (nsp - 1)] if temporal else [s for s in GRIDS[W] if len(s) == nsp] or [(1,) * (nsp - 1) + (W,)]
        for gshape in shapes:
            g = _TimeGrid() if temporal else grid(gshape)
            extra = {} if temporal else dict(grid=g)
            torch.manual_seed(11)
            layer = cls(3, 2, dtype=torch.float64, padding_mode=mode, **extra, **kw)
            full, params = _reference(layer, {**kw, "padding_mode": mode})
            sizes = [SPLITS[i][:gshape[i]] if gshape[i] > 1 else [5] for i in range(nsp)]
            dims = list(range(2, 2 + nsp))
            xg = torch.randn([2, 3] + [sum(s) for s in sizes], dtype=torch.float64, requires_grad=True)
            yg = full(xg)
            gg = torch.randn_like(yg)
            yg.backward(gg)
            what = f"{layer} on grid {gshape}"
            x = _scatter(xg.detach(), g, dims, sizes).clone().requires_grad_()
            y = layer(x)
            got = _gather_tiles(y.detach(), g, dims)
            expect(got.shape == yg.shape and torch.allclose(got, yg, rtol=1e-11, atol=1e-12),
                   f"{what}: output {tuple(got.shape)} differs from the whole layer's {tuple(yg.shape)}")
            out_sizes = [[t.shape[d] for t in _tiles_along(y, g, i, d)] for i, d in enumerate(dims)]
            y.backward(_scatter(gg, g, dims, out_sizes))
            expect(torch.allclose(x.grad, _scatter(xg.grad, g, dims, sizes), rtol=1e-11, atol=1e-12),
                   f"{what}: input gradient differs")
            for name in ("weight", "bias"):
                mine = getattr(layer, name).grad
                mine = torch.zeros_like(getattr(layer, name)) if mine is None else mine.clone()
                dist.all_reduce(mine)
                expect(torch.allclose(mine, getattr(params, name).grad, rtol=1e-11, atol=1e-12),
                       f"{what}: {name} gradient differs")


def _tiles_along(y, g, i, d):
    """The tiles of the ranks on this rank's line along grid dim i."""
    tiles = gather(y.detach())
    coords = list(itertools.product(*[range(n) for n in g.shape]))
    return [t for c, t in zip(coords, tiles) if all(c[j] == g.coords[j] for j in range(len(c)) if j != i)]


def scenario_mismatch():
    """Ranks whose layers differ (a temporal stride, a tiled layer's stride)
    all get the same ERR_MISMATCH naming the ranks, promptly; the group
    works afterwards."""
    R, W = ranks.RANK, ranks.WORLD
    if W == 1:
        return
    x = torch.randn(1, 2, 4, 3, 3)
    stride = 2 if R == W - 1 else 3
    layer = halocp.nn.CausalConv3d(2, 2, 3, stride=(stride, 1, 1))
    msg = ranks.raises(lambda: layer(x), halocp.ERR_MISMATCH, "temporal strides that differ")
    expect(f"rank {W - 1}: kernel 3, stride 2" in msg and "rank 0: kernel 3, stride 3" in msg, f"the message: {msg}")
    expect(len({m.split(": ", 1)[1] for m in gather_strings(msg)}) == 1, f"the ranks' messages differ: {msg}")
    tiled = halocp.nn.TiledConv2d(2, 2, 3, stride=1 + (R == 0), padding=1, grid=grid((W, 1)))
    ranks.raises(lambda: tiled(torch.randn(1, 2, 4, 5)), halocp.ERR_MISMATCH, "tiled strides that differ")
    y = halocp.nn.CausalConv3d(2, 2, 3, stride=(2, 1, 1))(x)  # the same layer everywhere: fine again
    expect(y.shape[2] == len(range(-(-4 * R // 2), -(-4 * (R + 1) // 2))), f"output frames {y.shape[2]}")


def scenario_grid_mismatch():
    """Ranks that lay one group out on different grids ((2, 1) on rank 0,
    (1, 2) on the others) all get ERR_MISMATCH naming every rank's grid,
    before any data moves; a grid all agree on works afterwards."""
    R, W = ranks.RANK, ranks.WORLD
    if W != 2:
        return
    shape = (2, 1) if R == 0 else (1, 2)
    msg = ranks.raises(lambda: halocp.TileGrid(shape), halocp.ERR_MISMATCH, "grids that differ")
    expect("rank 0: 2x1" in msg and "rank 1: 1x2" in msg, f"the message: {msg}")
    expect(len(set(gather_strings(msg))) == 1, f"the ranks' messages differ: {msg}")
    g = halocp.TileGrid((2, 1))
    y = halocp.tile_halo_exchange(torch.full((1, 2, 3), float(R)), 1, [1, 2], g)
    expect(y.shape == (1, 4, 5), f"shape {tuple(y.shape)}")


def gather_strings(s: str) -> list:
    out = [None] * ranks.WORLD
    dist.all_gather_object(out, s)
    return out


def scenario_modes():
    """padding_mode: tile_halo_exchange and the layers with replicate,
    reflect and circular padding."""
    modes = ("replicate", "reflect", "circular")
    scenario_tiles(modes)
    scenario_layers(modes)


if __name__ == "__main__":
    ranks.main(globals())
