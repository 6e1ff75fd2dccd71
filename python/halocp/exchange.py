"""The differentiable halo exchange: out of place (the reference's drop-in),
in place (into a padded buffer the caller keeps) and halos only (the halos in
tensors of their own); each blocking, or started and finished later."""

from __future__ import annotations

import operator

import torch
from torch import Tensor

from . import _cuda, _inflight, _lib
from ._comm import communicator, group_token, halo_dtype
from ._layout import dim_order, empty_in_order, in_strides, padded_shape as _padded_shape, resized as _halo_shape
from ._layout import strides_in_order
from ._inflight import Exchange
from ._lib import HaloError


def _check(x, left, right, dim, what: str):
    """Local checks the library cannot make (it never sees a torch tensor).
    Every rank that gets the same bad call raises the same error, before any
    communication, so no rank is left waiting."""
    if not isinstance(x, Tensor):
        raise HaloError(_lib.ERR_INVALID_ARGUMENT, f"halocp: {what} must be a torch.Tensor, not {type(x).__name__}")
    if x.layout != torch.strided:
        raise HaloError(_lib.ERR_INVALID_ARGUMENT, f"halocp: {what} must be a strided (dense) tensor, not {x.layout}")
    if x.device.type not in ("cpu", "cuda"):
        raise HaloError(_lib.ERR_INVALID_ARGUMENT, f"halocp: {what} is on {x.device}: halocp exchanges CPU and CUDA tensors")
    try:
        left, right, dim = operator.index(left), operator.index(right), operator.index(dim)
    except TypeError as e:
        raise HaloError(_lib.ERR_INVALID_ARGUMENT, f"halocp: left_size, right_size and dim must be integers ({e})") from None
    nd = x.dim()
    if not -nd <= dim < nd:
        raise HaloError(_lib.ERR_INVALID_ARGUMENT, f"halocp: dim {dim} is out of range for a {nd}-d tensor")
    return left, right, dim % nd


_padding = _lib.padding_code
# torch.compile's hooks (PyTorch >= 2.4; an older torch compiles nothing and
# keeps the autograd Functions). The token is evaluated while torch.compile
# traces, its result a constant of the graph.
_compiler = getattr(torch, "compiler", None)
is_compiling = getattr(_compiler, "is_compiling", lambda: False)
_token = getattr(_compiler, "assume_constant_result", lambda f: f)(group_token)


def _params(dtype, shape, dim, left, right, x_strides, out_strides, grad_strides, padding_mode="zeros"):
    """halo_plan_params_t for shard shape; grad_strides: those of grad_out
    and grad_x, or None."""
    go, gx = grad_strides if grad_strides is not None else (None, None)
    return _lib.plan_params(halo_dtype(dtype), shape, dim, left, right, x_strides, padding_mode,
                            out_strides=out_strides, grad_out_strides=go, grad_x_strides=gx)


def _plan_out_of_place(x: Tensor, left, right, dim, group, padding_mode):
    """The plan of x's layout; out, grad_out and grad_x are dense in x's dim
    order."""
    shape, strides = tuple(x.shape), x.stride()
    order = dim_order(x)

    def params():
        out = strides_in_order(_padded_shape(shape, dim, left + right), order)
        return _params(x.dtype, shape, dim, left, right, strides, out, (out, strides_in_order(shape, order)),
                       padding_mode)

    return _lookup(group, ("copy", x.dtype, dim, left, right, shape, strides, padding_mode), params)


def _lookup(group, key, params):
    """The group's cached plan for key (made collectively on a miss), once
    any exchange whose handle was dropped has been finished."""
    comm = communicator(group)
    _inflight.settle(comm)
    return comm.plan(key, params)


class _Copy:
    """An out-of-place exchange of one layout, prepared once: its plan and
    the shapes and strides of its output and of x's gradient (the step's
    per-call work is then a dict lookup, two allocations and a C call)."""

    __slots__ = ("plan", "out_shape", "out_strides", "x_shape", "x_strides", "dtype")

    def __init__(self, x, left, right, dim, group, padding_mode):
        order = dim_order(x)
        self.plan = _plan_out_of_place(x, left, right, dim, group, padding_mode)
        self.out_shape = _padded_shape(x.shape, dim, left + right)
        self.out_strides = strides_in_order(self.out_shape, order)
        self.x_shape, self.x_strides, self.dtype = tuple(x.shape), strides_in_order(x.shape, order), x.dtype

    @staticmethod
    def of(x, left, right, dim, group, padding_mode) -> "_Copy":
        """x's prepared exchange on group's communicator. Cached per
        communicator, beside (not instead of) its plan cache; like it, local
        to this rank (the exchange itself agrees with the other ranks)."""
        comm = communicator(group)
        key = (x.shape, x.stride(), x.dtype, dim, left, right, padding_mode)
        call = comm.calls.get(key)
        if call is None:
            call = _Copy(x, left, right, dim, group, padding_mode)
            if len(comm.calls) >= _PREPARED_MAX:
                comm.calls.clear()
            comm.calls[key] = call
        elif comm.dropped:
            _inflight.settle(comm)
        return call

    def forward(self, x: Tensor) -> Tensor:
        out = torch.empty_strided(self.out_shape, self.out_strides, dtype=self.dtype)
        self.plan.forward(x.data_ptr(), out.data_ptr())
        return out

    def backward(self, grad_out: Tensor) -> Tensor:
        grad_out = in_strides(grad_out, self.out_strides)  # the usual gradient already is
        grad_x = torch.empty_strided(self.x_shape, self.x_strides, dtype=self.dtype)
        _inflight.settle(self.plan.comm)
        self.plan.backward(grad_out.data_ptr(), grad_x.data_ptr())
        return grad_x


# Prepared exchanges a communicator keeps (then it starts afresh).
_PREPARED_MAX = 64


def _exchange(x, left, right, dim, group, padding_mode):
    if x.is_neg():  # a lazily negated view: its memory holds -x
        x = x.resolve_neg()
    call = _Copy.of(x, left, right, dim, group, padding_mode)
    return call.forward(x), call


class _HaloExchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, left, right, dim, group, padding_mode):
        out, ctx.call = _exchange(x, left, right, dim, group, padding_mode)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        return ctx.call.backward(grad_out), None, None, None, None, None


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
    other exchanges. ``x`` is a CPU tensor of float32, float64, float16 or
    bfloat16, with any strides. The output, and the gradient of ``x``, keep
    x's memory format (``channels_last``, ``channels_last_3d`` or any dense
    permutation of dims; contiguous for a sliced or expanded view), written
    in place by the library with no conversion copy.
    ``left_size == right_size == 0`` returns ``x`` itself. Failures raise
    :class:`halocp.HaloError`.
    """
    left, right, dim = _check(x, left_size, right_size, dim, "x")
    _padding(padding_mode)
    if is_compiling():
        if left == 0 and right == 0:
            return x
        return torch.ops.halocp.exchange(x, left, right, dim, _token(group), padding_mode)
    if _cuda.wanted(x):
        return _cuda.cp_halo_exchange(x, left, right, dim, group, padding_mode)
    if left == 0 and right == 0:
        return x
    if x.requires_grad and torch.is_grad_enabled():
        return _HaloExchange.apply(x, left, right, dim, group, padding_mode)
    return _exchange(x, left, right, dim, group, padding_mode)[0]  # no graph to record: skip autograd's overhead


def _plan_in_place(padded: Tensor, left, right, dim, group, padding_mode):
    pshape, pstrides = tuple(padded.shape), padded.stride()

    def params():
        n = pshape[dim] - left - right
        if n < 0 and left >= 0 and right >= 0:  # negative sizes are the library's to name
            raise HaloError(
                _lib.ERR_INVALID_ARGUMENT,
                f"halocp: padded has {pshape[dim]} slices along dim {dim}, fewer than its halos ({left} + {right})",
            )
        shape = _padded_shape(pshape, dim, max(n, 0) - pshape[dim])
        # x is padded's interior, with padded's strides: the library sees the
        # alias and leaves the shard where it is.
        return _params(padded.dtype, shape, dim, left, right, pstrides, pstrides, (grad, grad), padding_mode)

    grad = strides_in_order(pshape, dim_order(padded))  # grad_out's and grad_x's
    return _lookup(group, ("inplace", padded.dtype, dim, left, right, pshape, pstrides, padding_mode), params)


class _HaloExchangeInPlace(torch.autograd.Function):
    @staticmethod
    def forward(ctx, padded, left, right, dim, group, padding_mode):
        plan = _plan_in_place(padded, left, right, dim, group, padding_mode)
        interior = padded.data_ptr() + left * padded.stride(dim) * padded.element_size()
        plan.forward(interior, padded.data_ptr())
        ctx.mark_dirty(padded)
        ctx.plan, ctx.left, ctx.right, ctx.dim = plan, left, right, dim
        ctx.grad_strides = strides_in_order(padded.shape, dim_order(padded))
        return padded

    @staticmethod
    def backward(ctx, grad_out):
        left, right, dim = ctx.left, ctx.right, ctx.dim
        strides = ctx.grad_strides
        grad_out = in_strides(grad_out, strides)
        grad = torch.empty_strided(grad_out.shape, strides, dtype=grad_out.dtype)
        n = grad.shape[dim] - left - right
        interior = grad.data_ptr() + left * grad.stride(dim) * grad.element_size()
        _inflight.settle(ctx.plan.comm)
        ctx.plan.backward(grad_out.data_ptr(), interior)
        # The halo slots were overwritten in the forward pass: no gradient.
        grad.narrow(dim, 0, left).zero_()
        grad.narrow(dim, left + n, right).zero_()
        return grad, None, None, None, None, None


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
    if is_compiling():
        # The out-of-place op on the interior, copied back (see _ops.py).
        if left == 0 and right == 0:
            return padded
        n = padded.shape[dim] - left - right
        if n < 0:
            raise HaloError(_lib.ERR_INVALID_ARGUMENT, f"halocp: padded has {padded.shape[dim]} slices along dim "
                            f"{dim}, fewer than its halos ({left} + {right})")
        out = torch.ops.halocp.exchange(padded.narrow(dim, left, n), left, right, dim, _token(group), padding_mode)
        return padded.copy_(out)
    if _cuda.wanted(padded):
        return _cuda.halo_exchange_(padded, left, right, dim, group, padding_mode)
    if left == 0 and right == 0:
        return padded
    return _HaloExchangeInPlace.apply(padded, left, right, dim, group, padding_mode)


# ------------------------------------------------------- asynchronous forms
# The library runs the forward exchange between start and wait; the autograd
# node is recorded at wait, when the result exists, by a Function whose
# forward only hands the finished result over and whose backward is the
# blocking form's. Whether to record is decided at start, where the caller
# asked for the exchange (grad mode and requires_grad there).


def _recording(t: Tensor) -> bool:
    return t.requires_grad and torch.is_grad_enabled()


class _HaloExchangeDone(_HaloExchange):
    @staticmethod
    def forward(ctx, x, done):
        # done = (out, call): out travels outside the tensor arguments so that
        # it becomes the node's output itself, not a view of an input.
        out, ctx.call = done
        return out

    @staticmethod
    def backward(ctx, grad_out):
        return ctx.call.backward(grad_out), None


class _HaloExchangeInPlaceDone(_HaloExchangeInPlace):
    @staticmethod
    def forward(ctx, padded, plan, left, right, dim, padding_mode):
        ctx.mark_dirty(padded)
        ctx.plan, ctx.left, ctx.right, ctx.dim = plan, left, right, dim
        ctx.grad_strides = strides_in_order(padded.shape, dim_order(padded))
        return padded


def _finished(result) -> Exchange:
    return Exchange(None, lambda: result)


def cp_halo_exchange_start(x: Tensor, left_size: int, right_size: int, dim: int, group=None,
                           padding_mode: str = "zeros") -> Exchange:
    """Start :func:`cp_halo_exchange`; ``.wait()`` on the returned handle
    gives its result.

    The messages are posted and the shard copied into the padded output
    before this returns; the halos arrive while the caller computes, in the
    library calls ``handle.test()`` and ``handle.wait()``. Until the wait,
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
    if _cuda.wanted(x):
        return _cuda.cp_halo_exchange_start(x, left, right, dim, group, padding_mode)
    if left == 0 and right == 0:
        return _finished(x)
    if x.is_neg():
        x = x.resolve_neg()
    call = _Copy.of(x, left, right, dim, group, padding_mode)
    out = torch.empty_strided(call.out_shape, call.out_strides, dtype=x.dtype)
    pending = _inflight.start(call.plan, _inflight.FORWARD, x, out)
    if not _recording(x):
        return Exchange(pending, lambda: out)

    def result():
        with torch.enable_grad():
            return _HaloExchangeDone.apply(x, (out, call))

    return Exchange(pending, result)


def halo_exchange_start_(padded: Tensor, left_size: int, right_size: int, dim: int, group=None,
                         padding_mode: str = "zeros") -> Exchange:
    """Start :func:`halo_exchange_`; ``.wait()`` returns ``padded`` with its
    halos filled. Until the wait the exchange owns ``padded``: neither read
    its halos nor write its interior. Differentiable as :func:`halo_exchange_`
    when ``padded`` requires grad and grad mode is on at start."""
    left, right, dim = _check(padded, left_size, right_size, dim, "padded")
    _padding(padding_mode)
    if _cuda.wanted(padded):
        return _cuda.halo_exchange_start_(padded, left, right, dim, group, padding_mode)
    if left == 0 and right == 0:
        return _finished(padded)
    record = _recording(padded)
    if record and padded.is_leaf:
        raise HaloError(_lib.ERR_INVALID_ARGUMENT,
                        "halocp: padded is a leaf that requires grad: it cannot be filled in place")
    plan = _plan_in_place(padded, left, right, dim, group, padding_mode)
    interior = padded.data_ptr() + left * padded.stride(dim) * padded.element_size()
    pending = _inflight.start(plan, _inflight.FORWARD, _Address(interior), padded)
    if not record:
        return Exchange(pending, lambda: padded)

    def result():
        with torch.enable_grad():
            return _HaloExchangeInPlaceDone.apply(padded, plan, left, right, dim, padding_mode)

    return Exchange(pending, result)


class _Address:
    """A raw address standing in for a tensor argument of a plan call (the
    interior of a padded buffer, which that buffer keeps alive)."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = ptr

    def data_ptr(self) -> int:
        return self.ptr


# --------------------------------------------------------------- halos only


def plan_halos(x: Tensor, left, right, dim, group, grad_strides=None, padding_mode="zeros"):
    """The halos-only plan of x's layout (made collectively on a miss).

    The halos are dense tensors of their own in x's dim order; ``grad_strides``
    are the strides of (grad_left, grad_right, grad_x) in the backward, by
    default those of dense tensors of the halos' and x's shapes in that order.
    """
    shape, strides, order = tuple(x.shape), x.stride(), dim_order(x)
    lshape, rshape = _halo_shape(shape, dim, left), _halo_shape(shape, dim, right)
    halo_strides = (strides_in_order(lshape, order), strides_in_order(rshape, order))
    if grad_strides is None:
        grad_strides = halo_strides + (strides_in_order(shape, order),)

    def params():
        gl, gr, gx = grad_strides
        return _lib.plan_params(halo_dtype(x.dtype), shape, dim, left, right, strides, padding_mode, halos_only=True,
                                left_strides=halo_strides[0], right_strides=halo_strides[1],
                                grad_left_strides=gl, grad_right_strides=gr, grad_x_strides=gx)

    return _lookup(group, ("halos", x.dtype, dim, left, right, shape, strides, tuple(grad_strides), padding_mode), params)


def _empty_halos(x: Tensor, left, right, dim):
    order = dim_order(x)
    return (empty_in_order(_halo_shape(x.shape, dim, left), order, x.dtype),
            empty_in_order(_halo_shape(x.shape, dim, right), order, x.dtype))


class _Halos(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, left, right, dim, group, padding_mode):
        plan = plan_halos(x, left, right, dim, group, padding_mode=padding_mode)
        lh, rh = _empty_halos(x, left, right, dim)
        _inflight.run(plan, _inflight.HALOS_FORWARD, x, lh, rh)
        ctx.plan, ctx.shape, ctx.dtype, ctx.order = plan, x.shape, x.dtype, dim_order(x)
        return lh, rh

    @staticmethod
    def backward(ctx, grad_left, grad_right):
        # Autograd asks for a gradient of all of x, so there is one of x's
        # size: zeros, into which the library adds the neighbours' part.
        # (The nn layers add it into the convolution's own input gradient.)
        order = ctx.order
        grad_x = empty_in_order(ctx.shape, order, ctx.dtype).zero_()
        grad_left, grad_right = (in_strides(g, strides_in_order(g.shape, order)) for g in (grad_left, grad_right))
        _inflight.run(ctx.plan, _inflight.HALOS_BACKWARD, grad_left, grad_right, grad_x)
        return grad_x, None, None, None, None, None


class _HalosDone(_Halos):
    @staticmethod
    def forward(ctx, x, done):
        lh, rh, ctx.plan = done  # (see _HaloExchangeDone)
        ctx.shape, ctx.dtype, ctx.order = x.shape, x.dtype, dim_order(x)
        return lh, rh

    @staticmethod
    def backward(ctx, grad_left, grad_right):
        return _Halos.backward(ctx, grad_left, grad_right)[0], None


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
    if _cuda.wanted(x):
        return _cuda.halos(x, left, right, dim, group, padding_mode)
    if x.is_neg():
        x = x.resolve_neg()
    if left == 0 and right == 0:
        return _empty_halos(x, 0, 0, dim)
    if _recording(x):
        return _Halos.apply(x, left, right, dim, group, padding_mode)
    plan = plan_halos(x, left, right, dim, group, padding_mode=padding_mode)
    lh, rh = _empty_halos(x, left, right, dim)
    _inflight.run(plan, _inflight.HALOS_FORWARD, x, lh, rh)
    return lh, rh


def halos_start(x: Tensor, left_size: int, right_size: int, dim: int, group=None,
                padding_mode: str = "zeros") -> Exchange:
    """Start :func:`halos`; ``.wait()`` returns ``(left_halo, right_halo)``.
    Until the wait the exchange owns ``x`` (do not modify it). Differentiable
    as :func:`halos` when ``x`` requires grad and grad mode is on at start."""
    left, right, dim = _check(x, left_size, right_size, dim, "x")
    _padding(padding_mode)
    if _cuda.wanted(x):
        return _cuda.halos_start(x, left, right, dim, group, padding_mode)
    if x.is_neg():
        x = x.resolve_neg()
    if left == 0 and right == 0:
        return _finished(_empty_halos(x, 0, 0, dim))
    plan = plan_halos(x, left, right, dim, group, padding_mode=padding_mode)
    lh, rh = _empty_halos(x, left, right, dim)
    pending = _inflight.start(plan, _inflight.HALOS_FORWARD, x, lh, rh)
    if not _recording(x):
        return Exchange(pending, lambda: (lh, rh))

    def result():
        with torch.enable_grad():
            return _HalosDone.apply(x, (lh, rh, plan))

    return Exchange(pending, result)
