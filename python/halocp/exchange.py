"""The differentiable halo exchange: out of place (the reference's drop-in)
and in place (into a padded buffer the caller keeps)."""

from __future__ import annotations

import operator

import torch
from torch import Tensor

from . import _lib
from ._comm import communicator, halo_dtype
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


def _params(dtype, shape, dim, left, right, x_strides, out_strides, grad_strides):
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
    p.field_mask = _lib.PLAN_PARAM_X_STRIDES
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


def _plan_out_of_place(x: Tensor, left, right, dim, group):
    shape, strides = tuple(x.shape), x.stride()

    def params():
        out_shape = _padded_shape(shape, dim, left + right)
        return _params(x.dtype, shape, dim, left, right, strides, None,
                       (_contiguous_strides(out_shape), _contiguous_strides(shape)))

    return communicator(group).plan(("copy", x.dtype, dim, left, right, shape, strides), params)


def _exchange(x, left, right, dim, group):
    if x.is_neg():  # a lazily negated view: its memory holds -x
        x = x.resolve_neg()
    plan = _plan_out_of_place(x, left, right, dim, group)
    out = torch.empty(_padded_shape(x.shape, dim, left + right), dtype=x.dtype)
    plan.forward(x.data_ptr(), out.data_ptr())
    return out, plan


class _HaloExchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, left, right, dim, group):
        out, ctx.plan = _exchange(x, left, right, dim, group)
        ctx.shape, ctx.dtype = x.shape, x.dtype
        return out

    @staticmethod
    def backward(ctx, grad_out):
        grad_out = grad_out.contiguous()  # the plan's layout; a no-op for the usual gradient
        grad_x = torch.empty(ctx.shape, dtype=ctx.dtype)
        ctx.plan.backward(grad_out.data_ptr(), grad_x.data_ptr())
        return grad_x, None, None, None, None


def cp_halo_exchange(x: Tensor, left_size: int, right_size: int, dim: int, group=None) -> Tensor:
    """Return ``cat(left halo, x, right halo)`` along ``dim``, differentiably.

    The drop-in for the reference ``cp_halo_exchange``: rank r of ``group``
    holds shard ``x`` of a sequence concatenated along ``dim`` in rank order;
    the left halo is the ``left_size`` slices before it, the right halo the
    ``right_size`` slices after it, zeros beyond the ends of the sequence.
    Halos may be longer than a shard and shards may differ in length along
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
    if left == 0 and right == 0:
        return x
    if x.requires_grad and torch.is_grad_enabled():
        return _HaloExchange.apply(x, left, right, dim, group)
    return _exchange(x, left, right, dim, group)[0]  # no graph to record: skip autograd's overhead


def _plan_in_place(padded: Tensor, left, right, dim, group):
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
        return _params(padded.dtype, shape, dim, left, right, pstrides, pstrides, (cs, cs))

    return communicator(group).plan(("inplace", padded.dtype, dim, left, right, pshape, pstrides), params)


class _HaloExchangeInPlace(torch.autograd.Function):
    @staticmethod
    def forward(ctx, padded, left, right, dim, group):
        plan = _plan_in_place(padded, left, right, dim, group)
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
        ctx.plan.backward(grad_out.data_ptr(), interior)
        # The halo slots were overwritten in the forward pass: no gradient.
        grad.narrow(dim, 0, left).zero_()
        grad.narrow(dim, left + n, right).zero_()
        return grad, None, None, None, None


def halo_exchange_(padded: Tensor, left_size: int, right_size: int, dim: int, group=None) -> Tensor:
    """Fill the halos of a padded buffer in place; return it.

    ``padded`` holds ``left_size`` halo slices, this rank's shard, then
    ``right_size`` halo slices along ``dim``; the caller writes the shard
    into the interior (``padded.narrow(dim, left_size, n)``) and this fills
    the halos exactly as :func:`cp_halo_exchange` would, without copying the
    shard. Differentiable: the gradient of the interior gets the halo
    gradients added, the halo slots get none (they were overwritten).
    ``padded`` may have any non-overlapping strides.
    """
    left, right, dim = _check(padded, left_size, right_size, dim, "padded")
    if left == 0 and right == 0:
        return padded
    return _HaloExchangeInPlace.apply(padded, left, right, dim, group)
