"""A transposed 3-d convolution over a time axis sharded across a group: the
temporal upsampling of a video VAE's decoder.

How the global output is distributed. Along T, with stride s, padding p,
output padding op, dilation d and kernel K (e = d(K-1)), the whole output
has Lout = (T-1)s - 2p + e + op + 1 frames. The rank whose shard holds
input frames [a, a+n) holds output frames [a*s, (a+n)*s): the frames "above"
its inputs, n*s of them; the last rank also holds every frame past the
others' (Lout - a*s in all), and ranges are clipped to [0, Lout). So
upsampling by s maps every shard of n frames to n*s, and an encoder's
temporal stride s maps it back (halocp.nn.CausalConv3d gives output j to the
rank holding input j*s).

How it is computed. Input frame i contributes to output frames
i*s - p .. i*s - p + e. A rank's local transposed convolution with no
temporal padding covers output frames a*s - p .. (a+n)*s - p + e - s + 1,
that is p frames before its own range and R = max(e + 1 - s - p, 0) after
it: those belong to the ranks around it (or to no rank: the crop at the
ends). They are sent and added there by halocp.cp_halo_sum, the halo
exchange's backward; the backward of the whole layer is autograd's, the
exchange's forward in place of the sum. Weight and bias gradients are per
rank, as for halocp.nn's convolutions: sum them over the group.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from . import _lib
from ._comm import token_group
from ._shapes import dim_order, empty_in_order, in_strides, strides_in_order
from ._lib import HaloError
from ._sharding import disagreement, distributed, world_and_rank
from ._splits import ShardTable
from .exchange import _token, cp_halo_exchange, is_compiling
from .halo_sum import cp_halo_sum

__all__ = ["ConvTranspose3d"]

# The shard table's columns: the length, then what every rank must agree on.
_AGREED = {1: "kernel", 2: "stride", 3: "padding", 4: "output_padding", 5: "dilation", 6: "in_channels",
           7: "out_channels"}
# Then what a rank's boundary frames are computed with, which the summing
# exchange cannot tell when the output's shape comes out the same: named
# in a mismatch's message where they differ.
_COMPUTED = {8 + i: name for i, name in enumerate(
    ["groups"] + [f"{arg} {d}" for arg in ("kernel", "stride", "padding", "output_padding", "dilation")
                  for d in "hw"])}


class ConvTranspose3d(torch.nn.ConvTranspose3d):
    """``torch.nn.ConvTranspose3d`` over an ``(N, C, T, H, W)`` input (or
    unbatched ``(C, T, H, W)``) whose T is sharded across ``group``, in rank
    order, shards of any length (0 included).

    Every argument is torch's and means what it means there, temporal ones
    included (stride, padding, output_padding, dilation over T); ``group``
    is the process group (``None``: the default one, or one process with the
    whole sequence when torch.distributed is not initialised). The ranks'
    outputs put together along T are torch's over the whole input, and so
    are the input gradients; rank r's output holds frames
    ``[a*s, (a+n)*s)`` of it (a: the frames before its shard, n: its
    length, s: the temporal stride), the last rank's runs to the end. Each
    call exchanges one small row per rank (the shard lengths, and the
    layer's arguments, groups and spatial ones included: ranks that disagree
    all raise ``HaloError(ERR_MISMATCH)``), then one summing exchange of the
    boundary frames. Only ``padding_mode="zeros"`` (torch's only one).
    """

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, output_padding=0, groups=1,
                 bias=True, dilation=1, padding_mode="zeros", device=None, dtype=None, *, group=None):
        super().__init__(in_channels, out_channels, kernel_size, stride, padding, output_padding, groups, bias,
                         dilation, padding_mode, device, dtype)
        k, s, p, op, d = (self.kernel_size[0], self.stride[0], self.padding[0], self.output_padding[0],
                          self.dilation[0])
        if not 0 <= op < max(s, d):  # torch says so only at the first call
            raise ValueError(f"halocp.nn.ConvTranspose3d: temporal output_padding {op} must be smaller than the "
                             f"stride ({s}) or the dilation ({d})")
        self.group = group
        self.left, self.right = _halos(k, s, p, d)

    def forward(self, x: torch.Tensor, output_size=None) -> torch.Tensor:
        if not distributed(self.group):
            return super().forward(x, output_size)
        if output_size is not None:
            # It would pick output_padding from the whole output's size, which no rank holds.
            raise ValueError("halocp.nn.ConvTranspose3d: output_size is for one process; give output_padding")
        if not isinstance(x, torch.Tensor) or x.dim() not in (4, 5) or x.shape[-4] != self.in_channels:
            if world_and_rank(self.group)[0] == 1:
                what = f"shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
                raise HaloError(_lib.ERR_INVALID_ARGUMENT,
                                f"halocp.nn: ConvTranspose3d on rank 0 wants (N, C, T, H, W) input with C = "
                                f"{self.in_channels} (or unbatched), not {what}")
            # The other ranks may be in the shard table's collective already:
            # join it with a row that says so, and every rank raises alike.
            return _refuse(self, x)
        if x.dim() == 4:
            return self.forward(x.unsqueeze(0)).squeeze(0)
        return _sharded_conv_transpose(self, x)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", temporal halo=({self.left}, {self.right})"


def _row(layer, n, x_shape):
    """This rank's row of the shard table: its shard length n, the layer's
    arguments, and its input's dims and C (what a refusal names)."""
    row = [n, layer.kernel_size[0], layer.stride[0], layer.padding[0], layer.output_padding[0], layer.dilation[0],
           layer.in_channels, layer.out_channels, layer.groups]
    for arg in (layer.kernel_size, layer.stride, layer.padding, layer.output_padding, layer.dilation):
        row += arg[1:]
    return row + [len(x_shape), x_shape[-4] if len(x_shape) >= 4 else -1]


def _refuse(layer, x):
    """Join the shard table with a refused input's row (length -1): raises
    on every rank; under compile, returned so that the op stays in the graph."""
    tensor = isinstance(x, torch.Tensor)
    row = _row(layer, -1, tuple(x.shape) if tensor else ())
    if is_compiling():
        return torch.ops.halocp.transpose_span(layer.weight, row, _token(layer.group))
    return _span(row, layer.group)


def _halos(k, s, p, d):
    """The frames a rank's local output has before and after its own."""
    return p, max(d * (k - 1) + 1 - s - p, 0)


def _sharded_conv_transpose(layer, x):
    row = _row(layer, x.shape[2], x.shape)
    # No temporal padding or output padding: the crop at the ends is the exchange's.
    conv = [list(layer.stride), [0] + list(layer.padding[1:]), [0] + list(layer.output_padding[1:]), layer.groups,
            list(layer.dilation)]
    if is_compiling():
        # The length of this rank's output is data (the other ranks'
        # lengths): ops whose fake gives it as an unbacked size (below).
        token = _token(layer.group)
        span = torch.ops.halocp.transpose_span(x, row, token)
        y = torch.ops.halocp.conv_transpose_sum(x, layer.weight, span, *conv, layer.left, layer.right, token)
    else:
        span = _span(row, layer.group)
        y = cp_halo_sum(_place(_local(x, layer.weight, conv)[0], *span), layer.left, layer.right, 2, layer.group)
    if layer.bias is not None:
        # In place: the sum's output is new, and no backward needs it.
        y = y.add_(layer.bias.view(1, -1, 1, 1, 1))
    return y


def _local(x, weight, conv):
    """(z, the x it convolved): x's local transposed convolution, whose first
    frame is output frame a*s - p. An empty shard contributes nothing, but
    its part of the graph must exist (its backward runs its part of the
    exchange): it is convolved as one zero frame."""
    stride, padding, output_padding, groups, dilation = conv
    if x.shape[2] == 0:
        x = F.pad(x, (0, 0, 0, 0, 0, 1))
    return F.conv_transpose3d(x, weight, None, stride, padding, output_padding, groups, dilation), x


def _span(row, group):
    """(offset, size): where z (the local transposed convolution of a shard
    of row[0] frames) goes in the input of the summing exchange, and that
    input's length. One exchange of every rank's row, which also checks
    that the ranks agree on the layer."""
    n, k, s, p, op, d = row[:6]
    world, rank = world_and_rank(group)
    table = ShardTable.of(group, row)
    refused = [r for r, t in enumerate(table) if t[0] < 0]
    if refused:
        said = "; ".join(f"rank {r}: " + (f"dims {table[r][-2]}, C {table[r][-1]}" if table[r][-2] else "not a tensor")
                         for r in refused)
        raise HaloError(_lib.ERR_INVALID_ARGUMENT, "halocp.nn: ConvTranspose3d wants (N, C, T, H, W) input with C = "
                                                   f"in_channels (or unbatched), not on every rank ({said})")
    computed = {i: name for i, name in _COMPUTED.items() if any(r[i] != table[0][i] for r in table)}
    bad = disagreement(table, {**_AGREED, **computed})
    if bad:
        raise HaloError(_lib.ERR_MISMATCH,
                        f"halocp.nn: ConvTranspose3d: the ranks of the group disagree on the layer ({bad})")
    lengths = [r[0] for r in table]
    a, total = sum(lengths[:rank]), sum(lengths)
    out_len = max((total - 1) * s - 2 * p + d * (k - 1) + op + 1, 0)
    start = min(a * s, out_len)
    end = out_len if rank == world - 1 else min((a + n) * s, out_len)
    left, right = _halos(k, s, p, d)
    return a * s - start, left + (end - start) + right


def _place(z, offset, size):
    """The frames [0, size) of z shifted ``offset`` frames later along T:
    z's frames that fall outside are dropped, the frames it does not cover
    are zeros."""
    lo = min(offset, size)
    keep = max(min(offset + z.shape[2], size) - lo, 0)
    if lo == 0 and keep == z.shape[2] == size:
        return z
    return F.pad(z.narrow(2, lo - offset if keep else 0, keep), (0, 0, 0, 0, lo, size - lo - keep))


# ------------------------------------------------------ torch.library ops
# For torch.compile (exchange.py says why ops), nn.py's split for the
# transposed convolution: transpose_span exchanges the rows (and checks
# them) and gives where this rank's local output goes in the summing
# exchange's input, as a tensor; conv_transpose_sum convolves the shard,
# places the result there and sums, its fake giving the output length as an
# unbacked size. (The convolution is inside the op: inductor lowers a
# convolution only over sizes it has a hint for, and the shard's length may
# be data too, a strided layer's output.) Its backward is the exchange's
# forward, then the placement's and the convolution's adjoints.


@torch.library.custom_op("halocp::transpose_span", mutates_args=())
def _transpose_span_op(x: Tensor, row: list[int], group: str) -> Tensor:
    return torch.tensor(_span(row, token_group(group)), dtype=torch.int64)


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
    z, _ = _local(x, weight, (stride, padding, output_padding, groups, dilation))
    with torch.no_grad():
        y = cp_halo_sum(_place(z, offset, size), left, right, 2, token_group(group))
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
        g = cp_halo_exchange(in_strides(grad, strides_in_order(grad.shape, order)), left, right, 2,
                             token_group(group))
    grad_z = _place(g, -offset, z_frames)
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
