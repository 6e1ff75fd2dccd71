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

halocp.nn's strided, padded and tiled layers and ConvTranspose3d give each
rank as many outputs as the other ranks' shard lengths make it, data to a
traced graph: their ops below return that length as an unbacked size
(``new_dynamic_size``, which dynamo allows under ``fullgraph=True``). Each
op runs the eager path's own functions (nn._split, nn._conv_window,
transpose._span, transpose._place), so both paths compute the same split.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import exchange, halo_sum, nn, norm, transpose
from ._comm import token_group
from ._layout import Like as _Like, dim_order, empty_in_order, in_strides, padded_shape, resized, strides_in_order


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


# ------------------------------------------------- halocp.nn's general path
# A strided or padded layer's output count along a sharded dim depends on
# every rank's shard length, data to a traced graph. conv_split exchanges
# the lengths (and checks that the ranks agree, before any halo travels, as
# the eager path does) and gives this rank's (phase, count) as a tensor;
# window_conv convolves the window of the exchanged shard that its outputs
# read, its fake giving the count as an unbacked size. window_conv's
# backward is local: the exchanges' backwards (their own ops) return the
# halos' gradients, on every rank, a rank with no outputs included.


@torch.library.custom_op("halocp::conv_split", mutates_args=())
def _conv_split_op(x: Tensor, dim: int, row: list[int], group: str, layer: str) -> Tensor:
    return torch.tensor(nn._split(layer, dim, token_group(group), row), dtype=torch.int64)


@_conv_split_op.register_fake
def _(x, dim, row, group, layer):
    return torch.empty(2, dtype=torch.int64)


@torch.library.custom_op("halocp::window_conv", mutates_args=())
def _window_conv_op(padded: Tensor, weight: Tensor, bias: Tensor | None, splits: Tensor, dims: list[int],
                    stride: list[int], padding: list[int], dilation: list[int], groups: int) -> Tensor:
    window, shape = nn._conv_window(padded, weight, splits.tolist(), dims, stride, padding, dilation)
    strides = strides_in_order(shape, dim_order(padded))
    if window is None:
        return torch.empty_strided(shape, strides, dtype=padded.dtype, device=padded.device)
    y = nn._CONV[padded.dim() - 2](window, weight, bias, stride, padding, dilation, groups)
    return in_strides(y, strides)


@_window_conv_op.register_fake
def _(padded, weight, bias, splits, dims, stride, padding, dilation, groups):
    shape = nn._output_shape(padded, weight, dims, stride, padding, dilation)
    ctx = torch.library.get_ctx()
    for dim in dims:
        shape[dim] = ctx.new_dynamic_size()
    return empty_in_order(shape, dim_order(padded), padded.dtype, padded.device)


@torch.library.custom_op("halocp::window_conv_backward", mutates_args=())
def _window_conv_backward_op(grad: Tensor, padded: Tensor, weight: Tensor, splits: Tensor, dims: list[int],
                             stride: list[int], padding: list[int], dilation: list[int], groups: int,
                             mask: list[bool]) -> tuple[Tensor, Tensor, Tensor]:
    splits = splits.tolist()
    window, _ = nn._conv_window(padded, weight, splits, dims, stride, padding, dilation)
    grad_padded = torch.zeros_like(padded) if mask[0] else padded.new_empty(0)
    if window is None:  # no outputs: zeros, as nn._NoOutput's
        grad_w = torch.zeros_like(weight) if mask[1] else weight.new_empty(0)
        return grad_padded, grad_w, weight.new_zeros(weight.shape[0] if mask[2] else 0)
    bias_sizes = [weight.shape[0]] if mask[2] else None
    grad_window, grad_w, grad_b = torch.ops.aten.convolution_backward(
        grad, window, weight, bias_sizes, stride, padding, dilation, False, [0] * len(stride), groups, mask)
    if mask[0]:
        nn._conv_window(grad_padded, weight, splits, dims, stride, padding, dilation)[0].copy_(grad_window)
    return (grad_padded, weight.new_empty(0) if grad_w is None else grad_w,
            weight.new_empty(0) if grad_b is None else grad_b)


@_window_conv_backward_op.register_fake
def _(grad, padded, weight, splits, dims, stride, padding, dilation, groups, mask):
    return (torch.empty_like(padded) if mask[0] else padded.new_empty(0),
            torch.empty_like(weight) if mask[1] else weight.new_empty(0),
            weight.new_empty(weight.shape[0] if mask[2] else 0))


def _save_window(ctx, inputs, output):
    padded, weight, bias, splits = inputs[:4]
    ctx.save_for_backward(padded, weight, splits)
    ctx.conv = inputs[4:]
    ctx.has_bias = bias is not None


def _window_conv_grad(ctx, grad):
    padded, weight, splits = ctx.saved_tensors
    mask = [ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.has_bias and ctx.needs_input_grad[2]]
    grads = torch.ops.halocp.window_conv_backward(grad, padded, weight, splits, *ctx.conv, mask)
    return tuple(g if m else None for g, m in zip(grads, mask)) + (None,) * 6


_window_conv_op.register_autograd(_window_conv_grad, setup_context=_save_window)


# ---------------------------------------- halocp.nn.ConvTranspose3d's path
# The same split for the transposed convolution: transpose_span exchanges
# the rows (and checks them) and gives where this rank's local output goes
# in the summing exchange's input, as a tensor; conv_transpose_sum convolves
# the shard, places the result there and sums, its fake giving the output
# length as an unbacked size. (The convolution is inside the op: inductor
# lowers a convolution only over sizes it has a hint for, and the shard's
# length may be data too, a strided layer's output.) Its backward is the
# exchange's forward, then the placement's and the convolution's adjoints.


@torch.library.custom_op("halocp::transpose_span", mutates_args=())
def _transpose_span_op(x: Tensor, row: list[int], group: str) -> Tensor:
    return torch.tensor(transpose._span(row, token_group(group), x.device), dtype=torch.int64)


@_transpose_span_op.register_fake
def _(x, row, group):
    return torch.empty(2, dtype=torch.int64)


def _fresh(t: Tensor, strides, of: Tensor) -> Tensor:
    """t in strides, never sharing of's memory (an op's output never
    aliases its input)."""
    t = in_strides(t, strides)
    return t.clone() if t.numel() and t.data_ptr() == of.data_ptr() else t


@torch.library.custom_op("halocp::conv_transpose_sum", mutates_args=())
def _conv_transpose_sum_op(x: Tensor, weight: Tensor, span: Tensor, stride: list[int], padding: list[int],
                           output_padding: list[int], groups: int, dilation: list[int], left: int, right: int,
                           group: str) -> Tensor:
    offset, size = span.tolist()
    z, _ = transpose._local(x, weight, (stride, padding, output_padding, groups, dilation))
    with torch.no_grad():
        y = halo_sum.cp_halo_sum(transpose._place(z, offset, size), left, right, 2, token_group(group))
    return _fresh(y, strides_in_order(y.shape, dim_order(x)), x)


@_conv_transpose_sum_op.register_fake
def _(x, weight, span, stride, padding, output_padding, groups, dilation, left, right, group):
    shape = [x.shape[0], weight.shape[1] * groups, torch.library.get_ctx().new_dynamic_size()]
    for i in (1, 2):  # torch's formula
        k = dilation[i] * (weight.shape[2 + i] - 1)
        shape.append((x.shape[2 + i] - 1) * stride[i] - 2 * padding[i] + k + output_padding[i] + 1)
    return empty_in_order(shape, dim_order(x), x.dtype, x.device)


@torch.library.custom_op("halocp::conv_transpose_sum_backward", mutates_args=())
def _conv_transpose_sum_backward_op(grad: Tensor, x: Tensor, weight: Tensor, span: Tensor, stride: list[int],
                                    padding: list[int], output_padding: list[int], groups: int, dilation: list[int],
                                    left: int, right: int, group: str, mask: list[bool]) -> tuple[Tensor, Tensor]:
    offset, _ = span.tolist()
    n, order = x.shape[2], dim_order(x)
    if n == 0:  # as _local convolved it
        x = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, 1))
    z_frames = (x.shape[2] - 1) * stride[0] + dilation[0] * (weight.shape[2] - 1) + 1
    with torch.no_grad():  # in the forward's layout, whose plan exists
        g = exchange.cp_halo_exchange(in_strides(grad, strides_in_order(grad.shape, order)), left, right, 2,
                                      token_group(group))
    grad_z = transpose._place(g, -offset, z_frames)
    grad_x, grad_w, _ = torch.ops.aten.convolution_backward(grad_z, x, weight, None, stride, padding, dilation, True,
                                                            output_padding, groups, [mask[0], mask[1], False])
    if grad_x is None:
        grad_x = x.new_empty(0)
    else:
        grad_x = grad_x.narrow(2, 0, n)
        grad_x = in_strides(grad_x, strides_in_order(grad_x.shape, order))
    return grad_x, weight.new_empty(0) if grad_w is None else grad_w


@_conv_transpose_sum_backward_op.register_fake
def _(grad, x, weight, span, stride, padding, output_padding, groups, dilation, left, right, group, mask):
    return (empty_in_order(x.shape, dim_order(x), x.dtype, x.device) if mask[0] else x.new_empty(0),
            torch.empty_like(weight) if mask[1] else weight.new_empty(0))


def _save_conv_transpose(ctx, inputs, output):
    x, weight, span = inputs[:3]
    ctx.save_for_backward(x, weight, span)
    ctx.args = inputs[3:]


def _conv_transpose_sum_grad(ctx, grad):
    x, weight, span = ctx.saved_tensors
    mask = list(ctx.needs_input_grad[:2])
    grad_x, grad_w = torch.ops.halocp.conv_transpose_sum_backward(grad, x, weight, span, *ctx.args, mask)
    return (grad_x if mask[0] else None, grad_w if mask[1] else None) + (None,) * 9


_conv_transpose_sum_op.register_autograd(_conv_transpose_sum_grad, setup_context=_save_conv_transpose)


# cp_halo_sum under compile is the exchange's backward op; its own backward
# is the exchange's forward.


def _save_sum(ctx, inputs, output):
    ctx.args = inputs[3:]


def _sum_grad(ctx, grad):
    return (torch.ops.halocp.exchange(grad, *ctx.args),) + (None,) * 7


_exchange_backward_op.register_autograd(_sum_grad, setup_context=_save_sum)


# ------------------------------------------------- halocp.nn.GroupNorm's path
# The statistics' all_gather with the ranks' headers, which are read and
# checked on the host (norm._gather): an op, as the graph cannot raise on
# what the ranks sent. Its gradient is never needed: the layer's backward
# is the autograd Function's, which takes none through the statistics.


@torch.library.custom_op("halocp::norm_statistics", mutates_args=())
def _norm_statistics_op(mine: Tensor, header: list[int], eps: float, group: str) -> Tensor:
    return norm._gather(mine, header, eps, token_group(group)).contiguous()


@_norm_statistics_op.register_fake
def _(mine, header, eps, group):
    return mine.new_empty((nn.dist.get_world_size(token_group(group)),) + tuple(mine.shape))
