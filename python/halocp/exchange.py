"""The differentiable halo exchange: out of place (the reference's drop-in),
in place (into a padded buffer the caller keeps) and halos only (the halos in
tensors of their own); each blocking, or started and finished later."""

from __future__ import annotations

import operator

import torch
from torch import Tensor

from . import _inflight, _lib
from ._comm import communicator, halo_dtype
from ._inflight import Exchange
from ._lib import HaloError


def _contiguous_strides(shape) -> tuple:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= n
    return tuple(reversed(strides))


def _check(x, left, right, dim, what: str):
    """Local checks the library cannot make (it never sees a torch tensor).
    Every rank that gets the same bad call raises the same error, before any
    communication, so no rank is left waiting."""
    if not isinstance(x, Tensor):
        raise HaloError(_lib.ERR_INVALID_ARGUMENT, f"halocp: {what} must be a torch.Tensor, not {type(x).__name__}")
    if x.layout != torch.strided:
        raise HaloError(_lib.ERR_INVALID_ARGUMENT, f"halocp: {what} must be a strided (dense) tensor, not {x.layout}")
    if x.device.type != "cpu":
        raise HaloError(
            _lib.ERR_INVALID_ARGUMENT,
            f"halocp: {what} is on {x.device}, but this libhalo exchanges CPU memory only (no CUDA support)",
        )
    try:
        left, right, dim = operator.index(left), operator.index(right), operator.index(dim)
    except TypeError as e:
        raise HaloError(_lib.ERR_INVALID_ARGUMENT, f"halocp: left_size, right_size and dim must be integers ({e})") from None
    nd = x.dim()
    if not -nd <= dim < nd:
        raise HaloError(_lib.ERR_INVALID_ARGUMENT, f"halocp: dim {dim} is out of range for a {nd}-d tensor")
    return left, right, dim % nd


# torch.nn.Conv3d's padding_mode spellings, and halo_padding_t.
_PADDING_MODES = {
    "zeros": _lib.PAD_ZEROS,
    "replicate": _lib.PAD_REPLICATE,
    "reflect": _lib.PAD_REFLECT,
    "circular": _lib.PAD_CIRCULAR,
}


def _padding(mode) -> int:
    """halo_padding_t of a padding_mode argument."""
    try:
        return _PADDING_MODES[mode]
    except (KeyError, TypeError):
        raise ValueError(f"halocp: padding_mode {mode!r} is not one of {', '.join(map(repr, _PADDING_MODES))}") from None


def _params(dtype, shape, dim, left, right, x_strides, out_strides, grad_strides, padding_mode="zeros"):
    """halo_plan_params_t for shard shape; grad_out and grad_x are contiguous
    buffers of the padded shape (grad_strides) or of the shard's shape."""
    p = _lib.PlanParams()
    p.dtype = halo_dtype(dtype)
    p.ndim = len(shape)
    if not 1 <= p.ndim <= _lib.MAX_DIMS:
        raise HaloError(_lib.ERR_INVALID_ARGUMENT, f"halocp: tensors of 1 to {_lib.MAX_DIMS} dims, not {len(shape)}")
    p.dim, p.left, p.right = dim, left, right
    # The arrays must outlive the call only: keep them on the struct object.
    p._keep = arrays = [_lib.int64_array(shape), _lib.int64_array(x_strides)]
    p.shape, p.x_strides = arrays
    p.field_mask = _lib.PLAN_PARAM_X_STRIDES | _lib.PLAN_PARAM_PADDING
    p.padding = _padding(padding_mode)
    if out_strides is not None:
        arrays.append(_lib.int64_array(out_strides))
        p.out_strides = arrays[-1]
        p.field_mask |= _lib.PLAN_PARAM_OUT_STRIDES
    if grad_strides is not None:
        go, gx = grad_strides
        arrays += [_lib.int64_array(go), _lib.int64_array(gx)]
        p.grad_out_strides, p.grad_x_strides = arrays[-2:]
        p.field_mask |= _lib.PLAN_PARAM_GRAD_OUT_STRIDES | _lib.PLAN_PARAM_GRAD_X_STRIDES
    return p


def _padded_shape(shape, dim, extra):
    s = list(shape)
    s[dim] += extra
    return s


def _plan_out_of_place(x: Tensor, left, right, dim, group, padding_mode):
    shape, strides = tuple(x.shape), x.stride()

    def params():
        out_shape = _padded_shape(shape, dim, left + right)
        return _params(x.dtype, shape, dim, left, right, strides, None,
                       (_contiguous_strides(out_shape), _contiguous_strides(shape)), padding_mode)

    return _lookup(group, ("copy", x.dtype, dim, left, right, shape, strides, padding_mode), params)


def _lookup(group, key, params):
    """The group's cached plan for key (made collectively on a miss), once
    any exchange whose handle was dropped has been finished."""
    comm = communicator(group)
    _inflight.settle(comm)
    return comm.plan(key, params)


def _exchange(x, left, right, dim, group, padding_mode):
    if x.is_neg():  # a lazily negated view: its memory holds -x
        x = x.resolve_neg()
    plan = _plan_out_of_place(x, left, right, dim, group, padding_mode)
    out = torch.empty(_padded_shape(x.shape, dim, left + right), dtype=x.dtype)
    plan.forward(x.data_ptr(), out.data_ptr())
    return out, plan


class _HaloExchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, left, right, dim, group, padding_mode):
        out, ctx.plan = _exchange(x, left, right, dim, group, padding_mode)
        ctx.shape, ctx.dtype = x.shape, x.dtype
        return out

    @staticmethod
    def backward(ctx, grad_out):
        grad_out = grad_out.contiguous()  # the plan's layout; a no-op for the usual gradient
        grad_x = torch.empty(ctx.shape, dtype=ctx.dtype)
        _inflight.settle(ctx.plan.comm)
        ctx.plan.backward(grad_out.data_ptr(), grad_x.data_ptr())
        return grad_x, None, None, None, None, None


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
    bfloat16, with any strides. ``left_size == right_size == 0`` returns
    ``x`` itself. Failures raise :class:`halocp.HaloError`.
    """
    left, right, dim = _check(x, left_size, right_size, dim, "x")
    _padding(padding_mode)
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
        cs = _contiguous_strides(pshape)
        # x is padded's interior, with padded's strides: the library sees the
        # alias and leaves the shard where it is.
        return _params(padded.dtype, shape, dim, left, right, pstrides, pstrides, (cs, cs), padding_mode)

    return _lookup(group, ("inplace", padded.dtype, dim, left, right, pshape, pstrides, padding_mode), params)


class _HaloExchangeInPlace(torch.autograd.Function):
    @staticmethod
    def forward(ctx, padded, left, right, dim, group, padding_mode):
        plan = _plan_in_place(padded, left, right, dim, group, padding_mode)
        interior = padded.data_ptr() + left * padded.stride(dim) * padded.element_size()
        plan.forward(interior, padded.data_ptr())
        ctx.mark_dirty(padded)
        ctx.plan, ctx.left, ctx.right, ctx.dim = plan, left, right, dim
        return padded

    @staticmethod
    def backward(ctx, grad_out):
        left, right, dim = ctx.left, ctx.right, ctx.dim
        grad_out = grad_out.contiguous()
        grad = torch.empty(grad_out.shape, dtype=grad_out.dtype)
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
    ``padded`` may have any non-overlapping strides; ``padding_mode`` is
    :func:`cp_halo_exchange`'s.
    """
    left, right, dim = _check(padded, left_size, right_size, dim, "padded")
    _padding(padding_mode)
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
        # done = (out, plan): out travels outside the tensor arguments so that
        # it becomes the node's output itself, not a view of an input.
        out, ctx.plan = done
        ctx.shape, ctx.dtype = x.shape, x.dtype
        return out

    @staticmethod
    def backward(ctx, grad_out):
        return _HaloExchange.backward(ctx, grad_out)[0], None


class _HaloExchangeInPlaceDone(_HaloExchangeInPlace):
    @staticmethod
    def forward(ctx, padded, plan, left, right, dim, padding_mode):
        ctx.mark_dirty(padded)
        ctx.plan, ctx.left, ctx.right, ctx.dim = plan, left, right, dim
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
    if left == 0 and right == 0:
        return _finished(x)
    if x.is_neg():
        x = x.resolve_neg()
    plan = _plan_out_of_place(x, left, right, dim, group, padding_mode)
    out = torch.empty(_padded_shape(x.shape, dim, left + right), dtype=x.dtype)
    pending = _inflight.start(plan, _inflight.FORWARD, x, out)
    if not _recording(x):
        return Exchange(pending, lambda: out)

    def result():
        with torch.enable_grad():
            return _HaloExchangeDone.apply(x, (out, plan))

    return Exchange(pending, result)


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


def _halo_shape(shape, dim, k) -> tuple:
    s = list(shape)
    s[dim] = k
    return tuple(s)


def plan_halos(x: Tensor, left, right, dim, group, grad_strides=None, padding_mode="zeros"):
    """The halos-only plan of x's layout (made collectively on a miss).

    The halos are contiguous tensors of their own; ``grad_strides`` are the
    strides of (grad_left, grad_right, grad_x) in the backward, contiguous
    ones of the halos' and x's shapes by default.
    """
    shape, strides = tuple(x.shape), x.stride()
    lshape, rshape = _halo_shape(shape, dim, left), _halo_shape(shape, dim, right)
    halo_strides = (_contiguous_strides(lshape), _contiguous_strides(rshape))
    if grad_strides is None:
        grad_strides = halo_strides + (_contiguous_strides(shape),)

    def params():
        p = _params(x.dtype, shape, dim, left, right, strides, None, None, padding_mode)
        p.halos_only = 1
        arrays = [_lib.int64_array(s) for s in halo_strides + tuple(grad_strides)]
        p._keep += arrays
        p.left_strides, p.right_strides, p.grad_left_strides, p.grad_right_strides, p.grad_x_strides = arrays
        p.field_mask |= (_lib.PLAN_PARAM_HALOS_ONLY | _lib.PLAN_PARAM_LEFT_STRIDES | _lib.PLAN_PARAM_RIGHT_STRIDES
                         | _lib.PLAN_PARAM_GRAD_LEFT_STRIDES | _lib.PLAN_PARAM_GRAD_RIGHT_STRIDES
                         | _lib.PLAN_PARAM_GRAD_X_STRIDES)
        return p

    return _lookup(group, ("halos", x.dtype, dim, left, right, shape, strides, tuple(grad_strides), padding_mode), params)


def _empty_halos(x: Tensor, left, right, dim):
    return (torch.empty(_halo_shape(x.shape, dim, left), dtype=x.dtype),
            torch.empty(_halo_shape(x.shape, dim, right), dtype=x.dtype))


class _Halos(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, left, right, dim, group, padding_mode):
        plan = plan_halos(x, left, right, dim, group, padding_mode=padding_mode)
        lh, rh = _empty_halos(x, left, right, dim)
        _inflight.run(plan, _inflight.HALOS_FORWARD, x, lh, rh)
        ctx.plan, ctx.shape, ctx.dtype = plan, x.shape, x.dtype
        return lh, rh

    @staticmethod
    def backward(ctx, grad_left, grad_right):
        # Autograd asks for a gradient of all of x, so there is one of x's
        # size: zeros, into which the library adds the neighbours' part.
        # (The nn layers add it into the convolution's own input gradient.)
        grad_x = torch.zeros(ctx.shape, dtype=ctx.dtype)
        _inflight.run(ctx.plan, _inflight.HALOS_BACKWARD, grad_left.contiguous(), grad_right.contiguous(), grad_x)
        return grad_x, None, None, None, None, None


class _HalosDone(_Halos):
    @staticmethod
    def forward(ctx, x, done):
        lh, rh, ctx.plan = done  # (see _HaloExchangeDone)
        ctx.shape, ctx.dtype = x.shape, x.dtype
        return lh, rh

    @staticmethod
    def backward(ctx, grad_left, grad_right):
        return _Halos.backward(ctx, grad_left, grad_right)[0], None


def halos(x: Tensor, left_size: int, right_size: int, dim: int, group=None,
          padding_mode: str = "zeros") -> tuple[Tensor, Tensor]:
    """Return ``(left_halo, right_halo)``: the ``left_size`` slices before
    this rank's shard ``x`` in the global sequence and the ``right_size``
    slices after it (zeros beyond the ends), each a new contiguous tensor of
    x's shape with that many slices along ``dim``.

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
