"""One rank of the halocp tests; tests/python/launcher.py starts W of them.

    ranks.py SCENARIO...      run the scenarios in order, print one
                              "RESULT <scenario> ok|FAIL <why>" line each

The first failing scenario ends the rank (its peers then fail fast instead
of waiting in a collective that will never come).
"""

from __future__ import annotations

import faulthandler
import os
import random
import sys
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F

import halocp
from halocp import HaloError

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
BITS = {torch.float32: torch.int32, torch.float64: torch.int64, torch.float16: torch.int16, torch.bfloat16: torch.int16}

RANK = WORLD = -1


class Failure(AssertionError):
    pass


def expect(cond, msg):
    if not cond:
        raise Failure(msg)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical: equal shapes and dtypes, and equal bits (so -0.0 != +0.0)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.contiguous().view(BITS[a.dtype]), b.contiguous().view(BITS[b.dtype]))


def expect_bits(got, want, what):
    if not same_bits(got, want):
        raise Failure(f"{what}: {describe_diff(got, want)}")


def describe_diff(got, want):
    if got.dtype != want.dtype:
        return f"dtype {got.dtype} != {want.dtype}"
    if got.shape != want.shape:
        return f"shape {tuple(got.shape)} != {tuple(want.shape)}"
    bad = (got.contiguous().view(BITS[got.dtype]) != want.contiguous().view(BITS[want.dtype])).nonzero()
    i = tuple(bad[0].tolist())
    return f"{len(bad)} elements differ, first at {i}: got {got[i].item()!r}, want {want[i].item()!r}"


def gather(t: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's tensor (any shape), in rank order."""
    out = [None] * WORLD
    dist.all_gather_object(out, t.detach().contiguous().clone())
    return out


# ---------------------------------------------------------------- the oracle
# Computed from the gathered global tensors, with the semantics spelled out:
# out_r = [L slices before x_r | x_r | R slices after x_r], zeros outside the
# sequence; grad x_r = interior of g_r, plus the halo gradients of the ranks
# that used x_r's slices: first the ranks to the right (nearest first), then
# those to the left (nearest first); where the reference adds a zero tensor
# (the last rank's last L slices, rank 0's first R) we add +0.0 too.


def offsets(lengths):
    off = [0]
    for n in lengths:
        off.append(off[-1] + n)
    return off


def oracle_forward(shards, r, left, right, dim):
    x = shards[r]
    zeros = lambda k: torch.zeros(x.shape[:dim] + (k,) + x.shape[dim + 1:], dtype=x.dtype, device=x.device)
    padded = torch.cat([zeros(left)] + list(shards) + [zeros(right)], dim)
    lengths = [s.shape[dim] for s in shards]
    return padded.narrow(dim, offsets(lengths)[r], lengths[r] + left + right)


def oracle_backward(grads, lengths, r, left, right, dim):
    off, W, n = offsets(lengths), len(lengths), lengths[r]
    acc = grads[r].narrow(dim, left, n).clone()
    lo, hi = off[r], off[r] + n

    def add(s, wlo, whi):  # rank s's halo window [wlo, whi), its out starts at global off[s] - left
        a, b = max(lo, wlo), min(hi, whi)
        if a < b:
            acc.narrow(dim, a - lo, b - a).add_(grads[s].narrow(dim, a - (off[s] - left), b - a))

    def add_zero(start, k):
        part = acc.narrow(dim, start, k)
        part.add_(torch.zeros_like(part))

    for s in range(r + 1, W):
        add(s, off[s] - left, off[s])
    if r == W - 1 and left > 0 and n > 0:
        add_zero(n - min(left, n), min(left, n))
    for s in range(r - 1, -1, -1):
        add(s, off[s + 1], off[s + 1] + right)
    if r == 0 and right > 0 and n > 0:
        add_zero(0, min(right, n))
    return acc


# ---------------------------------------------------------------- layouts


def random_values(shape, dtype, gen):
    v = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
    # Signed zeros, so that a missing or extra "+ 0" shows in the bits.
    return torch.where(torch.rand(shape, generator=gen) < 0.15, torch.tensor(-0.0, dtype=dtype), v)


def with_layout(t: torch.Tensor, kind: str, cfg: random.Random, dim: int = -1) -> torch.Tensor:
    """The same values as t in another memory layout (a view of new memory).
    cfg is shared by all ranks: plans are keyed on layouts, and every rank's
    layout must change at the same call (see halocp.clear_plans)."""
    nd = t.dim()
    if kind == "contiguous":
        return t.clone()
    if kind == "permuted":
        perm = list(range(nd))
        cfg.shuffle(perm)
        inv = [perm.index(i) for i in range(nd)]
        return t.permute(perm).contiguous().permute(inv)
    if kind == "strided":  # every other element along one dim
        d = cfg.randrange(nd)
        shape = list(t.shape)
        shape[d] *= 2
        big = torch.full(shape, float("nan"), dtype=t.dtype)
        idx = [slice(None)] * nd
        idx[d] = slice(0, None, 2)
        big[tuple(idx)] = t
        return big[tuple(idx)]
    if kind == "narrowed":  # an interior window of a larger buffer
        big = torch.full([n + 3 for n in t.shape], float("nan"), dtype=t.dtype)
        view = big
        for d, n in enumerate(t.shape):
            view = view.narrow(d, 1, n)
        view.copy_(t)
        return view
    if kind == "expanded":  # constant along one dim (not dim) of size > 1: a stride-0 view
        dims = [d for d in range(nd) if t.shape[d] > 1 and d != dim]
        d = dims[cfg.randrange(len(dims))]
        return t.narrow(d, 0, 1).clone().expand(t.shape)
    raise ValueError(kind)


# ---------------------------------------------------------------- scenarios


def scenario_exchange(cases=36):
    """Random layouts against the oracle, out of place and in place. Each case
    runs three times with fresh values: again through the cached plans, then
    with x in another layout (new plans: the layout is part of a plan)."""
    comm = halocp.communicator()
    for case in range(cases):
        cfg = random.Random(1000 * WORLD + case)  # the same on every rank
        dtype = DTYPES[case % len(DTYPES)]
        nd = cfg.randint(1, 4)
        dim = cfg.randrange(nd)
        shape = [cfg.randint(1, 3) for _ in range(nd)]
        lengths = [cfg.choice([0, 1, 2, 3, 4, 5, 6]) if cfg.random() < 0.85 else cfg.randint(1, 3) for _ in range(WORLD)]
        if not any(lengths):
            lengths[0] = 2
        longest = max(lengths)
        left, right = cfg.randint(0, longest + 2), cfg.randint(0, longest + 2)
        if case % 9 == 4:
            left, right = cfg.randint(1, 3), 0  # causal
        layout = cfg.choice(["contiguous", "permuted", "strided", "narrowed", "expanded"])
        if layout == "expanded" and all(shape[d] == 1 for d in range(nd) if d != dim):
            layout = "narrowed"
        other_layout = "contiguous" if layout == "strided" else "strided"  # differs on every rank
        pad_layout = cfg.choice(["contiguous", "permuted", "narrowed"])
        call_dim = dim - nd if cfg.random() < 0.3 else dim
        shape[dim] = lengths[RANK]
        what = (f"case {case}: {dtype} shape {shape} dim {call_dim} lengths {lengths} left {left} right {right} "
                f"x {layout} padded {pad_layout}")
        gen = torch.Generator().manual_seed(7919 * case + RANK)
        # Shard lengths differ between cases: a rank whose own layout repeats
        # an earlier case's would find its plan while the others make theirs.
        halocp.clear_plans()
        # Layout choices: the same on every rank, and in the first two runs.
        same = lambda purpose: random.Random(f"{case} {purpose}")
        for run, x_layout in enumerate([layout, layout, other_layout]):
            if run == 2 and min(lengths + shape) < 2:
                # With a dim of size 0 or 1 a new layout can keep some rank's
                # strides: the ranks would not miss their plans together.
                halocp.clear_plans()
            x = with_layout(random_values(shape, dtype, gen), x_layout, same("x"), dim)
            x = x.detach().requires_grad_()
            shards = gather(x)
            want = oracle_forward(shards, RANK, left, right, dim)
            grad = random_values(want.shape, dtype, gen)
            if run == 1:
                grad = with_layout(grad, "permuted", same("grad"))  # a non-contiguous incoming gradient
            want_grad = oracle_backward(gather(grad), lengths, RANK, left, right, dim)
            at = f"{what}, run {run} (x {x_layout})"

            y = halocp.cp_halo_exchange(x, left, right, call_dim, None)
            if left == 0 and right == 0:
                expect(y is x, f"{what}: left = right = 0 must return x itself")
                continue
            expect_bits(y, want, f"{at}: forward")
            with torch.no_grad():  # no graph: the call skips autograd
                expect_bits(halocp.cp_halo_exchange(x, left, right, call_dim, None), want, f"{at}: forward, no grad")
            y.backward(grad)
            expect_bits(x.grad, want_grad, f"{at}: backward")

            # In place: the caller's padded buffer, shard written into its
            # interior. Its earlier contents (from `old`) are all overwritten,
            # so they get no gradient.
            x2 = x.detach().clone().requires_grad_()
            old = random_values(want.shape, dtype, gen).requires_grad_()
            padded = with_layout(torch.full(want.shape, float("nan"), dtype=dtype), pad_layout, same("padded"))
            padded.copy_(old)
            padded.narrow(dim, left, lengths[RANK]).copy_(x2)
            interior = padded.narrow(dim, left, lengths[RANK]).data_ptr()
            res = halocp.halo_exchange_(padded, left, right, call_dim, None)
            expect(res is padded, f"{what}: halo_exchange_ must return its argument")
            expect(padded.narrow(dim, left, lengths[RANK]).data_ptr() == interior, f"{what}: the shard moved")
            expect_bits(padded, want, f"{at}: in-place forward")
            padded.backward(grad)
            expect_bits(x2.grad, want_grad, f"{at}: in-place backward")
            expect_bits(old.grad, torch.zeros_like(old), f"{at}: in-place backward into the overwritten halo slots")
            if run == 0:
                plans = len(comm.cached("plan"))
            elif run == 1:
                expect(len(comm.cached("plan")) == plans, f"{at}: the second run made new plans")


def scenario_conv():
    """Sharded context-parallel Conv3d == the full-sequence Conv3d: outputs,
    input gradients and (summed over ranks) weight and bias gradients."""
    lengths = [3, 5, 2, 4][:WORLD]
    off = offsets(lengths)
    configs = [
        (halocp.nn.CausalConv3d, dict(kernel_size=3, padding=1)),
        (halocp.nn.CausalConv3d, dict(kernel_size=(2, 3, 1), padding=(1, 0), dilation=(3, 1, 1))),  # halo 3 > shard 2
        (halocp.nn.CenteredConv3d, dict(kernel_size=3, padding=1)),
        (halocp.nn.CenteredConv3d, dict(kernel_size=(5, 1, 3), padding=(0, 1), stride=(1, 2))),
    ]
    for i, (cls, kw) in enumerate(configs):
        torch.manual_seed(100 + i)  # the same weights and data on every rank
        layer = cls(3, 4, dtype=torch.float64, **kw)
        full = torch.nn.Conv3d(3, 4, dtype=torch.float64, **{**kw, "padding": layer.padding, "stride": layer.stride})
        full.load_state_dict(layer.state_dict())
        xg = torch.randn(2, 3, off[-1], 5, 6, dtype=torch.float64, requires_grad=True)
        yg = full(F.pad(xg, (0, 0, 0, 0, layer.left, layer.right)))
        gg = torch.randn_like(yg)
        yg.backward(gg)

        x = xg.detach().narrow(2, off[RANK], lengths[RANK]).clone().requires_grad_()
        y = layer(x)
        y.backward(gg.narrow(2, off[RANK], lengths[RANK]))
        close = dict(rtol=1e-11, atol=1e-12)
        what = f"{layer}"
        expect(torch.allclose(y, yg.detach().narrow(2, off[RANK], lengths[RANK]), **close), f"{what}: output differs")
        expect(torch.allclose(x.grad, xg.grad.narrow(2, off[RANK], lengths[RANK]), **close), f"{what}: input grad differs")
        for name in ("weight", "bias"):
            g = getattr(layer, name).grad.clone()
            dist.all_reduce(g)
            expect(torch.allclose(g, getattr(full, name).grad, **close), f"{what}: {name} grad differs")


class _Scatter(torch.autograd.Function):
    """Global tensor -> this rank's shard; backward gathers the shards' gradients."""

    @staticmethod
    def forward(ctx, xg, lengths, dim):
        ctx.dim = dim
        return xg.narrow(dim, offsets(lengths)[RANK], lengths[RANK]).clone()

    @staticmethod
    def backward(ctx, g):
        return torch.cat(gather(g), ctx.dim), None, None


class _Gather(torch.autograd.Function):
    """Every rank's output, concatenated; backward takes this rank's part."""

    @staticmethod
    def forward(ctx, y, dim):
        parts = gather(y)
        ctx.dim, ctx.start, ctx.n = dim, sum(p.shape[dim] for p in parts[:RANK]), y.shape[dim]
        return torch.cat(parts, dim)

    @staticmethod
    def backward(ctx, g):
        return g.narrow(ctx.dim, ctx.start, ctx.n), None


def scenario_gradcheck():
    """torch.autograd.gradcheck in float64 of the global function
    x -> cat over ranks of exchange(shard of x), out of place and in place;
    every rank runs the same gradcheck, so the collectives line up."""
    lengths = [2, 3, 1, 4][:WORLD]
    for left, right, dim in [(2, 1, 1), (3, 0, 0), (1, 4, 1)]:
        shape = [2, 2]
        shape[dim] = sum(lengths)
        torch.manual_seed(5)
        xg = torch.randn(shape, dtype=torch.float64, requires_grad=True)

        def out_of_place(xg):
            return _Gather.apply(halocp.cp_halo_exchange(_Scatter.apply(xg, lengths, dim), left, right, dim, None), dim)

        def in_place(xg):
            x = _Scatter.apply(xg, lengths, dim)
            padded = torch.zeros(x.shape[:dim] + (x.shape[dim] + left + right,) + x.shape[dim + 1:], dtype=x.dtype)
            padded.narrow(dim, left, x.shape[dim]).copy_(x)
            return _Gather.apply(halocp.halo_exchange_(padded, left, right, dim, None), dim)

        for fn in (out_of_place, in_place):
            ok = torch.autograd.gradcheck(fn, (xg,), eps=1e-6, atol=1e-8, raise_exception=False)
            expect(ok, f"gradcheck failed: {fn.__name__}, lengths {lengths}, left {left}, right {right}, dim {dim}")


# ------------------------------------------------------------ padding modes
# The definition: out_r = F.pad(global, (left, right), mode) sliced to rank
# r; grad x_r = F.pad's backward of the gathered padded gradient, sliced. The
# gathered gradient sums the ranks' grad_out where their windows overlap, in
# the library's documented order: the owner's own, the ranks to its right
# nearest first, then those to its left; beyond the ends, the ranks nearest
# that end first.


def pad_along(x, dim, left, right, mode):
    """F.pad of x along one dim (F.pad pads the last dims of 3-D input)."""
    m = x.movedim(dim, -1)
    shape = m.shape
    y = F.pad(m.reshape(1, -1, shape[-1]), (left, right), mode=mode)
    return y.reshape(shape[:-1] + (y.shape[-1],)).movedim(-1, dim)


def gathered_grad(grads, lengths, left, right, dim):
    off, W = offsets(lengths), len(lengths)
    T = off[-1]
    slots = []
    for g in range(-left, T + right):
        if g < 0:
            order = list(range(W))
        elif g >= T:
            order = list(range(W - 1, -1, -1))
        else:
            o = max(s for s in range(W) if off[s] <= g < off[s + 1])
            order = [o] + list(range(o + 1, W)) + list(range(o - 1, -1, -1))
        v = None
        for s in order:
            if off[s] - left <= g < off[s + 1] + right:
                t = grads[s].narrow(dim, g - off[s] + left, 1)
                v = t.clone() if v is None else v + t
        slots.append(v)
    return torch.cat(slots, dim)


def pad_oracle(shards, grads, left, right, dim, mode):
    """(out_r, grad x_r) by the definition; F.pad in float32 where torch 1.13
    has no CPU kernel for the dtype (replicate and reflect in half types)."""
    lengths = [t.shape[dim] for t in shards]
    off, n = offsets(lengths), lengths[RANK]
    xg = torch.cat(shards, dim)
    native = mode == "circular" or xg.dtype in (torch.float32, torch.float64)
    xg = (xg if native else xg.float()).detach().requires_grad_()
    y = pad_along(xg, dim, left, right, mode)
    gp = gathered_grad(grads, lengths, left, right, dim)
    y.backward(gp if native else gp.float())
    dt = shards[0].dtype
    return (y.detach().narrow(dim, off[RANK], n + left + right).to(dt), xg.grad.narrow(dim, off[RANK], n).to(dt), native)


def expect_grad(got, want, exact, what):
    if exact:
        expect_bits(got, want, what)
    else:  # float32 sums rounded once against ours rounded per addition
        if not torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2):
            raise Failure(f"{what}: {describe_diff(got, want)}")


def scenario_padding(cases=8):
    """replicate, reflect and circular on uneven shards (some empty or of one
    slice), halos longer than shards, through every exchange call: bit for
    bit against F.pad of the gathered tensor, forward and backward (float16
    and bfloat16: circular bit for bit; replicate and reflect forward bit for
    bit, backward close, as torch 1.13 has no CPU kernel for them)."""
    for mode in ("replicate", "reflect", "circular"):
        for case in range(cases):
            cfg = random.Random(f"{WORLD} {mode} {case}")  # the same on every rank
            dtype = DTYPES[case % len(DTYPES)]
            nd = cfg.randint(1, 4)
            dim = cfg.randrange(nd)
            shape = [cfg.randint(1, 3) for _ in range(nd)]
            lengths = [cfg.choice([0, 1, 1, 2, 3, 5]) for _ in range(WORLD)]
            if sum(lengths) < 2:
                lengths[-1] += 2
            T = sum(lengths)
            most = {"replicate": T + 3, "reflect": T - 1, "circular": T}[mode]
            left, right = cfg.randint(0, most), cfg.randint(0, most)
            if left + right == 0:
                left = 1
            shape[dim] = lengths[RANK]
            layout = cfg.choice(["contiguous", "permuted", "strided"])
            what = f"{mode} case {case}: {dtype} shape {shape} dim {dim} lengths {lengths} left {left} right {right} x {layout}"
            halocp.clear_plans()
            gen = torch.Generator().manual_seed(7919 * case + RANK)
            # Copies of x in x's layout: a plan is keyed on it, and a rank
            # whose strides happened to repeat would miss its plan alone.
            again = lambda t: with_layout(t.detach(), layout, random.Random(case)).requires_grad_()
            x = again(random_values(shape, dtype, gen))
            shards = gather(x)
            out_shape = list(shape)
            out_shape[dim] += left + right
            grad = random_values(out_shape, dtype, gen)
            want, want_grad, exact = pad_oracle(shards, gather(grad), left, right, dim, mode)

            y = halocp.cp_halo_exchange(x, left, right, dim, None, padding_mode=mode)
            expect_bits(y, want, f"{what}: forward")
            y.backward(grad)
            expect_grad(x.grad, want_grad, exact, f"{what}: backward")

            x2 = again(x)
            y2 = halocp.cp_halo_exchange_start(x2, left, right, dim, None, padding_mode=mode).wait()
            expect_bits(y2, want, f"{what}: started forward")
            y2.backward(grad)
            expect_bits(x2.grad, x.grad, f"{what}: started backward")

            for start in (False, True):
                x3 = again(x)
                padded = torch.full(out_shape, float("nan"), dtype=dtype)
                padded.narrow(dim, left, lengths[RANK]).copy_(x3)
                if start:
                    res = halocp.halo_exchange_start_(padded, left, right, dim, None, padding_mode=mode).wait()
                else:
                    res = halocp.halo_exchange_(padded, left, right, dim, None, padding_mode=mode)
                expect_bits(res, want, f"{what}: in-place forward (start {start})")
                res.backward(grad)
                expect_bits(x3.grad, x.grad, f"{what}: in-place backward (start {start})")

            # Halos only: the gradient of x is the halo gradients alone (the
            # definition with the interior of every grad_out zeroed).
            n = lengths[RANK]
            interior_zeroed = grad.clone()
            interior_zeroed.narrow(dim, left, n).zero_()
            _, want_halo_grad, _ = pad_oracle(shards, gather(interior_zeroed), left, right, dim, mode)
            for start in (False, True):
                x4 = again(x)
                if start:
                    lh, rh = halocp.halos_start(x4, left, right, dim, None, padding_mode=mode).wait()
                else:
                    lh, rh = halocp.halos(x4, left, right, dim, None, padding_mode=mode)
                expect_bits(lh, want.narrow(dim, 0, left), f"{what}: left halo (start {start})")
                expect_bits(rh, want.narrow(dim, left + n, right), f"{what}: right halo (start {start})")
                torch.autograd.backward([lh, rh], [grad.narrow(dim, 0, left), grad.narrow(dim, left + n, right)])
                expect_grad(x4.grad, want_halo_grad, exact, f"{what}: halos backward (start {start})")
    # A mode torch does not spell, and halos the sequence cannot serve.
    x = torch.randn(2, 3)
    try:
        halocp.cp_halo_exchange(x, 1, 1, 1, None, padding_mode="mirror")
        raise Failure("padding_mode='mirror' was accepted")
    except ValueError as e:
        expect("'mirror'" in str(e) and "'circular'" in str(e), f"the ValueError should name the value and the modes: {e}")
    msg = raises(lambda: halocp.cp_halo_exchange(x, 3 * WORLD, 0, 1, None, padding_mode="reflect"),
                 halocp.ERR_INVALID_ARGUMENT, "a reflect halo as long as the sequence")
    expect(f"global length {3 * WORLD}" in msg, f"the message should name the global length: {msg}")


def raises(fn, code, what, within=10.0):
    """fn must raise HaloError with code, promptly (no waiting for a timeout)."""
    t0 = time.monotonic()
    try:
        fn()
    except HaloError as e:
        took = time.monotonic() - t0
        expect(e.code == code, f"{what}: HaloError code {e.code} ({e}), want {code}")
        expect(isinstance(e, RuntimeError), f"{what}: HaloError must be a RuntimeError")
        expect(took < within, f"{what}: took {took:.1f} s")
        parts = str(e).split(": ")
        expect(all(a != b for a, b in zip(parts, parts[1:])), f"{what}: the message repeats its prefix: {e}")
        return str(e)
    except Exception as e:  # noqa: BLE001 - any other exception is the failure
        raise Failure(f"{what}: raised {type(e).__name__}: {e}, not HaloError") from e
    raise Failure(f"{what}: did not raise")


def scenario_errors():
    """Bad calls raise HaloError on every rank, promptly, and leave the
    communicator usable."""
    x = torch.randn(2, 3 + RANK, 4)
    ex = halocp.cp_halo_exchange
    msg = raises(lambda: ex(x, -1, 1, 1, None), halocp.ERR_INVALID_ARGUMENT, "negative left_size")
    expect("negative" in msg, f"the library's message should say what is wrong: {msg}")
    raises(lambda: ex(x, 1, -2, 1, None), halocp.ERR_INVALID_ARGUMENT, "negative right_size")
    raises(lambda: ex(x, 1, 1, 3, None), halocp.ERR_INVALID_ARGUMENT, "dim out of range")
    raises(lambda: ex(x, 1, 1, -4, None), halocp.ERR_INVALID_ARGUMENT, "negative dim out of range")
    raises(lambda: ex(torch.empty(2, 3, device="meta"), 1, 0, 1, None), halocp.ERR_INVALID_ARGUMENT, "a meta tensor")
    raises(lambda: ex(x.to(torch.int32), 1, 1, 1, None), halocp.ERR_INVALID_ARGUMENT, "an int32 tensor")
    raises(lambda: halocp.halo_exchange_(torch.zeros(2, 3, 4), 2, 2, 1, None), halocp.ERR_INVALID_ARGUMENT,
           "a padded buffer shorter than its halos")
    # Ranks disagreeing: on a shape (other than the sharded dim), on the dtype.
    bad = torch.randn(2, 3, 4 + (RANK == WORLD - 1))
    msg = raises(lambda: ex(bad, 1, 1, 1, None), halocp.ERR_MISMATCH, "ranks disagree on shape")
    expect("shape[2]" in msg, f"the message should name the field: {msg}")
    dt = torch.float64 if RANK == 0 else torch.float32
    raises(lambda: ex(torch.randn(2, 3, 4, dtype=dt), 1, 1, 1, None), halocp.ERR_MISMATCH, "ranks disagree on dtype")
    # Still usable, and still right.
    y = ex(x, 1, 1, 1, None)
    want = oracle_forward(gather(x), RANK, 1, 1, 1)
    expect_bits(y, want, "an exchange after the errors")


def scenario_timeout():
    """A rank that skips a collective exchange: the others get a timeout
    error (not a hang), and a fresh communicator works again."""
    group = dist.new_group(list(range(WORLD)))
    halocp.communicator(group, timeout=1.0)
    x = torch.randn(3, 4)
    if RANK == 0:
        raises(lambda: halocp.cp_halo_exchange(x, 1, 1, 1, group), halocp.ERR_TIMEOUT, "a skipped exchange", within=10)
        raises(lambda: halocp.cp_halo_exchange(x, 1, 1, 1, group), halocp.ERR_COMM_FAILED, "after the timeout")
    dist.barrier()
    halocp.destroy_communicator(group)
    y = halocp.cp_halo_exchange(x, 1, 1, 1, group)
    expect_bits(y, oracle_forward(gather(x), RANK, 1, 1, 1), "the exchange on a new communicator")


def scenario_fork():
    """A communicator belongs to the process that made it: rank 0 forks a
    child whose exchange is refused, which then leaves through sys.exit, which runs
    halocp's atexit; the child must not destroy the communicator it
    inherited (its goodbye made the peers fail PEER_FAILED), and both ranks
    then exchange as before."""
    x = torch.randn(2, 3 + RANK, 4)
    want = oracle_forward(gather(x), RANK, 1, 1, 1)
    expect_bits(halocp.cp_halo_exchange(x, 1, 1, 1), want, "an exchange before the fork")
    if RANK == 0:
        # main's watchdog thread would not be in the child, whose exit then
        # waits for it for ever: disarmed across the fork, armed again after.
        faulthandler.cancel_dump_traceback_later()
        pid = os.fork()
        if pid == 0:
            # An exchange here is refused at once, before any gather on the
            # parent's group, saying why; then the exit.
            try:
                halocp.cp_halo_exchange(x, 1, 1, 1)
                os._exit(4)
            except halocp.HaloError as e:
                if "forked from process" not in str(e):
                    print(f"the child's exchange failed otherwise: {e}", flush=True)
                    os._exit(5)
            sys.exit(0)
        faulthandler.dump_traceback_later(float(os.environ.get("HALOCP_TEST_DEADLINE", "100")) - 5, exit=True)
        deadline = time.monotonic() + 20
        while (status := os.waitpid(pid, os.WNOHANG))[0] == 0:
            if time.monotonic() > deadline:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                raise Failure("the forked child did not exit within 20 s")
            time.sleep(0.01)
        expect(os.WIFEXITED(status[1]) and os.WEXITSTATUS(status[1]) == 0, f"the child's exit status {status[1]:#x}")
    dist.barrier()
    time.sleep(0.2)  # a goodbye from the child would have arrived by now
    for k in range(3):
        expect_bits(halocp.cp_halo_exchange(x, 1, 1, 1), want, f"exchange {k} after the forked child exited")


def main(scenarios=None):
    """Run the scenarios named on the command line, from ``scenarios`` (a
    module's globals) or this module's."""
    global RANK, WORLD
    # A rank that hangs says where before the launcher kills it.
    faulthandler.dump_traceback_later(float(os.environ.get("HALOCP_TEST_DEADLINE", "100")) - 5, exit=True)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    RANK, WORLD = dist.get_rank(), dist.get_world_size()
    for name in sys.argv[1:]:
        t0 = time.monotonic()
        try:
            (scenarios or globals())["scenario_" + name]()
        except Exception as e:  # noqa: BLE001 - reported, then the rank ends
            detail = str(e) if isinstance(e, Failure) else traceback.format_exc()
            print(f"RESULT {name} FAIL {detail}".replace("\n", "\n    "), flush=True)
            os._exit(1)
        print(f"RESULT {name} ok {time.monotonic() - t0:.1f}s", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
