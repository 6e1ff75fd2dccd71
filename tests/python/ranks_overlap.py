"""One rank of the tests of halocp's asynchronous and halos-only exchanges
(finished in any order), its fused nn layers and abort;
tests/python/test_overlap.py starts W of them
(the helpers and the oracle are ranks.py's).

    ranks_overlap.py SCENARIO...
"""

from __future__ import annotations

import gc
import random
import threading
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

import halocp
import ranks
from ranks import DTYPES, Failure, expect, expect_bits, gather, oracle_backward, oracle_forward, random_values, raises


def _case(case: int, salt: int):
    """A random layout, the same on every rank: dtype, shape (this rank's),
    dim, shard lengths, halo sizes (at times longer than a shard)."""
    W = ranks.WORLD
    cfg = random.Random(salt * 1000 + 10 * W + case)
    dtype = DTYPES[case % len(DTYPES)]
    nd = cfg.randint(1, 4)
    dim = cfg.randrange(nd)
    shape = [cfg.randint(1, 3) for _ in range(nd)]
    lengths = [cfg.choice([0, 1, 2, 3, 4, 5]) for _ in range(W)]
    if not any(lengths):
        lengths[0] = 3
    left, right = cfg.randint(0, max(lengths) + 1), cfg.randint(0, max(lengths) + 1)
    if case % 5 == 1:
        left, right = cfg.randint(1, 3), 0
    shape[dim] = lengths[ranks.RANK]
    what = f"case {case}: {dtype} shape {shape} dim {dim} lengths {lengths} left {left} right {right}"
    return dtype, shape, dim, lengths, left, right, cfg, what


# ---------------------------------------------------------------- handles


def scenario_async(cases=16):
    """The started exchanges give the blocking ones' results, bit for bit,
    gradients included; test() progresses without blocking; misuse raises."""
    R = ranks.RANK
    for case in range(cases):
        dtype, shape, dim, lengths, left, right, cfg, what = _case(case, 1)
        halocp.clear_plans()  # the ranks' own layouts may repeat an earlier case's
        gen = torch.Generator().manual_seed(31 * case + R)
        x = ranks.with_layout(random_values(shape, dtype, gen), cfg.choice(["contiguous", "strided", "permuted"]), cfg)
        x = x.detach().requires_grad_()
        want = oracle_forward(gather(x), R, left, right, dim)
        grad = random_values(want.shape, dtype, gen)
        want_grad = oracle_backward(gather(grad), lengths, R, left, right, dim)

        # Out of place, finished by test() on even cases and by wait() on odd ones.
        h = halocp.cp_halo_exchange_start(x, left, right, dim)
        if case % 2 == 0:
            deadline = time.monotonic() + 10
            while not h.test():
                expect(time.monotonic() < deadline, f"{what}: test() never reported the exchange finished")
            expect(h.done and h.test(), f"{what}: a finished exchange must stay finished")
        y = h.wait()
        expect_bits(y, want, f"{what}: started forward")
        y.backward(grad)
        expect_bits(x.grad, want_grad, f"{what}: started backward")
        raises(h.wait, halocp.ERR_INVALID_STATE, f"{what}: a second wait()")

        # In place.
        x2 = x.detach().clone().requires_grad_()
        padded = torch.full(want.shape, float("nan"), dtype=dtype)
        padded.narrow(dim, left, lengths[R]).copy_(x2)
        y2 = halocp.halo_exchange_start_(padded, left, right, dim).wait()
        expect(y2 is padded, f"{what}: the in-place wait() must return padded")
        expect_bits(padded, want, f"{what}: started in-place forward")
        padded.backward(grad)
        expect_bits(x2.grad, want_grad, f"{what}: started in-place backward")

        # Halos only, started; no graph without grad mode.
        with torch.no_grad():
            h = halocp.halos_start(x, left, right, dim)
        lh, rh = h.wait()
        expect(lh.grad_fn is None and rh.grad_fn is None, f"{what}: started under no_grad, the halos have a graph")
        expect_bits(lh, want.narrow(dim, 0, left), f"{what}: started left halo")
        expect_bits(rh, want.narrow(dim, left + lengths[R], right), f"{what}: started right halo")

    # Misuse, on a layout every rank has (plans of the cases above are gone).
    halocp.clear_plans()
    x = torch.arange(12.0).reshape(3, 4) + 100 * R
    want = oracle_forward(gather(x), R, 1, 2, 1)
    h = halocp.cp_halo_exchange_start(x, 1, 2, 1)
    raises(lambda: halocp.cp_halo_exchange_start(x, 1, 2, 1), halocp.ERR_INVALID_STATE, "a second start in flight")
    raises(lambda: halocp.cp_halo_exchange(x, 1, 2, 1), halocp.ERR_INVALID_STATE, "a blocking call while started")
    expect_bits(h.wait(), want, "the first exchange after the refused ones")

    # A handle dropped unwaited (by some ranks only) does not leave the plan
    # busy; the exchange keeps its tensors alive meanwhile (x is built inline).
    h = halocp.cp_halo_exchange_start(x.clone(), 1, 2, 1)
    if R % 2 == 0:
        del h
        gc.collect()
        torch.randn(1000)  # reuse freed memory, if it were freed
    else:
        expect_bits(h.wait(), want, "the waited exchange beside a dropped one")
    expect_bits(halocp.cp_halo_exchange(x, 1, 2, 1), want, "a blocking exchange after a dropped handle")
    h = halocp.halos_start(x, 1, 2, 1)
    del h
    lh, rh = halocp.halos_start(x, 1, 2, 1).wait()
    expect_bits(lh, want.narrow(1, 0, 1), "a started exchange after a dropped one")

    # Zero halos: no exchange, a finished handle.
    h = halocp.cp_halo_exchange_start(x, 0, 0, 1)
    expect(h.done and h.wait() is x, "zero halos: a finished handle returning x")
    raises(lambda: halocp.halos_start(x, -1, 0, 1), halocp.ERR_INVALID_ARGUMENT, "a negative halo size")
    leaf = torch.zeros(3, 7, requires_grad=True)
    raises(lambda: halocp.halo_exchange_start_(leaf, 1, 2, 1), halocp.ERR_INVALID_ARGUMENT, "in place into a leaf")


# ---------------------------------------------------------------- halos only


def scenario_halos(cases=20):
    """halocp.halos gives cp_halo_exchange's halos and gradients bit for
    bit, and passes gradcheck in float64."""
    R = ranks.RANK
    for case in range(cases):
        dtype, shape, dim, lengths, left, right, cfg, what = _case(case, 2)
        halocp.clear_plans()
        gen = torch.Generator().manual_seed(17 * case + R)
        layout = cfg.choice(["contiguous", "strided", "permuted", "narrowed"])
        x = ranks.with_layout(random_values(shape, dtype, gen), layout, cfg).detach().requires_grad_()
        x_ref = x.detach().clone().requires_grad_()
        lh, rh = halocp.halos(x, left, right, dim)
        y = halocp.cp_halo_exchange(x_ref, left, right, dim)
        n = lengths[R]
        if left == 0 and right == 0:
            expect(lh.shape[dim] == 0 and rh.shape[dim] == 0, f"{what}: zero halos must be empty")
            continue
        # The halos are dense in x's memory format: a permuted x's dim order
        # (its dims by stride, outermost first), else contiguous.
        order = sorted(range(x.dim()), key=lambda d: -x.stride()[d]) if layout == "permuted" else range(x.dim())
        for h in (lh, rh):
            expect(h.permute(*order).is_contiguous(),
                   f"{what}: the halos must be dense in x's dim order {order}, not strides {h.stride()}")
        expect_bits(lh, y.narrow(dim, 0, left), f"{what} ({layout}): left halo")
        expect_bits(rh, y.narrow(dim, left + n, right), f"{what} ({layout}): right halo")
        # The gradient: halos' gradients only, so cp_halo_exchange's with a zero interior.
        gl, gr = random_values(lh.shape, dtype, gen), random_values(rh.shape, dtype, gen)
        torch.autograd.backward([lh, rh], [gl, gr])
        y.backward(torch.cat([gl, torch.zeros_like(x_ref), gr], dim))
        expect_bits(x.grad, x_ref.grad, f"{what} ({layout}): gradient")

    lengths = [2, 3, 1, 4][:ranks.WORLD]
    for left, right, dim in [(2, 1, 1), (1, 5, 0)]:
        shape = [1, 2] if dim else [2, 1]
        shape[dim] = sum(lengths)
        torch.manual_seed(5)
        xg = torch.randn(shape, dtype=torch.float64, requires_grad=True)

        def fn(xg):
            lh, rh = halocp.halos(ranks._Scatter.apply(xg, lengths, dim), left, right, dim)
            return ranks._Gather.apply(torch.cat([lh, rh], dim), dim)

        ok = torch.autograd.gradcheck(fn, (xg,), eps=1e-6, atol=1e-8, raise_exception=False)
        expect(ok, f"gradcheck of halos failed: lengths {lengths}, left {left}, right {right}, dim {dim}")


# ---------------------------------------------------------------- layers


class _Allocations(TorchDispatchMode):
    """The shapes of the tensors that torch ops create: outputs in memory of
    their own (views, detach and in-place results excepted)."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = set()

        def storage(t):
            if isinstance(t, torch.Tensor) and t.numel():
                inputs.add(t.storage().data_ptr())

        def note(t):
            if isinstance(t, torch.Tensor) and t.numel() and t.storage().data_ptr() not in inputs:
                self.shapes.append((str(func), tuple(t.shape)))

        tree_map(storage, (args, kwargs))
        tree_map(note, out)
        return out


LAYERS = [  # (class, constructor arguments, dtype)
    (halocp.nn.CausalConv3d, dict(kernel_size=1), torch.float64),
    (halocp.nn.CausalConv3d, dict(kernel_size=2), torch.float64),
    (halocp.nn.CausalConv3d, dict(kernel_size=3, padding=1), torch.float32),
    (halocp.nn.CausalConv3d, dict(kernel_size=(3, 1, 3), padding=(0, 1), stride=(2, 1)), torch.float64),
    (halocp.nn.CausalConv3d, dict(kernel_size=(4, 3, 1), dilation=(2, 1, 1), padding=(1, 0)), torch.float64),
    (halocp.nn.CausalConv3d, dict(kernel_size=5, padding=2, bias=False), torch.float64),
    (halocp.nn.CenteredConv3d, dict(kernel_size=1, padding=0), torch.float64),
    (halocp.nn.CenteredConv3d, dict(kernel_size=3, padding=1), torch.float32),
    (halocp.nn.CenteredConv3d, dict(kernel_size=(3, 3, 3), dilation=(2, 1, 2), padding=(1, 2)), torch.float64),
    (halocp.nn.CenteredConv3d, dict(kernel_size=(5, 1, 3), stride=(1, 2), padding=(0, 1), groups=2), torch.float64),
]
LENGTHS = [[6, 9, 5, 7], [1, 6, 0, 3], [3, 8, 2, 6]]  # all longer than the halo; short and empty; mixed


def scenario_layers():
    """The context-parallel layers against the same convolution over the
    whole sequence: outputs, input gradients and weight and bias gradients
    summed over the ranks, within torch's default tolerances; no tensor of
    the padded input's shape is made or saved, and the backward makes no
    tensor of x's shape but the convolution's input gradient."""
    R, W = ranks.RANK, ranks.WORLD
    for i, (cls, kw, dtype) in enumerate(LAYERS):
        for j, lengths in enumerate(LENGTHS):
            lengths = lengths[:W]
            off = ranks.offsets(lengths)
            torch.manual_seed(100 * i + j)  # the same weights and data on every rank
            layer = cls(4, 6, dtype=dtype, **kw)
            full = torch.nn.Conv3d(4, 6, layer.kernel_size, stride=layer.stride, padding=layer.padding,
                                   dilation=layer.dilation, groups=layer.groups, bias=layer.bias is not None,
                                   dtype=dtype)
            full.load_state_dict(layer.state_dict())
            unbatched = (i + j) % 4 == 3
            xg = torch.randn(2, 4, off[-1], 5, 6, dtype=dtype)
            if unbatched:
                xg = xg[0]
            xg.requires_grad_()
            yg = full(F.pad(xg, (0, 0, 0, 0, layer.left, layer.right)))
            gg = torch.randn_like(yg)
            yg.backward(gg)

            t = xg.dim() - 3
            x = xg.detach().narrow(t, off[R], lengths[R]).clone().requires_grad_()
            saved = []
            with torch.autograd.graph.saved_tensors_hooks(lambda s: (saved.append(tuple(s.shape)), s)[1], lambda s: s):
                with _Allocations() as fwd:
                    y = layer(x)
            with _Allocations() as bwd:
                y.backward(gg.narrow(t, off[R], lengths[R]))
            what = f"{layer} ({dtype}, lengths {lengths}{', unbatched' if unbatched else ''})"
            try:
                torch.testing.assert_close(y, yg.detach().narrow(t, off[R], lengths[R]), msg=lambda m: f"output: {m}")
                torch.testing.assert_close(x.grad, xg.grad.narrow(t, off[R], lengths[R]),
                                           msg=lambda m: f"input grad: {m}")
                # A weight gradient entry sums ~1000 products, in another order on
                # the shards: in float32 that moves it by ~1e-6 of its ~30 magnitude.
                sums = dict(atol=1e-4, rtol=1.3e-6) if dtype == torch.float32 else {}
                for name in ("weight", "bias"):
                    if getattr(full, name) is None:
                        continue
                    g = getattr(layer, name).grad.clone()
                    dist.all_reduce(g)
                    torch.testing.assert_close(g, getattr(full, name).grad, **sums,
                                               msg=lambda m, name=name: f"{name} grad: {m}")
            except AssertionError as e:
                raise Failure(f"{what}: {e}") from None

            c, n = layer.left + layer.right, lengths[R]
            if n > c and c > 0:  # the fused path (shorter shards convolve a small padded copy)
                x5 = (1,) * unbatched + tuple(x.shape)  # the layer works on a batch
                padded = x5[:2] + (n + c,) + x5[3:]
                made = [f for f, s in fwd.shapes + bwd.shapes if s == padded]
                expect(not made, f"{what}: the padded input was made by {made}")
                expect(padded not in saved, f"{what}: autograd saved a tensor of the padded input's shape")
                if n not in (layer.left + c, c + layer.right):  # else a slab has x's shape
                    full_size = [f for f, s in bwd.shapes if s == x5 and "convolution" not in f]
                    # A batch of one that torch's CPU conv3d would give slow_conv3d is
                    # convolved as a batch of two halves (halocp.nn._conv): its input
                    # gradient comes as the halves', put together in one tensor of x's shape.
                    halves = x5[0] == 1 and any(f.startswith("aten.convolution_backward") and s[0] == 2
                                                for f, s in bwd.shapes)
                    expect(len(full_size) <= halves,
                           f"{what}: the backward made tensors of x's shape: {full_size}")

    # An input that needs no gradient (the weight's is still right: the
    # halos were kept), and inference under no_grad.
    lengths = LENGTHS[0][:W]
    off = ranks.offsets(lengths)
    torch.manual_seed(7)
    layer = halocp.nn.CenteredConv3d(4, 6, 3, padding=1, dtype=torch.float64)
    xg = torch.randn(1, 4, off[-1], 3, 4, dtype=torch.float64)
    yg = F.conv3d(F.pad(xg, (0, 0, 0, 0, 1, 1)), layer.weight, layer.bias, padding=(0, 1, 1))
    gg = torch.randn_like(yg)
    want_w = torch.autograd.grad(yg, layer.weight, gg)[0]
    x = xg.narrow(2, off[R], lengths[R]).clone()
    with torch.no_grad():
        torch.testing.assert_close(layer(x), yg.detach().narrow(2, off[R], lengths[R]))
    layer(x).backward(gg.narrow(2, off[R], lengths[R]))
    g = layer.weight.grad.clone()
    dist.all_reduce(g)
    torch.testing.assert_close(g, want_w)

    # Bad input: a clear error on every rank, before any exchange.
    layer = halocp.nn.CausalConv3d(4, 6, 3)
    raises(lambda: layer(torch.randn(2, 5, 4, 3, 3)), halocp.ERR_INVALID_ARGUMENT, "wrong number of channels")
    raises(lambda: layer(torch.randn(4, 3, 3)), halocp.ERR_INVALID_ARGUMENT, "a 3-d input")


# ---------------------------------------------------------------- orders


def scenario_orders(steps=18):
    """Two exchanges in flight whose shard lengths change from step to step
    (each rank finds or makes its plans by its own shape, so ranks agree
    again inside the exchanges), finished in orders that differ between the
    ranks or by a test() on the second first: every one finishes, bit for
    bit, well before the deadline (HALO_TIMEOUT_MS, short in this test)."""
    R, W = ranks.RANK, ranks.WORLD
    cfg = random.Random(4242 + W)  # the same on every rank
    gen = torch.Generator().manual_seed(7 + R)
    for step in range(steps):
        la = [cfg.randint(1, 5) for _ in range(W)]
        lb = [cfg.randint(0, 4) for _ in range(W)]
        if not any(lb):
            lb[0] = 2
        a = random_values((2, la[R], 3), torch.float32, gen)
        b = random_values((3, lb[R]), torch.float64, gen)
        want_a = oracle_forward(gather(a), R, 2, 1, 1)
        want_b = oracle_forward(gather(b), R, 1, 2, 1)
        variant = step % 3
        what = f"step {step} (variant {variant}): lengths {la} and {lb}"
        t0 = time.monotonic()
        h1 = halocp.cp_halo_exchange_start(a, 2, 1, 1)
        h2 = halocp.cp_halo_exchange_start(b, 1, 2, 1)
        if variant == 0:
            # The sequence, on every rank.
            h2.test()
            y1, y2 = h1.wait(), h2.wait()
        elif variant == 1:
            # Waits in opposite orders on even and odd ranks.
            if R % 2 == 0:
                y1, y2 = h1.wait(), h2.wait()
            else:
                y2, y1 = h2.wait(), h1.wait()
        else:
            # Rank 0 polls the second until it is done; the others wait the first.
            if R == 0:
                while not h2.test():
                    expect(time.monotonic() - t0 < 10, f"{what}: test() never reported the second finished")
                y2, y1 = h2.wait(), h1.wait()
            else:
                y1, y2 = h1.wait(), h2.wait()
        took = time.monotonic() - t0
        expect_bits(y1, want_a, f"{what}: the first exchange")
        expect_bits(y2, want_b, f"{what}: the second exchange")
        expect(took < 2.0, f"{what}: took {took:.2f} s (a rank waited for a deadline)")


# ---------------------------------------------------------------- abort


def scenario_abort():
    """halocp.abort from another thread ends rank 0's blocked exchange (rank
    1 never joins it) and its started one with ERR_COMM_FAILED, promptly;
    later calls fail too; a new communicator for the group then works."""
    R = ranks.RANK
    group = dist.new_group(list(range(ranks.WORLD)))
    halocp.abort(group)  # no communicator yet: nothing to abort
    halocp.communicator(group, timeout=60)  # a prompt failure can only come from the abort
    x = torch.randn(2, 3 + R, 4)
    want = oracle_forward(gather(x), R, 1, 1, 1)
    expect_bits(halocp.cp_halo_exchange(x, 1, 1, 1, group), want, "an exchange before the abort")
    halocp.halos(x, 1, 1, 1, group)  # makes the halos plan on every rank
    if R == 0:
        h = halocp.halos_start(x, 1, 1, 1, group)
        timer = threading.Timer(0.3, halocp.abort, args=(group,))
        t0 = time.monotonic()
        timer.start()
        raises(lambda: halocp.cp_halo_exchange(x, 1, 1, 1, group), halocp.ERR_COMM_FAILED, "the blocked exchange",
               within=5)
        took = time.monotonic() - t0
        timer.join()
        expect(took > 0.25, f"the exchange failed after {took:.2f} s, before the abort")
        raises(h.wait, halocp.ERR_COMM_FAILED, "the started exchange", within=1)
        raises(h.wait, halocp.ERR_COMM_FAILED, "the started exchange, waited again", within=1)
        raises(lambda: halocp.cp_halo_exchange(x, 1, 1, 1, group), halocp.ERR_COMM_FAILED, "an exchange after abort",
               within=1)
        raises(lambda: halocp.halos_start(x, 1, 1, 1, group), halocp.ERR_COMM_FAILED, "a start after abort", within=1)
        halocp.abort(group)  # idempotent
    dist.barrier()
    halocp.destroy_communicator(group)
    expect_bits(halocp.cp_halo_exchange(x, 1, 1, 1, group), want, "an exchange on a new communicator")


if __name__ == "__main__":
    ranks.main(globals())
