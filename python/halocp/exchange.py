"""The differentiable halo exchange: out of place (the reference's drop-in),
in place (into a padded buffer the caller keeps) and halos only (the halos in
tensors of their own); each blocking, or started and finished later.

One stack for every device: a public form checks its arguments, finds the
Route of its tensor's layout (prepared once per communicator, on the device
path the tensor and the communicator call for: _host.py's for CPU tensors,
_cuda.py's staged or direct one for CUDA tensors), runs or starts it, and
records one of the three autograd Functions below, whose backward is the
Route's. The Functions only hand over a result computed outside them, so
the blocking and the started forms share them: a started exchange records
its node at the wait, when the result exists.
"""

from __future__ import annotations

import operator

import torch
from torch import Tensor

from . import _cuda, _host, _inflight, _lib
from ._comm import communicator, group_token, token_group
from ._shapes import Like, dim_order, empty_in_order, is_compiling, padded_shape, resized as _halo_shape
from ._inflight import Exchange
from ._route import Route
from ._lib import HaloError


def _check(x, left, right, dim, what: str):
    """Local checks the library cannot make (it never sees a torch tensor).
    Every rank that gets the same bad call raises the same error, before any
    communication, so no rank is left waiting."""
    if not isinstance(x, Tensor):
        raise HaloError(_lib.ERR_INVALID_ARGUMENT, f"halocp: {what} must be a torch.Tensor, not {type(x).__name__}")
    if x.layout != torch.strided:
        raise HaloError(_lib.ERR_INVALID_ARGUMENT, f"halocp: {what} must be a strided (dense) tensor, not {x.layout}")
    _check_device(x, what)
    try:
        left, right, dim = operator.index(left), operator.index(right), operator.index(dim)
    except TypeError as e:
        raise HaloError(_lib.ERR_INVALID_ARGUMENT, f"halocp: left_size, right_size and dim must be integers ({e})") from None
    nd = x.dim()
    if not -nd <= dim < nd:
        raise HaloError(_lib.ERR_INVALID_ARGUMENT, f"halocp: dim {dim} is out of range for a {nd}-d tensor")
    return left, right, dim % nd


def _check_device(x, what: str) -> None:
    if not (x.is_cpu or x.is_cuda):  # (cheaper than x.device, a new object per call)
        raise HaloError(_lib.ERR_INVALID_ARGUMENT, f"halocp: {what} is on {x.device}: halocp exchanges CPU and CUDA tensors")


def _check_padded(padded: Tensor, left, right, dim, record: bool) -> None:
    if padded.shape[dim] - left - right < 0 and left >= 0 and right >= 0:  # negative sizes are the library's to name
        raise HaloError(_lib.ERR_INVALID_ARGUMENT, f"halocp: padded has {padded.shape[dim]} slices along dim {dim}, "
                        f"fewer than its halos ({left} + {right})")
    if record and padded.is_leaf:
        raise HaloError(_lib.ERR_INVALID_ARGUMENT,
                        "halocp: padded is a leaf that requires grad: it cannot be filled in place")


_padding = _lib.padding_code
# torch.compile's hooks (is_compiling: _shapes's). The token is evaluated
# while torch.compile traces, its result a constant of the graph.
_token = getattr(getattr(torch, "compiler", None), "assume_constant_result", lambda f: f)(group_token)


# ------------------------------------------------------------------ routes

COPY, IN_PLACE, HALOS = "copy", "in place", "halos"
# Each form's Route on the host path and on the CUDA paths (staged or direct).
_ROUTES = {COPY: (_host.Copy, _cuda.Copy), IN_PLACE: (_host.InPlace, _cuda.InPlace), HALOS: (_host.Halos, _cuda.Halos)}


def route(form: str, t, left, right, dim, group, padding_mode, grad_strides=None) -> Route:
    """The Route of form for t's layout (t: x, or the padded buffer of the
    in-place form; anything with t's shape, stride(), dtype and device) on
    group's communicator, once any exchange whose handle was dropped has
    been finished.

    Prepared on a miss (its plan looked up, made on a miss there) and kept
    in the communicator's one cache (Communicator.prepared), local to this
    rank (the exchange itself agrees with the other ranks). A hit is a dict
    lookup and the mark of a used entry."""
    comm = communicator(group)
    staged = _cuda.wanted(t)
    # Which device: x.device (a new object per call) only for the CUDA
    # paths (and which of them the CPU test switch asks for); a tensor on
    # another device misses, and is refused below.
    where = (t.device, _cuda.stage_cpu_mode()) if staged else t.is_cpu
    key = ("route", form, t.shape, t.stride(), t.dtype, where, dim, left, right, padding_mode, grad_strides)
    entry = comm.cache.get(key)
    if entry is None:
        return _new_route(comm, key, form, staged, t, left, right, dim, padding_mode, grad_strides)
    entry[1] = True  # a hit, marked as Communicator.prepared's policy does (inline: once per call)
    if comm.dropped:
        _inflight.settle(comm)
    return entry[0]


def _new_route(comm, key, form, staged, t, left, right, dim, padding_mode, grad_strides) -> Route:
    """route's miss, apart: its lambda would make route's variables closure
    cells, which cost its hit path 0.2 us."""
    _check_device(t, "x" if form != IN_PLACE else "padded")  # a layer's input comes here unchecked
    _inflight.settle(comm)
    extra = () if grad_strides is None else (grad_strides,)
    return comm.prepared(key, lambda: _ROUTES[form][staged](comm, t, left, right, dim, padding_mode, *extra))


# ---------------------------------------------------------------- autograd
# One Function per form. Each forward hands over the result the Route
# computed (done, outside the tensor arguments so that it becomes the node's
# output itself, not a view of an input) and keeps the Route for the
# backward.


class _Padded(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, route, done):
        ctx.route = route
        return done[0]

    @staticmethod
    def backward(ctx, grad_out):
        return ctx.route.backward(grad_out), None, None


class _InPlace(torch.autograd.Function):
    @staticmethod
    def forward(ctx, padded, route, done):
        ctx.mark_dirty(padded)
        ctx.route = route
        return padded

    @staticmethod
    def backward(ctx, grad_out):
        return ctx.route.backward(grad_out), None, None


class _Halos(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, route, done):
        ctx.route = route
        return done

    @staticmethod
    def backward(ctx, grad_left, grad_right):
        return ctx.route.backward(grad_left, grad_right), None, None


def _recording(t: Tensor) -> bool:
    return t.requires_grad and torch.is_grad_enabled()


def _attach(fn, t: Tensor, route, result, record: bool):
    """result, with fn's node recorded when record (grad mode and
    requires_grad where the caller asked for the exchange)."""
    if not record:
        return result
    with torch.enable_grad():  # a started exchange's wait may run under no_grad
        return fn.apply(t, route, result if fn is _Halos else (result,))


def _handle(fn, t: Tensor, route, record: bool) -> Exchange:
    """The started form of a Route: the exchange runs between start and
    wait, and the node is recorded by the wait."""
    pending, finish = route.start(t)
    if not record:
        return Exchange(pending, finish)
    return Exchange(pending, lambda: _attach(fn, t, route, finish(), True))


def _finished(result) -> Exchange:
    return Exchange(None, lambda: result)


def _empty_halos(x: Tensor, left, right, dim):
    order = dim_order(x)
    return (empty_in_order(_halo_shape(x.shape, dim, left), order, x.dtype, x.device),
            empty_in_order(_halo_shape(x.shape, dim, right), order, x.dtype, x.device))


# ------------------------------------------------------------ out of place


def cp_halo_exchange(x: Tensor, left_size: int, right_size: int, dim: int, group=None,
                     padding_mode: str = "zeros") -> Tensor:
    """Return ``cat(left halo, x, right halo)`` along ``dim``, differentiably.

    The drop-in for the reference ``cp_halo_exchange``: rank r of ``group``
    holds shard ``x`` of a sequence concatenated along ``dim`` in rank order;
    the left halo is the ``left_size`` slices before it, the right halo the
    ``right_size`` slices after it, zeros beyond the ends of the sequence.
    ``padding_mode`` fills the slots beyond the ends as torch.nn.Conv3d's
    does: ``"zeros"`` (the reference), ``"replicate"``, ``"reflect"`` or
    ``"circular"``; then the result is ``F.pad`` of the gathered sequence,
    sliced to this rank, and the backward adds each slot's gradient to the
    slice it came from, bit-identical to ``F.pad``'s backward (see
    docs/python.md for the order). Halos may be longer than a shard and shards may differ in length along
    ``dim`` (every other size must agree). The backward pass returns the
    gradient of ``x``: its own slices' gradient plus the halo gradients of
    the ranks that used them, added in the reference's order, so results
    are bit-identical to it.

    Collective: every rank of the group calls it, in the same order as its
    other exchanges. ``x`` is a CPU or CUDA tensor of float32, float64, float16 or
    bfloat16, with any strides. The output, and the gradient of ``x``, keep
    x's memory format (``channels_last``, ``channels_last_3d`` or any dense
    permutation of dims; contiguous for a sliced or expanded view), written
    in place by the library with no conversion copy.
    ``left_size == right_size == 0`` returns ``x`` itself. Failures raise
    :class:`halocp.HaloError`.
    """
    left, right, dim = _check(x, left_size, right_size, dim, "x")
    _padding(padding_mode)
    if left == 0 and right == 0:
        return x
    if is_compiling():
        return torch.ops.halocp.exchange(x, left, right, dim, _token(group), padding_mode)
    if x.is_neg():  # a lazily negated view: its memory holds -x
        x = x.resolve_neg()
    r = route(COPY, x, left, right, dim, group, padding_mode)
    if x.requires_grad and torch.is_grad_enabled():
        return _Padded.apply(x, r, (r.run(x),))
    return r.run(x)  # no graph to record: skip autograd's overhead


def cp_halo_exchange_start(x: Tensor, left_size: int, right_size: int, dim: int, group=None,
                           padding_mode: str = "zeros") -> Exchange:
    """Start :func:`cp_halo_exchange`; ``.wait()`` on the returned handle
    gives its result.

    The messages are posted and the shard copied into the padded output
    before this returns; the halos arrive while the caller computes, in the
    library calls ``handle.test()`` and ``handle.wait()``. (CUDA tensors on
    the direct path: the exchange is ordered on the current stream, after
    the work queued there, and ``wait()`` makes the stream current at the
    wait wait for it, without blocking the caller; docs/python.md.) Until the wait,
    the exchange owns ``x`` (do not modify it) and the output. The result is
    differentiable exactly as :func:`cp_halo_exchange`'s when ``x`` requires
    grad and grad mode is on at start (the graph node is recorded by the
    wait). One exchange per layout and group may be in flight: starting a
    second one of the same layout before waiting for the first raises
    ``HaloError(ERR_INVALID_STATE)``, and so does a blocking exchange of
    that layout meanwhile.
    """
    left, right, dim = _check(x, left_size, right_size, dim, "x")
    _padding(padding_mode)
    if left == 0 and right == 0:
        return _finished(x)
    if x.is_neg():
        x = x.resolve_neg()
    return _handle(_Padded, x, route(COPY, x, left, right, dim, group, padding_mode), _recording(x))


# ---------------------------------------------------------------- in place


def halo_exchange_(padded: Tensor, left_size: int, right_size: int, dim: int, group=None,
                   padding_mode: str = "zeros") -> Tensor:
    """Fill the halos of a padded buffer in place; return it.

    ``padded`` holds ``left_size`` halo slices, this rank's shard, then
    ``right_size`` halo slices along ``dim``; the caller writes the shard
    into the interior (``padded.narrow(dim, left_size, n)``) and this fills
    the halos exactly as :func:`cp_halo_exchange` would, without copying the
    shard. Differentiable: the gradient of the interior gets the halo
    gradients added, the halo slots get none (they were overwritten).
    ``padded`` may have any non-overlapping strides; its gradient has
    padded's memory format. ``padding_mode`` is :func:`cp_halo_exchange`'s.
    """
    left, right, dim = _check(padded, left_size, right_size, dim, "padded")
    _padding(padding_mode)
    if left == 0 and right == 0:
        return padded
    record = _recording(padded)
    _check_padded(padded, left, right, dim, record)
    if is_compiling():
        # The out-of-place op on the interior, copied back (see the ops below).
        n = padded.shape[dim] - left - right
        out = torch.ops.halocp.exchange(padded.narrow(dim, left, n), left, right, dim, _token(group), padding_mode)
        return padded.copy_(out)
    r = route(IN_PLACE, padded, left, right, dim, group, padding_mode)
    r.run(padded)
    # Always through the Function: mark_dirty bumps padded's version, so a
    # graph that saved padded before the write sees that it changed.
    if record:
        return _InPlace.apply(padded, r, (padded,))
    with torch.no_grad():
        return _InPlace.apply(padded, r, (padded,))


def halo_exchange_start_(padded: Tensor, left_size: int, right_size: int, dim: int, group=None,
                         padding_mode: str = "zeros") -> Exchange:
    """Start :func:`halo_exchange_`; ``.wait()`` returns ``padded`` with its
    halos filled. Until the wait the exchange owns ``padded``: neither read
    its halos nor write its interior. Differentiable as :func:`halo_exchange_`
    when ``padded`` requires grad and grad mode is on at start."""
    left, right, dim = _check(padded, left_size, right_size, dim, "padded")
    _padding(padding_mode)
    if left == 0 and right == 0:
        return _finished(padded)
    record = _recording(padded)
    _check_padded(padded, left, right, dim, record)
    return _handle(_InPlace, padded, route(IN_PLACE, padded, left, right, dim, group, padding_mode), record)


# -------------------------------------------------------------- halos only


def halos(x: Tensor, left_size: int, right_size: int, dim: int, group=None,
          padding_mode: str = "zeros") -> tuple[Tensor, Tensor]:
    """Return ``(left_halo, right_halo)``: the ``left_size`` slices before
    this rank's shard ``x`` in the global sequence and the ``right_size``
    slices after it (zeros beyond the ends), each a new tensor of x's shape
    with that many slices along ``dim``, in x's memory format.

    The halos of :func:`cp_halo_exchange` without the padded tensor (no copy
    of the shard), bit for bit. Differentiable: the backward sends the halo
    gradients to the ranks the halos came from and returns x's gradient,
    zeros but for the slices the neighbours used, which get their halo
    gradients added as :func:`cp_halo_exchange`'s backward adds them (a
    tensor of x's size, because autograd asks for one). Collective, with the
    arguments (``padding_mode`` included) and errors of :func:`cp_halo_exchange`.
    """
    left, right, dim = _check(x, left_size, right_size, dim, "x")
    _padding(padding_mode)
    if is_compiling():
        return torch.ops.halocp.halos(x, left, right, dim, _token(group), padding_mode)
    if left == 0 and right == 0:
        return _empty_halos(x, 0, 0, dim)
    if x.is_neg():
        x = x.resolve_neg()
    r = route(HALOS, x, left, right, dim, group, padding_mode)
    return _attach(_Halos, x, r, r.run(x), _recording(x))


def halos_start(x: Tensor, left_size: int, right_size: int, dim: int, group=None,
                padding_mode: str = "zeros") -> Exchange:
    """Start :func:`halos`; ``.wait()`` returns ``(left_halo, right_halo)``.
    Until the wait the exchange owns ``x`` (do not modify it). Differentiable
    as :func:`halos` when ``x`` requires grad and grad mode is on at start."""
    left, right, dim = _check(x, left_size, right_size, dim, "x")
    _padding(padding_mode)
    if left == 0 and right == 0:
        return _finished(_empty_halos(x, 0, 0, dim))
    if x.is_neg():
        x = x.resolve_neg()
    return _handle(_Halos, x, route(HALOS, x, left, right, dim, group, padding_mode), _recording(x))


# ------------------------------------------------------ for torch.compile
# Dynamo cannot trace into ctypes, so a compiled model sees each exchange as
# one opaque torch.library op with a fake (meta) implementation that gives
# the result's shape and strides, and an autograd formula that calls the
# backward op. The public functions above route here while torch.compile
# traces them (is_compiling()); eager calls keep the autograd Functions,
# which cost less per call (bench/RESULTS.md).
#
# The in-place form is not an op of its own: under compile halo_exchange_ is
# the out-of-place op on the interior copied back into the buffer (autograd
# of a mutating custom op is not supported by torch.library), which gives
# the same values and gradients at the cost of one copy of the buffer.
#
# A process group cannot be an op argument: ops take a token (the group's
# name, "" for the default group) that _comm.group_token hands out and
# _comm.token_group resolves.


@torch.library.custom_op("halocp::exchange", mutates_args=())
def _exchange_op(x: Tensor, left: int, right: int, dim: int, group: str, padding_mode: str) -> Tensor:
    with torch.no_grad():
        out = cp_halo_exchange(x, left, right, dim, token_group(group), padding_mode)
    return out if out is not x else x.clone()  # an op's output never aliases its input


@_exchange_op.register_fake
def _(x, left, right, dim, group, padding_mode):
    return empty_in_order(padded_shape(x.shape, dim, left + right), dim_order(x), x.dtype, x.device)


@torch.library.custom_op("halocp::exchange_backward", mutates_args=())
def _exchange_backward_op(grad_out: Tensor, x_shape: list[int], x_strides: list[int], left: int, right: int,
                          dim: int, group: str, padding_mode: str) -> Tensor:
    x = Like(x_shape, x_strides, grad_out)
    return route(COPY, x, left, right, dim, token_group(group), padding_mode).backward(grad_out)


@_exchange_backward_op.register_fake
def _(grad_out, x_shape, x_strides, left, right, dim, group, padding_mode):
    return empty_in_order(x_shape, dim_order(Like(x_shape, x_strides, grad_out)), grad_out.dtype, grad_out.device)


def _save_x(ctx, inputs, output):
    x = inputs[0]
    ctx.x = (list(x.shape), list(x.stride()))
    ctx.args = inputs[1:]


def _exchange_grad(ctx, grad_out):
    return (torch.ops.halocp.exchange_backward(grad_out, *ctx.x, *ctx.args),) + (None,) * 5


_exchange_op.register_autograd(_exchange_grad, setup_context=_save_x)


@torch.library.custom_op("halocp::halos", mutates_args=())
def _halos_op(x: Tensor, left: int, right: int, dim: int, group: str, padding_mode: str) -> tuple[Tensor, Tensor]:
    with torch.no_grad():
        return halos(x, left, right, dim, token_group(group), padding_mode)


@_halos_op.register_fake
def _(x, left, right, dim, group, padding_mode):
    order = dim_order(x)
    return (empty_in_order(_halo_shape(x.shape, dim, left), order, x.dtype, x.device),
            empty_in_order(_halo_shape(x.shape, dim, right), order, x.dtype, x.device))


@torch.library.custom_op("halocp::halos_backward", mutates_args=())
def _halos_backward_op(grad_left: Tensor, grad_right: Tensor, x_shape: list[int], x_strides: list[int], left: int,
                       right: int, dim: int, group: str, padding_mode: str) -> Tensor:
    x = Like(x_shape, x_strides, grad_left)
    return route(HALOS, x, left, right, dim, token_group(group), padding_mode).backward(grad_left, grad_right)


@_halos_backward_op.register_fake
def _(grad_left, grad_right, x_shape, x_strides, left, right, dim, group, padding_mode):
    return empty_in_order(x_shape, dim_order(Like(x_shape, x_strides, grad_left)), grad_left.dtype, grad_left.device)


def _halos_grad(ctx, grad_left, grad_right):
    return (torch.ops.halocp.halos_backward(grad_left, grad_right, *ctx.x, *ctx.args),) + (None,) * 5


_halos_op.register_autograd(_halos_grad, setup_context=_save_x)


# halo_sum.cp_halo_sum under compile is the exchange's backward op; its own
# backward is the exchange's forward (registered here, with the op).


def _save_sum(ctx, inputs, output):
    ctx.args = inputs[3:]


def _sum_grad(ctx, grad):
    return (torch.ops.halocp.exchange(grad, *ctx.args),) + (None,) * 7


_exchange_backward_op.register_autograd(_sum_grad, setup_context=_save_sum)
