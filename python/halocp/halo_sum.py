"""The summing exchange, ``cp_halo_sum``: the adjoint of ``cp_halo_exchange``.

Rank r holds ``y = [L slices | m slices | R slices]`` along dim: its own m
slices of the global sequence, flanked by contributions to the L slices
before them (held by the ranks to its left, further than one rank when
their shards are short) and to the R slices after them. ``cp_halo_sum``
returns the m slices with every other rank's contributions to them added:
the overlap-add of a transposed convolution (AMReX's SumBoundary, Cabana's
scatter(Sum)).

That is what the backward of ``cp_halo_exchange(x, L, R)`` does to its
gradient, so it runs on the same plan, through the library's backward path,
and its own backward is that exchange's forward. No new wire protocol.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import _lib
from ._lib import HaloError
from ._sharding import world_and_rank
from ._shapes import Like, dim_order, in_strides, known, padded_shape, strides_in_order
from .exchange import COPY, _check, _padding, _token, cp_halo_exchange, is_compiling, route

__all__ = ["cp_halo_sum"]


def _sum(y, left, right, dim, group, padding_mode):
    """The backward of the out-of-place exchange of an x of y's interior's
    shape, in y's memory format: its Route, on whichever device path."""
    shape = padded_shape(y.shape, dim, -left - right)
    x = Like(shape, strides_in_order(shape, dim_order(y)), y)
    return route(COPY, x, left, right, dim, group, padding_mode).backward(y)


class _HaloSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, left, right, dim, group, padding_mode):
        ctx.args = (left, right, dim, group, padding_mode)
        out = _sum(y, left, right, dim, group, padding_mode)
        ctx.strides = out.stride()
        return out

    @staticmethod
    def backward(ctx, grad):
        # In the forward's layout, so that the exchange finds the forward's
        # plan (plans are cached by layout; an empty tensor's strides vary).
        with torch.no_grad():
            return (cp_halo_exchange(in_strides(grad, ctx.strides), *ctx.args),) + (None,) * 5


def cp_halo_sum(y: Tensor, left_size: int, right_size: int, dim: int, group=None,
                padding_mode: str = "zeros") -> Tensor:
    """Return y's interior (``y.narrow(dim, left_size, m)``) with the other
    ranks' boundary contributions to it added, differentiably.

    ``y`` on rank r is ``[L | m | R]`` along ``dim``: the L first slices are
    added to the L slices that precede rank r's m in the global sequence
    (the concatenation of every rank's m slices in rank order), the R last
    ones to the R that follow them. Exactly the backward of
    :func:`cp_halo_exchange` ``(x, L, R, dim, group, padding_mode)`` applied
    to y, bit for bit and in its order of additions; contributions beyond
    the ends of the sequence are dropped under ``"zeros"`` and folded back
    as ``F.pad``'s backward folds them under the other modes. The backward
    is that exchange's forward. ``m`` may differ between ranks, be 0, or be
    shorter than L or R. Collective, like every exchange.
    """
    left, right, dim = _check(y, left_size, right_size, dim, "y")
    _padding(padding_mode)
    if known(y.shape[dim] < left + right, False):  # (else the library says so)
        _, rank = world_and_rank(group)
        raise HaloError(_lib.ERR_INVALID_ARGUMENT,
                        f"halocp: cp_halo_sum on rank {rank}: y has {y.shape[dim]} slices along dim {dim}, "
                        f"fewer than its halos ({left} + {right}); shape {tuple(y.shape)}")
    if left == 0 and right == 0:
        return y
    if is_compiling():  # the exchange's backward op, whose backward is the exchange (exchange.py)
        shape = padded_shape(y.shape, dim, -left - right)
        return torch.ops.halocp.exchange_backward(y, shape, strides_in_order(shape, dim_order(y)), left, right, dim,
                                                  _token(group), padding_mode)
    if y.is_neg():
        y = y.resolve_neg()
    if y.requires_grad and torch.is_grad_enabled():
        return _HaloSum.apply(y, left, right, dim, group, padding_mode)
    return _sum(y, left, right, dim, group, padding_mode)
