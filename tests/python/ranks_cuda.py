"""One rank of the tests of halocp's CUDA support that a CPU can run;
tests/python/test_cuda.py starts W of them (the helpers and the oracle are
ranks.py's). No GPU is needed: the staging path for CUDA tensors runs on CPU
tensors (halocp._cuda.stage_cpu), through the same code; tests/gpu/ holds
the check for a machine with a GPU.

    ranks_cuda.py SCENARIO...
"""

from __future__ import annotations


import torch
import torch.distributed as dist

import halocp
import ranks
import ranks_overlap
from halocp import _cuda, _lib
from ranks import expect, raises


def _memory_types() -> int:
    return _lib.comm_memory_types(halocp.communicator().handle)


def _cuda_plan(memory_type, key):
    """A halos-only plan over CUDA memory (or memory_type), made through the
    C ABI as halocp's direct path makes it, and its first forward (on host
    memory: what the ranks agree on, or not, is decided before any byte
    moves). halocp's plans are deferred: the agreement's errors come from
    the first exchange."""
    x, lh, rh = torch.empty(2, 4), torch.empty(2, 1), torch.empty(2, 1)
    p = _cuda.buffer_params(x, lh, rh, lh, rh, x, 1, 1, 1, memory_type)
    plan = halocp.communicator().plan(("test", key), lambda: p)
    plan.exchange(_lib.DIR_FORWARD, x.data_ptr(), lh.data_ptr(), rh.data_ptr())


def scenario_memory():
    """The memory-type plumbing with the real library and this machine's UCX:
    what the communicator moves, which path halocp picks, and that a CUDA
    plan where UCX has no CUDA support fails on every rank, saying what to do."""
    types = _memory_types()
    expect(types & 1 << _lib.MEMORY_HOST, f"halo_comm_memory_types = {types:#x}: no host memory")
    cuda = bool(types & 1 << _lib.MEMORY_CUDA)
    expect(halocp.cuda_path() == ("direct" if cuda else "staged"), f"cuda_path() {halocp.cuda_path()!r} with types {types:#x}")
    if not cuda:
        e = raises(lambda: _cuda_plan(_lib.MEMORY_CUDA, 1), halocp.ERR_INVALID_ARGUMENT, "a CUDA plan without CUDA in UCX")
        for words in ("cannot move cuda memory", "--with-cuda", f"ranks 0-{ranks.WORLD - 1}" if ranks.WORLD > 1 else "rank 0"):
            expect(words in str(e), f"the error lacks {words!r}: {e}")
    # Ranks that disagree on the memory type are all told so (the agreement
    # covers it before any transport is asked).
    mine = _lib.MEMORY_CUDA if ranks.RANK == 0 else _lib.MEMORY_HOST
    e = raises(lambda: _cuda_plan(mine, 2), halocp.ERR_MISMATCH, "ranks that disagree on the memory type")
    expect("memory type: cuda on rank 0, host on rank" in str(e), f"the mismatch does not name the memory type: {e}")
    e = raises(lambda: _cuda_plan(5, 3), halocp.ERR_INVALID_ARGUMENT, "memory type 5")
    expect("unknown memory type 5" in str(e), str(e))
    e = raises(lambda: halocp.cp_halo_exchange(torch.empty(2, 3, device="meta"), 1, 1, 0), halocp.ERR_INVALID_ARGUMENT,
               "a tensor on the meta device")
    expect("is on meta" in str(e) and "CPU and CUDA" in str(e), str(e))
    # The communicator still works, and the staging path gives the CPU path's bits.
    x = torch.randn(5, 3, dtype=torch.bfloat16)
    with _cuda.stage_cpu():
        staged = halocp.cp_halo_exchange(x, 2, 1, 0)
        expect(_cuda.wanted(x), "stage_cpu() does not route CPU tensors")
        started = halocp.cp_halo_exchange_start(x, 2, 1, 0).wait()
        lh, rh = halocp.halos_start(x, 2, 1, 0).wait()
        padded = torch.zeros(8, 3, dtype=x.dtype)
        padded.narrow(0, 2, 5).copy_(x)
        filled = halocp.halo_exchange_start_(padded, 2, 1, 0).wait()
    expect(not _cuda.wanted(x), "stage_cpu() outlived its block")
    want = halocp.cp_halo_exchange(x, 2, 1, 0)
    for got, what in ((staged, "cp_halo_exchange"), (started, "cp_halo_exchange_start"), (filled, "halo_exchange_start_"),
                      (torch.cat([lh, x, rh]), "halos_start")):
        ranks.expect_bits(got, want, f"staged {what} against the CPU path")


def scenario_staged_exchange():
    """ranks.py's random layouts (uneven shards, halos longer than shards,
    any strides, every dtype) through the staging path."""
    with _cuda.stage_cpu():
        ranks.scenario_exchange(cases=9)


def scenario_staged_padding():
    """ranks.py's replicate, reflect and circular cases through the staging
    path (the whole shard is staged for them)."""
    with _cuda.stage_cpu():
        ranks.scenario_padding(cases=4)


def scenario_staged_async():
    """ranks_overlap.py's started exchanges, test() and misuse through the
    staging path."""
    with _cuda.stage_cpu():
        ranks_overlap.scenario_async(cases=6)


def scenario_staged_errors():
    """ranks.py's bad calls through the staging path: the same errors, on
    every rank, and the communicator still usable."""
    with _cuda.stage_cpu():
        ranks.scenario_errors()


def scenario_staged_halos():
    """ranks_overlap.py's halos() cases and gradcheck through the staging path."""
    with _cuda.stage_cpu():
        ranks_overlap.scenario_halos(cases=6)


def scenario_staged_nn():
    """halocp.nn's layers take the device path: a tensor routed as a GPU's
    never reaches the fused path's host plans (it once did, whatever the
    device), and a device halocp cannot exchange is refused by name."""
    torch.manual_seed(7)
    comm = halocp.communicator()
    # Shards longer than the kernel's context take the fused path (its halos
    # exchange on the device path), a two-frame one the padded path.
    for cls, frames in ((halocp.nn.CausalConv3d, 3), (halocp.nn.CenteredConv3d, 4), (halocp.nn.CenteredConv3d, 2)):
        layer = cls(3, 4, 3, padding=1)
        x = torch.randn(2, 3, frames + ranks.RANK, 4, 5, requires_grad=True)
        want = layer(x)
        want_gx, want_gw = torch.autograd.grad(want.sum(), (x, layer.weight))
        before = len(comm.cached("buffers"))
        with _cuda.stage_cpu():
            got = layer(x)
            got_gx, got_gw = torch.autograd.grad(got.sum(), (x, layer.weight))
        name = f"{cls.__name__} of {frames + ranks.RANK} frames"
        expect(len(comm.cached("buffers")) > before, f"{name} under stage_cpu() did not go through the staged path")
        for g, w, what in ((got, want, "output"), (got_gx, want_gx, "grad_x"), (got_gw, want_gw, "grad_weight")):
            expect(torch.allclose(g, w, rtol=1e-5, atol=1e-5), f"staged {name}: {what} differs from the CPU path")
    e = raises(lambda: layer(torch.empty(2, 3, 4, 4, 5, device="meta")), halocp.ERR_INVALID_ARGUMENT,
               "CausalConv3d of a tensor on the meta device")
    expect("is on meta" in str(e), str(e))
    # close() releases every piece of state the communicator declares.
    expect(comm.cached("route") and comm.cached("buffers") and comm.cached("plan") and comm.cuda_path,
           "nothing was cached to release")
    halocp.destroy_communicator()
    expect((len(comm.cache), comm.dropped, comm.cuda_path, comm.handle) == (0, [], None, None),
           f"close() kept state: {list(comm.cache)}, {comm.dropped}, {comm.cuda_path}, {comm.handle}")


# ------------------------------------------------------------ issue 19 §3
# Slab-sized buffers: a layout's buffers hold its virtual shard (the slices
# the exchange reads or writes), never the whole shard.

# (shard lengths by rank, left, right): long shards that are cut, empty and
# short ones that halos pass through (multi-hop), a causal and an
# anti-causal one; taken for the first WORLD ranks.
SLAB_CASES = [([9, 0, 2, 12], 2, 1), ([1, 10, 0, 7], 3, 2), ([11, 2, 13, 1], 0, 3), ([8, 7, 1, 10], 2, 0)]


def _forms(x, left, right, dim, mode, grad):
    """Every public form on a copy of x, forward and backward: a list of
    (what, tensor) to compare, bit for bit, with another path's."""
    got = []
    n = x.shape[dim]
    for name, start in (("cp_halo_exchange", False), ("cp_halo_exchange_start", True)):
        xc = x.detach().clone().requires_grad_()
        y = (halocp.cp_halo_exchange_start(xc, left, right, dim, padding_mode=mode).wait() if start
             else halocp.cp_halo_exchange(xc, left, right, dim, padding_mode=mode))
        y.backward(grad)
        got += [(name, y.detach()), (name + " backward", xc.grad)]
    for name, start in (("halo_exchange_", False), ("halo_exchange_start_", True)):
        xc = x.detach().clone().requires_grad_()
        padded = torch.full(grad.shape, float("nan"), dtype=x.dtype)
        padded.narrow(dim, left, n).copy_(xc)
        y = (halocp.halo_exchange_start_(padded, left, right, dim, padding_mode=mode).wait() if start
             else halocp.halo_exchange_(padded, left, right, dim, padding_mode=mode))
        y.backward(grad)
        got += [(name, y.detach()), (name + " backward", xc.grad)]
    for name, start in (("halos", False), ("halos_start", True)):
        xc = x.detach().clone().requires_grad_()
        lh, rh = (halocp.halos_start(xc, left, right, dim, padding_mode=mode).wait() if start
                  else halocp.halos(xc, left, right, dim, padding_mode=mode))
        torch.autograd.backward([lh, rh], [grad.narrow(dim, 0, left), grad.narrow(dim, left + n, right)])
        got += [(name + " left", lh.detach()), (name + " right", rh.detach()), (name + " backward", xc.grad)]
    return got


def scenario_slabs():
    """Every padding mode, float32 and bfloat16, uneven shards (cut long
    ones, empty ones, ones shorter than the halos, multi-hop), every form
    forward and backward: the staged path's results bit for bit the host
    path's; and a long shard's buffers hold its first `right` and last
    `left` slices only (zero padding: right + left slices, not the shard)."""
    comm = halocp.communicator()
    for mode in ("zeros", "replicate", "reflect", "circular"):
        for case, (lengths, left, right) in enumerate(SLAB_CASES):
            lengths = lengths[:ranks.WORLD]
            if mode == "reflect" and max(left, right) >= sum(lengths):
                continue
            for dtype in (torch.float32, torch.bfloat16):
                gen = torch.Generator().manual_seed(100 * case + ranks.RANK)
                dim, n = 1, lengths[ranks.RANK]
                x = ranks.random_values((2, n, 3), dtype, gen)
                grad = ranks.random_values((2, n + left + right, 3), dtype, gen)
                what = f"{mode}, {dtype}, lengths {lengths}, left {left}, right {right}"
                want = _forms(x, left, right, dim, mode, grad)
                with _cuda.stage_cpu():
                    got = _forms(x, left, right, dim, mode, grad)
                for (name, g), (_, w) in zip(got, want):
                    ranks.expect_bits(g, w, f"staged {name}, {what}")
                if mode == "zeros" and n > left + right:
                    key = (x.device, True, dtype, dim, left, right, tuple(x.shape), mode)
                    lay = comm.cached("buffers")[key]
                    slab = 2 * 3 * (left + right)
                    expect(lay.x.numel() == slab and lay.gx.numel() == slab,
                           f"{what}: a shard of {n} slices is staged through buffers of {lay.x.numel()} and "
                           f"{lay.gx.numel()} elements, not its {left} + {right} boundary slices ({slab})")
                for lay in comm.cached("buffers").values():
                    expect(lay.x.shape[lay.dim] <= min(lay.n, 2 * (lay.left + lay.right) + 2),
                           f"{what}: a buffer of {lay.x.shape[lay.dim]} slices for a shard of {lay.n}")


# ------------------------------------------------------------ issue 19 §2, §4
# The direct path's code on CPU memory (stage_cpu("direct")): host plans
# started on streams of libhalo's host emulation of the driver
# (HALO_CUDA_DRIVER=host-fake, set by test_cuda.py), finished by a stream
# wait and a host wait. Only layouts a CUDA plan takes: every shard at least
# left + right long (empty ones where no halo passes through them).
DIRECT_CASES = [([7, 5, 9, 4], 2, 1), ([3, 8, 6, 11], 1, 2), ([6, 6, 6, 6], 3, 3), ([10, 4, 5, 0], 3, 0),
                ([9, 12, 7, 8], 0, 4)]


def _direct_layouts(comm) -> list:
    return [lay for lay in comm.cached("buffers").values() if lay.direct]


def scenario_direct():
    """Every form, float32 and bfloat16, forward and backward, cut and whole
    shards: the direct path's results bit for bit the host path's; the
    exchanges went through stream-ordered requests (freed once ended);
    another mode than zeros is staged (a CUDA plan's creation refuses it);
    a host exchange while a stream-ordered one is in flight waits for it."""
    comm = halocp.communicator()
    for case, (lengths, left, right) in enumerate(DIRECT_CASES):
        lengths = lengths[:ranks.WORLD]
        for dtype in (torch.float32, torch.bfloat16):
            gen = torch.Generator().manual_seed(100 * case + ranks.RANK)
            dim, n = 1, lengths[ranks.RANK]
            x = ranks.random_values((2, n, 3), dtype, gen)
            grad = ranks.random_values((2, n + left + right, 3), dtype, gen)
            what = f"{dtype}, lengths {lengths}, left {left}, right {right}"
            want = _forms(x, left, right, dim, "zeros", grad)
            before = len(_direct_layouts(comm))
            with _cuda.stage_cpu("direct"):
                got = _forms(x, left, right, dim, "zeros", grad)
            expect(len(_direct_layouts(comm)) > before, f"{what}: stage_cpu('direct') did not take the direct path")
            for (name, g), (_, w) in zip(got, want):
                ranks.expect_bits(g, w, f"direct {name}, {what}")
            if n > left + right:
                lay = next(lay for lay in _direct_layouts(comm) if lay.shape == tuple(x.shape) and lay.x.dtype == dtype)
                expect(lay.x.shape[dim] == left + right, f"{what}: a direct buffer of {lay.x.shape[dim]} slices")
    # Another mode: a CUDA plan's creation refuses it, the layout is staged.
    x = torch.randn(2, 5, 3)
    want = halocp.cp_halo_exchange(x, 1, 2, 1, padding_mode="replicate")
    with _cuda.stage_cpu("direct"):
        got = halocp.cp_halo_exchange(x, 1, 2, 1, padding_mode="replicate")
        lay = _cuda._buffers(comm, x, 1, 2, 1, "replicate")
    ranks.expect_bits(got, want, "replicate under stage_cpu('direct')")
    expect(not lay.direct, "a replicate layout took the direct path")
    # A host exchange (the staged replicate one) while a stream-ordered one
    # is in flight: the host waits for it first (the library allows no other
    # call meanwhile), and both are right.
    y = torch.randn(2, 6, 3)
    want_y = halocp.cp_halo_exchange(y, 2, 1, 1)
    with _cuda.stage_cpu("direct"):
        started = halocp.cp_halo_exchange_start(y, 2, 1, 1)
        expect(started._pending.stream == _cuda._FAKE_STREAM, "the direct path's start was not stream-ordered")
        got = halocp.cp_halo_exchange(x, 1, 2, 1, padding_mode="replicate")
        got_y = started.wait()
    ranks.expect_bits(got, want, "a staged exchange while a stream-ordered one was in flight")
    ranks.expect_bits(got_y, want_y, "a stream-ordered exchange waited for after a staged one")
    try:
        with _cuda.stage_cpu("sideways"):
            pass
        raise ranks.Failure("stage_cpu('sideways') was accepted")
    except ValueError as e:
        expect("'sideways'" in str(e), str(e))


def scenario_direct_handles():
    """ranks_overlap.py's handle misuse and dropped handles through the
    direct path's code (stage_cpu("direct"))."""
    with _cuda.stage_cpu("direct"):
        ranks_overlap.scenario_async(cases=0)


def scenario_handover():
    """The direct path's finish as on a GPU, where the host does not wait
    (on CPU memory the switch adds a host wait, skipped here): the stream
    is told to wait and the request is freed there (the library releases
    it when the exchange ends), and the later exchanges are right."""
    comm = halocp.communicator()
    x = torch.randn(2, 6, 3)
    want = halocp.cp_halo_exchange(x, 2, 1, 1)
    with _cuda.stage_cpu("direct"):
        halocp.cp_halo_exchange(x, 2, 1, 1)  # the plan's first exchange, which the host waits for
        started = halocp.cp_halo_exchange_start(x, 2, 1, 1)
        pending = started._pending
        pending.host_wait = False
        started.wait()  # (its result is not read: torch's copies out are not on the stream here)
        expect(pending.finished and pending.tensors == (), "the stream-waited exchange was not released at the wait")
        for _ in range(3):
            got = halocp.cp_halo_exchange(x, 2, 1, 1)
    ranks.expect_bits(got, want, "an exchange after one that only a stream waited for")


def scenario_failed_after_wait():
    """A stream-ordered exchange that fails after a stream was told to wait
    for it and its request was freed (rank 0 starts one that no peer joins,
    then aborts): the next exchange on the communicator raises that failure
    (the library's report of a freed request's failure), saying that what
    the stream read is not valid."""
    group = dist.new_group(list(range(ranks.WORLD)))
    x = torch.randn(2, 6, 3)
    with _cuda.stage_cpu("direct"):
        halocp.cp_halo_exchange(x, 1, 1, 1, group)  # the plan agreed on every rank
        dist.barrier()  # every rank done with it before rank 0 aborts (which voids what peers still wait for)
        if ranks.RANK == 0:
            started = halocp.cp_halo_exchange_start(x, 1, 1, 1, group)
            pending = started._pending
            pending.host_wait = False  # as on a GPU: the stream waits, the host does not
            started.wait()
            expect(pending.finished and pending.tensors == (), "the stream-waited request was not freed at the wait")
            halocp.abort(group)
            e = raises(lambda: halocp.cp_halo_exchange(x, 1, 1, 1, group), halocp.ERR_COMM_FAILED,
                       "the exchange after a stream-waited one failed")
            expect("freed before its result was read" in e and "not valid" in e, e)
    dist.barrier()
    halocp.destroy_communicator(group)


def scenario_refused():
    """A direct layout whose plan is refused in its first exchange, on every
    rank (a CUDA plan does so when a slice goes to two ranks; here a host
    plan that cannot serve its reflect halos stands in for it, as a host
    plan takes any layout): the call is rerun staged on every rank, gives
    the host path's bits, and the layout stays staged."""
    comm = halocp.communicator()
    real = _cuda._Buffers._params

    def refused_in_agreement(lay, memory):
        if lay.direct and memory == _lib.MEMORY_HOST:  # the direct path's plan, not the creation probe
            return _cuda.buffer_params(lay.x, lay.lh, lay.rh, lay.gl, lay.gr, lay.gx, lay.left, lay.right, lay.dim,
                                       memory, "reflect")
        return real(lay, memory)

    # Rank 0's one slice is the left halo of every other rank (multi-hop).
    n = 1 if ranks.RANK == 0 else 0
    x = torch.randn(2, n, 3, dtype=torch.bfloat16)
    grad = torch.randn(2, n + 2, 3, dtype=torch.bfloat16)
    want = _forms(x, 2, 0, 1, "zeros", grad)
    _cuda._Buffers._params = refused_in_agreement
    try:
        with _cuda.stage_cpu("direct"):
            got = _forms(x, 2, 0, 1, "zeros", grad)
            lay = _cuda._buffers(comm, x, 2, 0, 1, "zeros")
    finally:
        _cuda._Buffers._params = real
    for (name, g), (_, w) in zip(got, want):
        ranks.expect_bits(g, w, f"{name} of a layout refused in its first exchange")
    expect(not lay.direct, "the refused layout is still direct")


if __name__ == "__main__":
    ranks.main(globals())
