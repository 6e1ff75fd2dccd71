"""CUDA tensors: the staged and direct device paths under exchange.py's
forms (the host path is _host.py).

libhalo never touches GPU memory from the CPU: a plan over CUDA memory moves
bytes only, and all local work (the interior copy, the zero halos beyond the
sequence, the gradient additions) is torch's, on the tensor's device, on the
current CUDA stream. Two paths, chosen per communicator at run time:

- direct: the communicator's UCX moves CUDA memory (HPC-X, UCX built
  --with-cuda; halo_comm_memory_types says so). A CUDA plan sends the
  boundary slabs from a device buffer and receives the halos and the
  neighbours' halo gradients into device buffers; torch adds the gradients
  in the reference's order. Layouts a CUDA plan refuses (a slice sent to two
  ranks: halos longer than a shard, or left + right longer than one) are
  staged instead, on every rank alike.
- staged: any other UCX (Debian's). The boundary slabs go device -> pinned
  host buffer (the slabs only), a host plan exchanges them, and the halos go
  host -> device. In the backward the boundary slices of x's gradient make
  the same round trip and the host plan adds the neighbours' gradients into
  them, in the order and dtype of the CPU path, so results are bit-identical
  to it (and to the reference).

Either way each layout keeps its buffers, laid out with dim outermost so
that a slab is one contiguous run, and slab-sized: they hold x's virtual
shard (_edges), the slices the exchange reads or writes, never the whole
shard.

Streams. Direct: an exchange is started on the current stream
(halo_exchange_start with its handle): it begins after the copies into the
buffers queued there, and the caller is not blocked; it is finished by
making the stream current at the wait (or at the backward's finish) wait
for it, which then reads the results by copies queued on it, so a
``*_start(...).wait()`` under another stream is ordered too. Staged: the
stream is synchronised before the host plan reads the buffers and the host
waits for the exchange; the results go to the caller's tensors by copies on
the stream current at the wait. Buffers are not rewritten before the copies
out of them have run (the next start waits for them: the stream, direct;
the host, staged).

CPU tensors take the host path, unless ``stage_cpu`` routes them through
this module: True the staging path, "direct" the direct path's code on
host-memory plans and the streams of libhalo's host emulation of the CUDA
driver. The tests and the GPU check's dry run use it to run this code
without a GPU.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from . import _inflight, _lib
from ._route import HalosRoute, Route
from ._comm import communicator
from ._shapes import dim_order, empty_in_order, outermost as _outermost, resized as _halo_shape
from ._lib import HaloError, halo_dtype

DIRECT, STAGED = "direct", "staged"

_stage_cpu = False
# The stream of the direct path's CPU test switch: any non-zero handle is a
# stream of libhalo's host emulation of the CUDA driver.
_FAKE_STREAM = 0x5717E


@contextlib.contextmanager
def stage_cpu(on=True):
    """Within the block, CPU tensors take this module's code, as a GPU's
    would: True, the staging path; ``"direct"``, the direct path's code,
    with host-memory plans started on a stream of libhalo's host emulation
    of the CUDA driver (the communicator must be made with
    HALO_CUDA_DRIVER=host-fake). A host plan takes layouts a CUDA plan
    refuses, so under "direct" only those a CUDA plan takes (a padding
    other than zeros is refused by the plan's creation, and staged) give
    a CUDA plan's results: every shard as long as left + right."""
    if on not in (False, True, DIRECT):
        raise ValueError(f"halocp: stage_cpu({on!r}): expected True, False or {DIRECT!r}")
    global _stage_cpu
    before, _stage_cpu = _stage_cpu, on
    try:
        yield
    finally:
        _stage_cpu = before


def stage_cpu_mode():
    """stage_cpu's setting now (False outside it)."""
    return _stage_cpu


def wanted(t: Tensor) -> bool:
    """Whether t's exchange is this module's."""
    return t.is_cuda or (_stage_cpu and t.is_cpu)


def cuda_path(group=None) -> str:
    """Which path CUDA tensors take on the group's communicator: ``"direct"``
    (its UCX moves CUDA memory) or ``"staged"`` (through pinned host
    buffers). Makes the communicator if it does not exist (collectively)."""
    return _path(communicator(group))


def _path(comm) -> str:
    path = comm.cuda_path
    if path is None:
        path = DIRECT if _lib.comm_memory_types(comm.handle) >> _lib.MEMORY_CUDA & 1 else STAGED
        comm.cuda_path = path
    return path


# ------------------------------------------------------------------ layouts


def _format(t: Tensor, shape=None) -> tuple:
    """What an output in t's memory format needs: the CPU path's outputs and
    gradients keep x's format, and so do these."""
    return (tuple(t.shape if shape is None else shape), dim_order(t), t.dtype, t.device)


def _empty(fmt: tuple) -> Tensor:
    return empty_in_order(*fmt)


class _Refused(Exception):
    """A CUDA plan refused its layout in its first exchange, on every rank."""


class _Buffers:
    """One layout's plan and buffers: on the device for a CUDA plan
    (direct), in pinned host memory for a host plan (staged; plain host
    memory for CPU tensors in the dry run)."""

    def __init__(self, comm, x: Tensor, left, right, dim, padding_mode, direct: bool):
        self.comm, self.left, self.right, self.dim, self.padding_mode = comm, left, right, dim, padding_mode
        self.shape, self.n, self.dtype, self.device = tuple(x.shape), x.shape[dim], x.dtype, x.device
        self.cuda = x.device.type == "cuda"
        n = self.n
        # The buffers hold x's virtual shard (see _edges): its first `a` and
        # last `b` slices, or all n when they would meet.
        a, b = _edges(left, right, padding_mode)
        self.cut = a + b < n
        self.a, self.b = (a, b) if self.cut else (n, 0)
        # The slices the neighbours' halo gradients come back to: x's first
        # `right` and last `left`, clamped to the shard.
        self.r_sent, self.l_sent = min(right, n), min(left, n)
        self._allocate(direct)

    def _allocate(self, direct: bool) -> None:
        """The buffers and the plan of the direct or the staged path."""
        self.direct, dim = direct, self.dim
        kw = {"dtype": self.dtype}
        if direct:
            kw["device"] = self.device
        elif self.cuda:
            kw["pin_memory"] = True
        # Every slab one run of memory: no I/O vectors, which UCX's CUDA
        # protocols may not take, and one memcpy per staging copy.
        shard = _halo_shape(self.shape, dim, self.a + self.b)
        self.x = _outermost(shard, dim, **kw)
        self.gx = _outermost(shard, dim, **kw)
        self.lh = _outermost(_halo_shape(self.shape, dim, self.left), dim, **kw)
        self.rh = _outermost(_halo_shape(self.shape, dim, self.right), dim, **kw)
        self.gl = _outermost(_halo_shape(self.shape, dim, self.left), dim, **kw)
        self.gr = _outermost(_halo_shape(self.shape, dim, self.right), dim, **kw)
        if direct and not self.cuda:
            # The CPU test switch makes a host plan once a CUDA plan's
            # creation (local) has taken the layout, as it would on a GPU.
            _lib.Plan(self.comm, self._params(_lib.MEMORY_CUDA))
        self.plan = self._plan()
        self.agreed = None  # the plan whose first exchange (direct) has been waited for
        # Copies out of pinned buffers still to run before they are rewritten.
        self.fwd_read = self.bwd_read = None
        self.fwd = None  # the forward exchange started last: it owns the buffers until it finishes

    def _plan(self):
        key = ("cuda" if self.direct else "staged", self.x.dtype, self.dim, self.left, self.right, tuple(self.x.shape),
               self.padding_mode)
        memory = _lib.MEMORY_CUDA if self.direct and self.cuda else _lib.MEMORY_HOST
        _inflight.settle(self.comm)
        return self.comm.plan(key, lambda: self._params(memory))

    def _params(self, memory):
        return buffer_params(self.x, self.lh, self.rh, self.gl, self.gr, self.gx, self.left, self.right, self.dim,
                             memory, self.padding_mode)

    def _slabs(self, t: Tensor, buf: Tensor):
        """(slab of t, slab of buf) pairs: the slices of x's layout that the
        exchange reads or writes (t: x, or a tensor of its shape) and where
        they lie in buf, one of the layout's buffers of the virtual shard."""
        a, b, n, d = self.a, self.b, self.n, self.dim
        if not self.cut:
            return [(t, buf)] if n else []
        pairs = [(t.narrow(d, 0, a), buf.narrow(d, 0, a)), (t.narrow(d, n - b, b), buf.narrow(d, a, b))]
        return [p for p in pairs if p[0].shape[d]]

    def _middle(self, t: Tensor) -> Tensor:
        """The slices of t (x's shape) that are not in the virtual shard."""
        return t.narrow(self.dim, self.a, self.n - self.a - self.b)

    def _copy(self, dst: Tensor, src: Tensor) -> None:
        """dst <- src on the current stream, one of them (a slab of) a buffer
        with dim outermost: seen with dim first, that one is contiguous, so
        a copy between host and device is one asynchronous memcpy (torch
        makes the other side contiguous on the device first)."""
        dst.movedim(self.dim, 0).copy_(src.movedim(self.dim, 0), non_blocking=True)

    def _ready(self):
        """Staged: everything queued on the current stream so far has run,
        so the buffers hold what torch wrote (the host plan reads them)."""
        if self.cuda:
            torch.cuda.current_stream(self.device).synchronize()

    def _reads_queued(self):
        """An event after the copies just queued out of the buffers: the
        next exchange must not rewrite them before it has passed."""
        if self.cuda:
            e = torch.cuda.Event()
            e.record(torch.cuda.current_stream(self.device))
            return e
        return None

    def _after_reads(self, event) -> None:
        """Before the buffers are rewritten: the copies out of them (the
        event) have run. Direct: the current stream waits for them (the
        exchange, ordered on it, comes after too); staged: the host, whose
        plan writes them."""
        if event is None:
            return
        if self.direct:
            torch.cuda.current_stream(self.device).wait_event(event)
        else:
            event.synchronize()

    def _stream(self) -> int:
        """The current stream's handle for the library: CUDA's current
        stream, or the host emulation's stream (CPU tensors)."""
        if self.cuda:
            return _lib.stream_handle(torch.cuda.current_stream(self.device).cuda_stream)
        return _FAKE_STREAM

    def _waiting_stream(self, buffers) -> int:
        """_stream, for the stream told to wait for an exchange of buffers:
        its request is freed at that wait, so the caching allocator is told
        that the stream uses them (a buffer dropped meanwhile, its cache
        entry evicted, is reused only once the stream has passed the
        exchange)."""
        if not self.cuda:
            return _FAKE_STREAM
        stream = torch.cuda.current_stream(self.device)
        for b in buffers:
            b.record_stream(stream)
        return _lib.stream_handle(stream.cuda_stream)

    def _begin(self, direction, *buffers) -> _inflight.Pending:
        """Start the plan's exchange of the buffers, after the work queued
        so far: direct, ordered on the current stream (the caller is not
        blocked; for CPU tensors the host waits at the finish as well);
        staged, once the stream has run it, on the host."""
        if not self.direct:
            self._ready()
            return _inflight.begin(self.plan, direction, *buffers)
        pending = _inflight.begin(self.plan, direction, *buffers, stream=self._stream(),
                                  waiter=lambda: self._waiting_stream(buffers), host_wait=not self.cuda)
        if self.plan is not self.agreed:
            # A plan's first exchange agrees on it with the other ranks, and
            # a CUDA plan may refuse the layout there (a slice sent to two
            # ranks), on every rank alike: the host waits for it, once per
            # plan, and a refusal makes the caller rerun the call staged.
            try:
                pending.wait_host()
            except HaloError as e:
                if e.code == _lib.ERR_INVALID_ARGUMENT:
                    raise _Refused() from e
                raise
            self.agreed = self.plan
        return pending

    @torch.no_grad()  # buffers and results are the library's writes, not autograd's
    def begin_halos(self, x: Tensor) -> _inflight.Pending:
        """Start the forward exchange of x's slabs; finish_halos hands the
        halos over once it has finished."""
        if self.fwd is not None and not self.fwd.finished:
            # Refused before the buffers it still sends from are touched.
            raise HaloError(_lib.ERR_INVALID_STATE, f"halocp: rank {self.comm.rank}: an exchange of this layout "
                            f"(shape {self.shape}, dim {self.dim}) is already in flight (wait for it first)")
        self._after_reads(self.fwd_read)
        for src, dst in self._slabs(x, self.x):
            self._copy(dst, src)
        if self.direct:  # a CUDA plan leaves the slices beyond the sequence alone
            self.lh.zero_()
            self.rh.zero_()
        try:
            self.fwd = self._begin(_inflight.FORWARD, self.x, self.lh, self.rh)
        except _Refused:
            self._allocate(direct=False)
            return self.begin_halos(x)
        return self.fwd

    @torch.no_grad()
    def finish_halos(self, left: Tensor, right: Tensor) -> None:
        """Copy the halos of the finished exchange into left and right, on
        the current stream (the one that waited for it, which reads them)."""
        self._copy(left, self.lh)
        self._copy(right, self.rh)
        self.fwd_read = self._reads_queued()

    def begin_into(self, x: Tensor, left: Tensor, right: Tensor, result):
        """begin_halos of x, and a finish() that writes the halos into left
        and right (tensors on x's device) and returns result."""
        pending = self.begin_halos(x)

        def finish():
            self.finish_halos(left, right)
            return result

        return pending, finish

    @torch.no_grad()
    def begin_add(self, grad_left: Tensor, grad_right: Tensor, grad_x: Tensor):
        """Start sending the halo gradients back; the returned finish() adds
        the neighbours' into grad_x (x's shape, on its device, holding the
        rest of x's gradient) once the exchange has finished, on the current
        stream."""
        self._after_reads(self.bwd_read)
        self._copy(self.gl, grad_left)
        self._copy(self.gr, grad_right)
        slabs = self._slabs(grad_x, self.gx)
        if self.direct:
            # +0 where nothing arrives: the reference adds zeros there. A
            # host plan (CPU tensors) adds what arrives instead of writing
            # it: -0 + g is g, bit for bit, and the edge ranks' +0 gives +0.
            self.gx.fill_(0.0 if self.cuda else -0.0)
        else:
            for src, dst in slabs:
                self._copy(dst, src)
        try:
            pending = self._begin(_inflight.BACKWARD, self.gl, self.gr, self.gx)
        except _Refused:
            self._allocate(direct=False)
            return self.begin_add(grad_left, grad_right, grad_x)

        @torch.no_grad()
        def finish():
            self._added(grad_x, slabs)

        return pending, finish

    def _added(self, grad_x: Tensor, slabs) -> None:
        if not self.direct:
            for dst, src in slabs:
                self._copy(dst, src)
            if self.cut and self.padding_mode != "zeros":
                # These modes' backward (F.pad's, which a host plan follows)
                # adds +0 to every slice the padding slots do not feed:
                # the middle, which the plan never sees, gets it here.
                self._middle(grad_x).add_(0.0)
            self.bwd_read = self._reads_queued()
            return
        # The reference's order: the right neighbour's gradient (x's last
        # `left` slices), then the left neighbour's (its first `right`).
        n, nv, d, l, r = self.n, self.a + self.b, self.dim, self.l_sent, self.r_sent
        grad_x.narrow(d, n - l, l).add_(self.gx.narrow(d, nv - l, l))
        grad_x.narrow(d, 0, r).add_(self.gx.narrow(d, 0, r))
        self.bwd_read = self._reads_queued()

    def add_grads(self, grad_left: Tensor, grad_right: Tensor, grad_x: Tensor) -> None:
        """begin_add and its finish, blocking."""
        pending, finish = self.begin_add(grad_left, grad_right, grad_x)
        pending.finish(block=True)
        finish()


def _edges(left, right, padding_mode) -> tuple:
    """(a, b): a shard longer than a + b keeps only its first a and last b
    slices in its layout's buffers (its virtual shard, all its plan sees);
    a shorter one keeps all its slices.

    The exchange reads and writes no other slice. The ranks before a shard
    take at most its first `right` slices as right halo, the ranks after it
    at most its last `left`; a halo that reaches past a shard (multi-hop)
    passes only through shards no longer than the halo, which are kept
    whole, so every halo window, and where each halo gradient goes back,
    is the same slices as with whole shards: the same bytes on the wire. A
    padding other than zeros fills the slots beyond the sequence from its
    ends, which the virtual sequence keeps at the same distance from each
    end: replicate the edge slice (a, b >= 1), reflect `left` + 1 and
    `right` + 1 slices (the edge is skipped), circular the first `right` and
    last `left` (kept anyway). The plan sees virtual lengths: the one error
    that names a length (a reflect or circular halo longer than the
    sequence) comes only when no shard was cut, so it names the real one."""
    a, b = right, left
    if padding_mode == "replicate":
        a, b = max(a, min(left, 1)), max(b, min(right, 1))
    elif padding_mode == "reflect":
        a, b = max(a, left + 1 if left else 0), max(b, right + 1 if right else 0)
    return a, b


def buffer_params(x, lh, rh, gl, gr, gx, left, right, dim, memory, padding_mode="zeros"):
    """halo_plan_params_t of a halos-only plan over these tensors' layouts,
    in memory of type memory (a _lib.MEMORY_*)."""
    return _lib.plan_params(halo_dtype(x.dtype), tuple(x.shape), dim, left, right, x.stride(), padding_mode,
                            halos_only=True, memory_type=memory, left_strides=lh.stride(), right_strides=rh.stride(),
                            grad_left_strides=gl.stride(), grad_right_strides=gr.stride(), grad_x_strides=gx.stride())


def _buffers(comm, x: Tensor, left, right, dim, padding_mode) -> _Buffers:
    """The buffers and plan of x's layout (shape, dtype, device) on the
    communicator, from its cache (made on first use)."""
    if left < 0 or right < 0:  # before any buffer is sized by them
        raise HaloError(_lib.ERR_INVALID_ARGUMENT, f"halocp: halo sizes must not be negative (left {left}, right {right})")
    key = ("buffers", x.device, x.is_cpu and _stage_cpu, x.dtype, dim, left, right, tuple(x.shape), padding_mode)
    made = []

    def make():
        made.append(True)
        return _new_buffers(comm, x, left, right, dim, padding_mode)

    lay = comm.prepared(key, make)
    if not made:
        # The plan itself may have left the communicator's cache: look it up
        # (a miss remakes it).
        lay.plan = lay._plan()
    return lay


def _new_buffers(comm, x: Tensor, left, right, dim, padding_mode) -> _Buffers:
    direct = _path(comm) == DIRECT if x.is_cuda else _stage_cpu == DIRECT
    if direct:
        try:
            return _Buffers(comm, x, left, right, dim, padding_mode, True)
        except HaloError as e:
            # A CUDA plan's creation refused the layout (a padding other
            # than zeros), from arguments every rank shares: all stage it.
            # A refusal that needs every rank's shard length comes from the
            # plan's first exchange instead (_Buffers._begin).
            if e.code != _lib.ERR_INVALID_ARGUMENT:
                raise
    return _Buffers(comm, x, left, right, dim, padding_mode, False)


# ------------------------------------------------------------------ routes
# The forms of exchange.py over a layout: torch copies the shard and the
# halos into place on the tensor's device, the layout's plan moves the slabs.


class Copy(Route):
    """Out of place: the output and x's gradient in x's memory format."""

    __slots__ = ("lay", "fmt", "out_fmt")

    def __init__(self, comm, x, left, right, dim, padding_mode):
        self.comm, self.lay, self.fmt = comm, _buffers(comm, x, left, right, dim, padding_mode), _format(x)
        self.out_fmt = _format(x, _halo_shape(x.shape, dim, x.shape[dim] + left + right))

    @torch.no_grad()
    def start(self, x: Tensor):
        lay = self.lay
        d, L, n, R = lay.dim, lay.left, lay.n, lay.right
        out = _empty(self.out_fmt)
        out.narrow(d, L, n).copy_(x)
        return lay.begin_into(x, out.narrow(d, 0, L), out.narrow(d, L + n, R), out)

    def backward(self, g: Tensor) -> Tensor:
        lay = self.lay
        d, L, n, R = lay.dim, lay.left, lay.n, lay.right
        with torch.no_grad():
            grad_x = _empty(self.fmt).copy_(g.narrow(d, L, n))
        lay.add_grads(g.narrow(d, 0, L), g.narrow(d, L + n, R), grad_x)
        return grad_x


class InPlace(Route):
    """In place: the shard is padded's interior; the gradient has padded's
    memory format and none in the halo slots, which the forward overwrote."""

    __slots__ = ("lay", "fmt")

    def __init__(self, comm, padded, left, right, dim, padding_mode):
        x = padded.narrow(dim, left, padded.shape[dim] - left - right)
        self.comm, self.lay, self.fmt = comm, _buffers(comm, x, left, right, dim, padding_mode), _format(padded)

    def start(self, padded: Tensor):
        lay = self.lay
        d, L, n, R = lay.dim, lay.left, lay.n, lay.right
        return lay.begin_into(padded.narrow(d, L, n), padded.narrow(d, 0, L), padded.narrow(d, L + n, R), padded)

    def backward(self, g: Tensor) -> Tensor:
        lay = self.lay
        d, L, n, R = lay.dim, lay.left, lay.n, lay.right
        with torch.no_grad():
            grad = _empty(self.fmt).copy_(g)
        lay.add_grads(g.narrow(d, 0, L), g.narrow(d, L + n, R), grad.narrow(d, L, n))
        grad.narrow(d, 0, L).zero_()
        grad.narrow(d, L + n, R).zero_()
        return grad


class Halos(HalosRoute):
    """Halos only, in x's memory format. grad_strides (a host plan's
    choice) has no use here: the gradients are copied into the layout's
    buffers whatever their strides."""

    __slots__ = ("lay", "fmt", "left_fmt", "right_fmt")

    def __init__(self, comm, x, left, right, dim, padding_mode, grad_strides=None):
        self.comm, self.lay, self.fmt = comm, _buffers(comm, x, left, right, dim, padding_mode), _format(x)
        self.left_fmt = _format(x, _halo_shape(x.shape, dim, left))
        self.right_fmt = _format(x, _halo_shape(x.shape, dim, right))

    def start(self, x: Tensor):
        lh, rh = _empty(self.left_fmt), _empty(self.right_fmt)
        return self.lay.begin_into(x, lh, rh, (lh, rh))

    def start_add(self, grad_left, grad_right, grad_x):
        return self.lay.begin_add(grad_left, grad_right, grad_x)

    def zeros_like_x(self):
        return _empty(self.fmt).zero_()
