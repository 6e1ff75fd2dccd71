"""halocp's exchanges as torch.library custom ops, for torch.compile.

Dynamo cannot trace into ctypes, so a compiled model sees each exchange as
one opaque op with a fake (meta) implementation that gives the result's
shape and strides, and an autograd formula that calls the backward op. The
public functions route here while torch.compile traces them
(``torch.compiler.is_compiling()``); eager calls keep the plain autograd
Functions, which cost less per call (bench/RESULTS.md).

The in-place form is not an op of its own: under compile ``halo_exchange_``
is the out-of-place op on the interior copied back into the buffer (autograd
of a mutating custom op is not supported by torch.library), which gives the
same values and gradients at the cost of one copy of the buffer.

A process group cannot be an op argument: ops take a token (the group's
name, "" for the default group) that ``_comm.group_token`` hands out and
``_comm.token_group`` resolves.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import exchange
from ._comm import token_group
from ._layout import Like as _Like, dim_order, empty_in_order, padded_shape, resized


@torch.library.custom_op("halocp::exchange", mutates_args=())
def _exchange_op(x: Tensor, left: int, right: int, dim: int, group: str, padding_mode: str) -> Tensor:
    with torch.no_grad():
        out = exchange.cp_halo_exchange(x, left, right, dim, token_group(group), padding_mode)
    return out if out is not x else x.clone()  # an op's output never aliases its input


@_exchange_op.register_fake
def _(x, left, right, dim, group, padding_mode):
    return empty_in_order(padded_shape(x.shape, dim, left + right), dim_order(x), x.dtype, x.device)


@torch.library.custom_op("halocp::exchange_backward", mutates_args=())
def _exchange_backward_op(grad_out: Tensor, x_shape: list[int], x_strides: list[int], left: int, right: int,
                          dim: int, group: str, padding_mode: str) -> Tensor:
    x = _Like(x_shape, x_strides, grad_out)
    return exchange.route(exchange.COPY, x, left, right, dim, token_group(group), padding_mode).backward(grad_out)


@_exchange_backward_op.register_fake
def _(grad_out, x_shape, x_strides, left, right, dim, group, padding_mode):
    return empty_in_order(x_shape, dim_order(_Like(x_shape, x_strides, grad_out)), grad_out.dtype, grad_out.device)


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
        return exchange.halos(x, left, right, dim, token_group(group), padding_mode)


@_halos_op.register_fake
def _(x, left, right, dim, group, padding_mode):
    order = dim_order(x)
    return (empty_in_order(resized(x.shape, dim, left), order, x.dtype, x.device),
            empty_in_order(resized(x.shape, dim, right), order, x.dtype, x.device))


@torch.library.custom_op("halocp::halos_backward", mutates_args=())
def _halos_backward_op(grad_left: Tensor, grad_right: Tensor, x_shape: list[int], x_strides: list[int], left: int,
                       right: int, dim: int, group: str, padding_mode: str) -> Tensor:
    x = _Like(x_shape, x_strides, grad_left)
    return exchange.route(exchange.HALOS, x, left, right, dim, token_group(group), padding_mode).backward(grad_left,
                                                                                                         grad_right)


@_halos_backward_op.register_fake
def _(grad_left, grad_right, x_shape, x_strides, left, right, dim, group, padding_mode):
    return empty_in_order(x_shape, dim_order(_Like(x_shape, x_strides, grad_left)), grad_left.dtype, grad_left.device)


def _halos_grad(ctx, grad_left, grad_right):
    return (torch.ops.halocp.halos_backward(grad_left, grad_right, *ctx.x, *ctx.args),) + (None,) * 5


_halos_op.register_autograd(_halos_grad, setup_context=_save_x)
