"""Context-parallel and tiled convolutions: the halo exchange and the
convolution in one layer.

Each rank holds a shard of the time axis of an ``(N, C, T, H, W)`` input
(or unbatched ``(C, T, H, W)``), or one tile of an input tiled over a grid
of ranks (TiledConv2d, TiledConv3d); the layer fetches the context its
kernel needs from the neighbouring ranks and convolves, so that the ranks'
outputs put together, and every gradient, are those of the same convolution
over the whole tensor. Weight gradients are per rank: sum them over the
group (DDP and FSDP average: docs/python.md says what to do).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from . import _lib
from ._comm import token_group
from ._lib import HaloError
from ._sharding import distributed, world_and_rank
from ._shapes import (contiguous_strides as _contiguous_strides, dim_order, empty_in_order, in_strides, known,
                      result_dtype, strides_in_order)
from .exchange import HALOS, _empty_halos, _token, cp_halo_exchange, halos, is_compiling, route
from .tiles import TileGrid
from ._splits import (ShardTable as _ShardTable, agree as _agree, count_bounds as _count_bounds_of,
                      outputs as _outputs, split as _split)

__all__ = ["CausalConv3d", "CenteredConv3d", "TiledConv2d", "TiledConv3d"]


def _pair(v, name):
    if isinstance(v, int):
        return (v, v)
    v = tuple(v)
    if len(v) != 2:
        raise ValueError(f"{name} is spatial (height, width): an int or a pair, not {v!r}")
    return v


class _Config:
    """A layer's convolution arguments, as the autograd Function needs them."""

    __slots__ = ("stride", "padding", "dilation", "groups", "left", "right", "group")

    def __init__(self, layer):
        self.stride, self.padding, self.dilation = layer.stride, layer.padding, layer.dilation
        self.groups, self.left, self.right, self.group = layer.groups, layer.left, layer.right, layer.group

    def conv(self, x, weight, bias):
        return _conv(x, weight, bias, self.stride, self.padding, self.dilation, self.groups)

    def output_shape(self, x, weight):
        """The layer's output shape for shard x (as many frames as x; the
        spatial sizes by conv3d's formula)."""
        shape = [x.shape[0], weight.shape[0], x.shape[2]]
        for i in (1, 2):
            k = self.dilation[i] * (weight.shape[2 + i] - 1) + 1
            shape.append((x.shape[2 + i] + 2 * self.padding[i] - k) // self.stride[i] + 1)
        return shape

    def conv_backward(self, grad, x, weight, mask):
        """(grad_x, grad_weight, None) of conv(x, weight) for grad; mask says which."""
        return _conv_backward(grad, x, weight, self.stride, self.padding, self.dilation, self.groups, mask)


def _autocast_inputs(*tensors):
    """The tensors as autocast hands them to conv3d (floating point but
    float64 in its lower precision), cast before an autograd Function that
    convolves inside: its backward runs outside autocast, so it must save
    the dtypes the forward convolved (float32 weights beside a bfloat16
    gradient make torch's convolution backward fail)."""
    device = tensors[0].device.type
    if not (torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device)):
        return tensors
    dtype = torch.get_autocast_dtype(device)
    return tuple(t.to(dtype) if t is not None and t.is_floating_point() and t.dtype != torch.float64 else t
                 for t in tensors)


def _padded_frames(t, frames):
    shape = list(t.shape)
    shape[2] = frames
    return shape


class _ContextParallelConv(torch.autograd.Function):
    """The context-parallel convolution without a padded copy of the input.

    P = [left halo | x | right halo] along T (n + L + R frames), y = conv(P)
    with no temporal padding: output frame t reads P[t .. t + c], c = L + R.
    Frames L .. n-R-1 read x alone: they are conv(x), computed while the
    halos travel. The L first frames read [left halo | x[:c]] and the R last
    ones [x[n-c:] | right halo]: two small slabs, whose windows are
    convolved once the halos are in (see _windows). In the backward the
    windows' input gradients give the halo gradients (sent to the
    neighbours) and a correction of x's first and last c frames; the
    neighbours' halo gradients are added into the convolution's own grad_x
    by the library, while the weight gradient is computed. Ranks whose shard is not longer than c (so that the slabs
    would overlap or reach past x) convolve P itself, which is then small.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, cfg):
        if x.is_neg():
            x = x.resolve_neg()
        L, R = cfg.left, cfg.right
        c, n = L + R, x.shape[2]
        fused = n > c
        # No halos (a kernel one frame long, on an empty shard): no exchange.
        halo_route = _route(x, cfg, fused) if c else None
        if halo_route is not None:
            pending, finish = halo_route.start(x)
        else:
            pending, finish = None, lambda: _empty_halos(x, L, R, 2)
        if fused:
            try:
                y_in = cfg.conv(x, weight, bias)
            except BaseException:
                if pending:
                    pending.finish_quietly()  # peers are owed this rank's part of the exchange
                raise
        if pending:
            pending.finish(block=True)
        lh, rh = finish()
        if fused:
            y_left, y_right = _from_windows(cfg.conv(_windows(lh, x, rh, L, R), weight, bias), L, R)
            # The one full-size copy (conv3d cannot write into a given
            # tensor), in the layout torch's convolution gave y_in.
            y = empty_in_order(_padded_frames(y_in, n), dim_order(y_in), y_in.dtype, y_in.device)
            torch.cat([y_left, y_in, y_right], 2, out=y)
        elif n:
            # In x's layout: torch.cat (PyTorch 2.15) lays out a one-frame
            # channels_last x beside an empty halo as a contiguous tensor.
            p = empty_in_order(_padded_frames(x, n + c), dim_order(x), x.dtype, x.device)
            y = cfg.conv(torch.cat([lh, x, rh], 2, out=p), weight, bias)
        else:  # an empty shard: no output frames, but its halos still travel
            dtype = result_dtype(lambda p: cfg.conv(p, weight, bias), x, weight.shape[2:], cfg.dilation)
            y = x.new_empty(cfg.output_shape(x, weight), dtype=dtype)
        ctx.save_for_backward(x, weight, lh, rh)
        ctx.cfg, ctx.route, ctx.fused = cfg, halo_route, fused
        return y

    @staticmethod
    def backward(ctx, grad):
        x, weight, lh, rh = ctx.saved_tensors
        cfg, halo_route = ctx.cfg, ctx.route
        L, R = cfg.left, cfg.right
        c, n = L + R, x.shape[2]
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad_x = grad_w = grad_b = None
        if need_b:
            grad_b = grad.sum((0, 2, 3, 4))
        if not (need_x or need_w):  # no input gradient: no exchange, on every rank alike
            return None, None, grad_b, None
        if not ctx.fused:
            padded = torch.cat([lh, x, rh], 2)
            if n:
                grad_p, grad_w, _ = cfg.conv_backward(grad, padded, weight, (need_x, need_w, False))
            else:
                grad_p = torch.zeros_like(padded) if need_x else None
                grad_w = torch.zeros_like(weight) if need_w else None
            if need_x:
                # Separate tensors, in the plan's layouts: the library refuses
                # interleaved views of one buffer.
                order = dim_order(x)
                grad_x, grad_left, grad_right = (
                    empty_in_order(t.shape, order, t.dtype, t.device).copy_(t)
                    for t in (grad_p.narrow(2, L, n), grad_p.narrow(2, 0, L), grad_p.narrow(2, L + n, R)))
            if need_x and halo_route:
                halo_route.add(grad_left, grad_right, grad_x)
            return grad_x, grad_w, grad_b, None

        # The gradient of the output frames that read x alone. Contiguous once
        # here: torch's CPU convolutions would copy it in each of the two calls.
        grad_in = grad.narrow(2, L, n - c).contiguous()
        grad_win, grad_w_win, _ = cfg.conv_backward(_to_windows(grad, L, R), _windows(lh, x, rh, L, R), weight,
                                                    (need_x, need_w, False))
        pending = None
        if need_x:
            grad_x = cfg.conv_backward(grad_in, x, weight, (True, False, False))[0]
            grad_x = in_strides(grad_x, strides_in_order(x.shape, dim_order(x)))  # the plan's: x's memory format
            # The windows' input gradients, summed into the two slabs
            # [left halo | x[:c]] and [x[n-c:] | right halo]: the halo
            # gradients, and the rest of the gradient of x's first and last c frames.
            grad_sl, grad_sr = _into_slabs(grad_win, L, R, grad_x.shape)
            grad_left = grad_right = grad_x.new_empty(_padded_frames(grad_x, 0))
            if L:
                grad_x.narrow(2, 0, c).add_(grad_sl.narrow(2, L, c))
                grad_left = grad_sl.narrow(2, 0, L)
            if R:
                grad_x.narrow(2, n - c, c).add_(grad_sr.narrow(2, 0, c))
                grad_right = grad_sr.narrow(2, c, R)
            # grad_x now holds all but the neighbours' part, which the library
            # adds in place once it arrives.
            pending, finish = halo_route.start_add(grad_left, grad_right, grad_x)
        if need_w:
            try:
                grad_w = cfg.conv_backward(grad_in, x, weight, (False, True, False))[1]
            except BaseException:
                if pending is not None:
                    pending.finish_quietly()
                raise
            grad_w.add_(grad_w_win)
        if pending is not None:
            pending.finish(block=True)
            finish()
        return grad_x, grad_w, grad_b, None


# The L first and R last output frames each read a window of c + 1 frames of
# P = [left halo | x | right halo]. They are convolved as one batch of L + R
# windows (times N) rather than as two slabs: torch picks its CPU convolution
# by the input's size, and small slabs would take the slow unfolding one
# (ten times slower per frame than the oneDNN one that the full-size
# convolutions take), while a batch of more than one takes oneDNN.


def _windows(lh, x, rh, L, R):
    """((L + R) * N, C, c + 1, H, W): window t of the left slab, then of the
    right one, each N batch entries long."""
    c, n = L + R, x.shape[2]
    wins = []
    if L:
        slab = torch.cat([lh, x.narrow(2, 0, c)], 2)
        wins += [slab.narrow(2, t, c + 1) for t in range(L)]
    if R:
        slab = torch.cat([x.narrow(2, n - c, c), rh], 2)
        wins += [slab.narrow(2, t, c + 1) for t in range(R)]
    return torch.cat(wins, 0)


def _from_windows(y_win, L, R):
    """The windows' one-frame outputs as the (N, C, L, H, W) first and
    (N, C, R, H, W) last output frames (views)."""
    n_batch = y_win.shape[0] // (L + R)
    frames = y_win.view(L + R, n_batch, *y_win.shape[1:2], *y_win.shape[3:]).permute(1, 2, 0, 3, 4)
    return frames.narrow(2, 0, L), frames.narrow(2, L, R)


def _to_windows(grad, L, R):
    """The output gradient of the windows' frames, in the windows' order."""
    n = grad.shape[2]
    frames = torch.cat([grad.narrow(2, 0, L), grad.narrow(2, n - R, R)], 2)
    return frames.permute(2, 0, 1, 3, 4).reshape(-1, grad.shape[1], 1, *grad.shape[3:])


def _into_slabs(grad_win, L, R, x_shape):
    """The windows' input gradients summed into the left slab's (N, C, L + c,
    H, W) and the right slab's (N, C, c + R, H, W); None for a side with no
    halo."""
    c = L + R
    n_batch = x_shape[0]
    grad_win = grad_win.view(L + R, n_batch, *grad_win.shape[1:])
    slabs = []
    for first, count in ((0, L), (L, R)):
        if not count:
            slabs.append(None)
            continue
        slab = grad_win.new_zeros(_padded_frames(grad_win[0], count + c))
        for t in range(count):
            slab.narrow(2, t, c + 1).add_(grad_win[first + t])
        slabs.append(slab)
    return slabs


def _route(x, cfg, fused):
    """The halos-only Route of x for the layer, on x's device path. In the
    fused path the halo gradients are views of the slabs' input gradients,
    (N, C, L + c, H, W) and (N, C, c + R, H, W) contiguous tensors: a host
    plan is told so, and reads them where they are."""
    L, R = cfg.left, cfg.right
    grad_strides = None
    if fused:
        c = L + R
        grad_strides = (_contiguous_strides(_padded_frames(x, L + c)), _contiguous_strides(_padded_frames(x, c + R)),
                        strides_in_order(x.shape, dim_order(x)))
    return route(HALOS, x, L, R, 2, cfg.group, "zeros", grad_strides)


# ------------------------------------------------ strided, padded, tiled
# The general path: any stride, dilation and padding_mode, any set of
# sharded dims (a time axis over a group, H x W tiles over a grid). The
# input is padded with its halos by one out-of-place exchange per sharded
# dim (halocp.tile_halo_exchange's recipe), then convolved with torch's
# convolution; autograd runs the exchanges' backwards.
#
# Along a sharded dim with padding (pl, pr), stride s and kernel extent
# e = d(K-1), global output j reads inputs j*s - pl .. j*s - pl + e.
# Output j belongs to the rank whose shard holds input j*s (the last rank
# also takes any outputs past the end), so a rank with shard [a, a + n)
# computes outputs ceil(a/s) .. ceil((a+n)/s) - 1, and its first window
# starts (-a) mod s slices into [left halo | shard | right halo]. Halos of
# pl and max(e - pl, pr) are enough for every rank: the same sizes on all
# of them, as the exchange wants; what depends on a rank's offset (its
# phase and output count) is computed from a table of every rank's shard
# length, itself exchanged (see _ShardTable).


class _NoOutput(torch.autograd.Function):
    """An empty output that keeps the graph: its backward still runs this
    rank's part of the exchanges' backwards, which its peers wait for."""

    @staticmethod
    def forward(ctx, padded, weight, bias, shape, dtype):
        ctx.save_for_backward(padded, weight, bias)
        return padded.new_empty(shape, dtype=dtype)

    @staticmethod
    def backward(ctx, grad):
        padded, weight, bias = ctx.saved_tensors
        return (torch.zeros_like(padded), torch.zeros_like(weight),
                None if bias is None else torch.zeros_like(bias), None, None)


_CONV = {2: F.conv2d, 3: F.conv3d}

# torch's CPU conv3d (PyTorch 2.15, ConvParams::use_mkldnn) takes oneDNN for
# float32 with a batch of more than one, but for a batch of one with a 3x3
# (or smaller) kernel only when N*C*T*H passes this, and its unfolding
# kernel slow_conv3d otherwise: 10-15x slower forward and backward on one
# thread, and shards of a clip fall under it (LTX-Video's (1, 16, 35, 32, 32)
# with its halos: 130 ms a convolution and its backward, against 10 ms).
_ONEDNN_BATCH_ONE = 20480


def _takes_slow_conv3d(x, weight, stride, dilation, groups):
    """Whether torch would convolve x with slow_conv3d where a batch of two
    would take oneDNN (the rule above; a 1x1 spatial kernel on one thread
    takes slow_conv3d whatever the batch). Never in a traced graph: the
    compiler picks its kernels (and dynamo refuses the backend queries)."""
    if is_compiling():
        return False
    if x.dim() != 5 or x.shape[0] != 1 or x.device.type != "cpu" or groups != 1:
        return False
    if x.dtype != torch.float32 or weight.dtype != torch.float32 or torch.is_autocast_enabled("cpu"):
        return False
    if not torch.backends.mkldnn.is_available() or not torch.backends.mkldnn.enabled:
        return False
    kh, kw = weight.shape[3:]
    if kh == 1 and kw == 1 and torch.get_num_threads() == 1 and max(stride) == 1 and max(dilation) == 1:
        return False
    return not (kh > 3 and kw > 3) and x.shape[1] * x.shape[2] * x.shape[3] <= _ONEDNN_BATCH_ONE


def _halves(x, weight, stride, padding, dilation, groups):
    """(h, n_out, start, length) of _conv's two halves of x: h output
    frames each, the second's first 2h - n_out the first's last ones again,
    reading x[:length] and x[start:start + length]; None where x is not
    split (torch's own kernel is oneDNN already, or one output frame)."""
    if x.dim() != 5 or padding[0] != 0 or not _takes_slow_conv3d(x, weight, stride, dilation, groups):
        return None
    st, e = stride[0], dilation[0] * (weight.shape[2] - 1)
    n_out = (x.shape[2] - e - 1) // st + 1
    if n_out < 2:
        return None
    h = (n_out + 1) // 2  # outputs 0 .. h-1 and n_out-h .. n_out-1
    return h, n_out, (n_out - h) * st, (h - 1) * st + e + 1


def _conv_backward(grad, x, weight, stride, padding, dilation, groups, mask):
    """aten.convolution_backward(grad, x, weight, ...) without a bias
    gradient (None in its place), by _conv's halves where it splits x: the
    second half's repeated frames get no gradient, so that each output's
    counts once."""
    split = _halves(x, weight, stride, padding, dilation, groups)
    if split is None:
        return torch.ops.aten.convolution_backward(grad, x, weight, None, stride, padding, dilation, False,
                                                   [0] * len(stride), groups, mask)
    h, n_out, start, length = split
    halves = torch.cat([x.narrow(2, 0, length), x.narrow(2, start, length)], 0)
    grads = torch.cat([grad.narrow(2, 0, h), grad.narrow(2, n_out - h, h)], 0)
    grads[1:, :, :2 * h - n_out].zero_()
    grad_halves, grad_w, _ = torch.ops.aten.convolution_backward(
        grads, halves, weight, None, stride, padding, dilation, False, [0] * len(stride), groups, mask)
    grad_x = None
    if mask[0]:
        grad_x = grad_halves.new_zeros(x.shape)
        grad_x.narrow(2, 0, length).copy_(grad_halves[:1])
        grad_x.narrow(2, start, length).add_(grad_halves[1:])
    return grad_x, grad_w, None


def _conv(x, weight, bias, stride, padding, dilation, groups):
    """torch's convolution of x (2-d or 3-d by x), where a 3-d one would take
    slow_conv3d as two overlapping halves of its output frames, convolved
    as a batch of two (oneDNN's) and put back together: the same
    arithmetic per output, one output frame twice when their count is odd,
    a copy of the input and of the output more (_halves). Autograd's: the
    backward takes oneDNN too."""
    split = _halves(x, weight, stride, padding, dilation, groups)
    if split is None:
        return _CONV[x.dim() - 2](x, weight, bias, stride, padding, dilation, groups)
    h, n_out, start, length = split
    halves = torch.cat([x.narrow(2, 0, length), x.narrow(2, start, length)], 0)
    first, second = F.conv3d(halves, weight, bias, stride, padding, dilation, groups).unbind(0)
    return torch.cat([first, second.narrow(1, 2 * h - n_out, n_out - h)], 1).unsqueeze(0)


def _split_once(layer, name, dim, group, row):
    """_split, without the shard table once the ranks have agreed on this
    layer's convolution along dim where this rank's length alone decides
    its outputs: stride 1 and padding that keeps the count (every causal
    and centred conv) give each rank as many outputs as inputs, from phase
    0, so the table's one job left is the agreement, which a layer's
    arguments keep. The agreed rows are remembered on the layer, so every
    rank skips alike; a rank whose layer was changed since makes the table
    alone and its peers' exchange then fails with ERR_MISMATCH (a plan's
    identity), not a hang. One small collective less per conv and call:
    10 of Mochi's decoder's 11."""
    _, k, s, dil, pl, pr = row
    if s != 1 or pl + pr != dil * (k - 1):
        return _split(name, dim, group, row)
    agreed = layer.__dict__.setdefault("_halocp_agreed", set())
    key = (id(group), dim, *row[1:])  # an id, not the group: deepcopy copies the set
    if key in agreed:
        return 0, row[0]
    out = _split(name, dim, group, row)
    agreed.add(key)
    return out


def _sharded_conv(layer, x, pads, sharded, name=None):
    """layer's convolution of shard x: pads is (left, right) padding per
    spatial dim, sharded maps a spatial dim to the group it is sharded over
    (the others are local, padded here); name, the layer's in messages
    (its type's by default)."""
    nsp = x.dim() - 2
    modes = _padding_modes(layer, nsp)
    exchanges = []  # (dim, group, left halo, right halo, this rank's row of the shard table)
    for i in sorted(sharded):
        k, s, dil = layer.kernel_size[i], layer.stride[i], layer.dilation[i]
        pl, pr = pads[i]
        e = dil * (k - 1)
        exchanges.append((2 + i, sharded[i], pl, max(e - pl, pr, 0), [x.shape[2 + i], k, s, dil, pl, pr]))
    dims = [dim for dim, *_ in exchanges]
    local = [pads[i] if i not in sharded else (0, 0) for i in range(nsp)]
    zeros = all(m == "zeros" for (l, r), m in zip(local, modes) if l or r)
    conv_padding = [l for l, r in local] if zeros and all(l == r for l, r in local) else [0] * nsp
    conv = (list(layer.stride), conv_padding, list(layer.dilation), layer.groups)
    name = name or type(layer).__name__
    # Every call, even where the split could be known locally (stride 1,
    # as many outputs as inputs): whether to exchange must not depend on
    # what the ranks may disagree on.
    if is_compiling() and exchanges:
        # Each rank's output count is data (the other ranks' lengths): ops
        # whose fake implementations give it as an unbacked size (below).
        splits = [torch.ops.halocp.conv_split(x, dim, row, _token(group), name) for dim, group, _, _, row in exchanges]
        for dim, group, left, right, _ in exchanges:
            x = cp_halo_exchange(x, left, right, dim, group, modes[dim - 2])
        x = _pad_locally(x, local, conv_padding, modes)
        places = [v for _, group, _, _, row in exchanges for v in (*row, *reversed(world_and_rank(group)))]
        return torch.ops.halocp.window_conv(x, layer.weight, layer.bias, torch.stack(splits), dims, *conv, places)
    splits = [_split_once(layer, name, dim, group, row) for dim, group, _, _, row in exchanges]
    for dim, group, left, right, _ in exchanges:
        x = cp_halo_exchange(x, left, right, dim, group, modes[dim - 2])
    x = _pad_locally(x, local, conv_padding, modes)
    window, out_shape = _conv_window(x, layer.weight, splits, dims, *conv[:3])
    if window is None:
        dtype = result_dtype(lambda p: _CONV[nsp](p, layer.weight, layer.bias, *conv), x, layer.weight.shape[2:],
                             layer.dilation)
        return _NoOutput.apply(x, layer.weight, layer.bias, out_shape, dtype)
    return _conv(window, layer.weight, layer.bias, *conv)


def _padding_modes(layer, nsp):
    """The padding mode of each spatial dim: a 3-d layer's temporal one
    (``temporal_padding_mode``) for its first, ``padding_mode`` for the rest."""
    modes = [layer.padding_mode] * nsp
    temporal = getattr(layer, "temporal_padding_mode", None)
    if nsp == 3 and temporal is not None:
        modes[0] = temporal
    return modes


def _pad_locally(x, local, conv_padding, modes):
    """x padded along its local dims, where the convolution does not pad
    them itself, time first (as the models that pad time and space
    differently do: the spatial padding covers the padded frames). After the
    exchanges, which it commutes with (the halos of a padded shard are the
    padded halos), so that the tensor's length along a sharded dim is the
    shard's plus its halos: never 0 where there are halos, even when it is
    data to a traced graph."""
    if not any(l or r for l, r in local) or any(conv_padding):
        return x
    # One F.pad per run of dims that share a mode, the first dims first.
    runs = []
    for i, ((l, r), m) in enumerate(zip(local, modes)):
        if l or r:
            if runs and runs[-1][0] == m:
                runs[-1][1].append(i)
            else:
                runs.append((m, [i]))
    for mode, dims in runs:
        # torch pads an empty tensor only with a constant (and an empty shard
        # has no values to pad with). Under torch.compile an unbacked length
        # (a previous layer's output count) is taken as not 0: an empty shard
        # with no halos would fail here.
        constant = mode == "zeros" or known(x.numel() == 0, False)
        # Every spatial dim named (0 where this run does not pad): torch's
        # non-constant modes take all of them or the last ones only.
        pads = [p for i in reversed(range(len(local))) for p in (local[i] if i in dims else (0, 0))]
        x = F.pad(x, pads, "constant" if constant else mode)
    return x


def _conv_window(padded, weight, splits, dims, stride, padding, dilation):
    """(window, output shape): the part of padded (the shard with its halos
    along dims, split there as splits says) that this rank's outputs read,
    None when it has no outputs, and the shape of those outputs."""
    shape = _output_shape(padded, weight, dims, stride, padding, dilation)
    for dim, (_, count) in zip(dims, splits):
        shape[dim] = count
    if 0 in shape:
        return None, shape
    for dim, (phase, count) in zip(dims, splits):
        e = dilation[dim - 2] * (weight.shape[dim] - 1)
        padded = padded.narrow(dim, phase, (count - 1) * stride[dim - 2] + e + 1)
    return padded, shape


def _output_shape(x, weight, dims, stride, padding, dilation):
    """The shape of conv(x) (torch's formula), but for dims (None there)."""
    shape = [x.shape[0], weight.shape[0]]
    for i in range(x.dim() - 2):
        e = dilation[i] * (weight.shape[2 + i] - 1)
        shape.append(None if 2 + i in dims else max((x.shape[2 + i] + 2 * padding[i] - e - 1) // stride[i] + 1, 0))
    return shape


# ------------------------------------- the general path's torch.library ops
# For torch.compile (exchange.py says why ops). A strided or padded layer's
# output count along a sharded dim depends on every rank's shard length,
# data to a traced graph: given as an unbacked size (new_dynamic_size, which
# dynamo allows under fullgraph=True). Each op runs the eager path's own
# functions (_split, _conv_window), so both paths compute the same split.
# conv_split exchanges the lengths (and checks that the ranks agree, before
# any halo travels, as the eager path does) and gives this rank's (phase,
# count) as a tensor; window_conv convolves the window of the exchanged
# shard that its outputs read, its fake giving the count as an unbacked
# size. window_conv's backward is local: the exchanges' backwards (their own
# ops) return the halos' gradients, on every rank, a rank with no outputs
# included.


def _count_bounds(places):
    """(fewest, most) output counts per sharded dim that this rank's own
    length and place allow (_splits.count_bounds), from window_conv's
    ``places`` (per dim: the shard table's row, this rank and the group's
    size; none: not bounded): a count they decide is a plain size to the
    graph, not an unbacked one (the norms and reshapes of a whole model
    after the layer then see what they would eagerly; inductor's
    decompositions guard on unbacked sizes, Eq(u, 0)). (0, -1), unbounded,
    for a length that is symbolic. Run in the fake, where a size's type
    tells whether the graph knows it (dynamo's trace takes a SymInt for an int)."""
    out = []
    for i in range(0, len(places), 8):
        n, k, s, dil, pl, pr, rank, world = places[i:i + 8]
        if not isinstance(n, int) or isinstance(n, torch.SymInt):
            out.append((0, -1))
            continue
        lo, hi = _count_bounds_of(s, dil * (k - 1), pl, pr, n, rank, world)
        out.append((lo, hi))
    return out


@torch.library.custom_op("halocp::conv_split", mutates_args=())
def _conv_split_op(x: Tensor, dim: int, row: list[int], group: str, layer: str) -> Tensor:
    return torch.tensor(_split(layer, dim, token_group(group), row), dtype=torch.int64)


@_conv_split_op.register_fake
def _(x, dim, row, group, layer):
    return torch.empty(2, dtype=torch.int64)


@torch.library.custom_op("halocp::window_conv", mutates_args=())
def _window_conv_op(padded: Tensor, weight: Tensor, bias: Tensor | None, splits: Tensor, dims: list[int],
                    stride: list[int], padding: list[int], dilation: list[int], groups: int,
                    places: list[int]) -> Tensor:
    splits = splits.tolist()
    for dim, (_, count), (lo, hi) in zip(dims, splits, _count_bounds(places)):
        if count < lo or 0 <= hi < count:  # the fake told the graph otherwise: a bug, not bad input
            raise HaloError(_lib.ERR_INTERNAL, f"halocp.nn: {count} outputs along dim {dim}, outside the "
                            f"{lo}..{hi} that the traced graph was given")
    window, shape = _conv_window(padded, weight, splits, dims, stride, padding, dilation)
    strides = strides_in_order(shape, dim_order(padded))
    if window is None:
        return torch.empty_strided(shape, strides, dtype=padded.dtype, device=padded.device)
    y = _CONV[padded.dim() - 2](window, weight, bias, stride, padding, dilation, groups)
    return in_strides(y, strides)


@_window_conv_op.register_fake
def _(padded, weight, bias, splits, dims, stride, padding, dilation, groups, places):
    shape = _output_shape(padded, weight, dims, stride, padding, dilation)
    ctx = torch.library.get_ctx()
    bounds = _count_bounds(places) if places else [(0, -1)] * len(dims)
    for dim, (lo, hi) in zip(dims, bounds):
        shape[dim] = lo if lo == hi else ctx.new_dynamic_size(min=lo, max=None if hi < 0 else hi)
    return empty_in_order(shape, dim_order(padded), padded.dtype, padded.device)


@torch.library.custom_op("halocp::window_conv_backward", mutates_args=())
def _window_conv_backward_op(grad: Tensor, padded: Tensor, weight: Tensor, splits: Tensor, dims: list[int],
                             stride: list[int], padding: list[int], dilation: list[int], groups: int,
                             mask: list[bool]) -> tuple[Tensor, Tensor, Tensor]:
    splits = splits.tolist()
    window, _ = _conv_window(padded, weight, splits, dims, stride, padding, dilation)
    grad_padded = torch.zeros_like(padded) if mask[0] else padded.new_empty(0)
    if window is None:  # no outputs: zeros, as _NoOutput's
        grad_w = torch.zeros_like(weight) if mask[1] else weight.new_empty(0)
        return grad_padded, grad_w, weight.new_zeros(weight.shape[0] if mask[2] else 0)
    bias_sizes = [weight.shape[0]] if mask[2] else None
    grad_window, grad_w, grad_b = torch.ops.aten.convolution_backward(
        grad, window, weight, bias_sizes, stride, padding, dilation, False, [0] * len(stride), groups, mask)
    if mask[0]:
        _conv_window(grad_padded, weight, splits, dims, stride, padding, dilation)[0].copy_(grad_window)
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
    ctx.conv = inputs[4:-1]
    ctx.has_bias = bias is not None


def _window_conv_grad(ctx, grad):
    padded, weight, splits = ctx.saved_tensors
    mask = [ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.has_bias and ctx.needs_input_grad[2]]
    grads = torch.ops.halocp.window_conv_backward(grad, padded, weight, splits, *ctx.conv, mask)
    return tuple(g if m else None for g, m in zip(grads, mask)) + (None,) * 7


_window_conv_op.register_autograd(_window_conv_grad, setup_context=_save_window)


def _check_input(layer, x, nsp):
    names = {2: "(N, C, H, W)", 3: "(N, C, T, H, W)"}[nsp]
    if not isinstance(x, torch.Tensor) or x.dim() not in (nsp + 1, nsp + 2) or x.shape[-nsp - 1] != layer.in_channels:
        what = f"shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise HaloError(_lib.ERR_INVALID_ARGUMENT,
                        f"halocp.nn: {type(layer).__name__} wants {names} input with C = {layer.in_channels} "
                        f"(or unbatched), not {what}")


class _ContextParallelConv3d(torch.nn.Conv3d):
    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1, groups=1,
                 bias=True, padding_mode="zeros", device=None, dtype=None, *, group=None, grid=None,
                 temporal_padding_mode=None):
        if temporal_padding_mode not in (None, "zeros", "reflect", "replicate", "circular"):
            raise ValueError(f"temporal_padding_mode must be one of zeros, reflect, replicate or circular (or None: "
                             f"padding_mode's), not {temporal_padding_mode!r}")
        st, sh, sw = _temporal_and_spatial(stride, "stride", 1)
        ph, pw = _pair(padding, "padding")
        super().__init__(in_channels, out_channels, kernel_size, stride=(st, sh, sw), padding=(0, ph, pw),
                         dilation=dilation, groups=groups, bias=bias, padding_mode=padding_mode, device=device,
                         dtype=dtype)
        self.group = group
        self.temporal_padding_mode = temporal_padding_mode or padding_mode
        self.left, self.right = self._halo(self.dilation[0] * (self.kernel_size[0] - 1))
        self.grid = grid
        if grid is not None:
            if group is not None:
                raise ValueError("a layer is sharded over a group (its time axis) or a grid (T x H x W), not both")
            _TiledConv._check_grid(self, grid, 3)

    def _halo(self, context: int) -> tuple[int, int]:
        raise NotImplementedError

    def _pads(self):
        return [(self.left, self.right)] + [(p, p) for p in self.padding[1:]]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        halo = self.left or self.right
        if self.grid is None and not distributed(self.group):  # one process holds the whole sequence
            return _sharded_conv(self, x, self._pads(), {})
        _check_input(self, x, 3)
        if x.dim() == 4:  # unbatched
            return self.forward(x.unsqueeze(0)).squeeze(0)
        if self.grid is not None:
            return _sharded_conv(self, x, self._pads(), _tiled_dims(self.grid))
        if self.stride[0] != 1 or self.padding_mode != "zeros" or self.temporal_padding_mode != "zeros":
            return _sharded_conv(self, x, self._pads(), {0: self.group})
        if is_compiling():
            return self._compiled_stride_1(x)
        # The fused path's exchange takes x's device path, as every exchange does.
        if not halo and x.shape[-3]:  # a kernel one frame long needs no context
            return F.conv3d(x, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups)
        return _ContextParallelConv.apply(*_autocast_inputs(x, self.weight, self.bias), _Config(self))

    def _compiled_stride_1(self, x):
        """What torch.compile traces of a stride-1, zero-padded layer: the
        exchange's custom op, then torch's convolution of the padded shard
        (conv3d with no temporal padding). A length that is data to the
        graph (a strided layer's output) has the convolution inside
        window_conv, which minds an empty window (and inductor lowers a
        convolution only over sizes it has a hint for); its split is known
        locally (each rank's outputs are its inputs' frames), so that every
        rank runs the same exchanges whichever of its lengths the graph
        knows (a rank's strided output count can be decided on one rank and
        data on another: _count_bounds)."""
        n = x.shape[2]
        empty = known(n == 0, False)
        x = cp_halo_exchange(x, self.left, self.right, 2, self.group)
        if not empty and known(n == 0, True):
            splits = torch.stack([torch.zeros((), dtype=torch.int64), torch.scalar_tensor(n, dtype=torch.int64)])
            conv = (list(self.stride), list(self.padding), list(self.dilation), self.groups)
            y = torch.ops.halocp.window_conv(x, self.weight, self.bias, splits.view(1, 2), [2], *conv, [])
            torch._check(y.shape[2] == n)
            return y
        if empty:  # no output frames, but the graph that runs the exchange's backward
            x = F.pad(x, (0, 0, 0, 0, 0, 1))
        y = F.conv3d(x, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups)
        return y[:, :, :0] if empty else y

    def extra_repr(self) -> str:
        grid = "" if self.grid is None else f", grid={'x'.join(map(str, self.grid.shape))}"
        mode = "" if self.temporal_padding_mode == self.padding_mode else \
            f", temporal_padding_mode={self.temporal_padding_mode}"
        return super().extra_repr() + f", temporal halo=({self.left}, {self.right})" + mode + grid


def _temporal_and_spatial(v, name, temporal_default):
    """(t, h, w) from a (t, h, w) triple, or from an int or (h, w) pair that
    is spatial only (the layers' signature before temporal strides)."""
    if not isinstance(v, int) and len(tuple(v)) == 3:
        return tuple(v)
    return (temporal_default,) + _pair(v, name)


class CausalConv3d(_ContextParallelConv3d):
    """A causal temporal Conv3d over a time axis sharded across ``group``.

    Output frame t sees input frames t-(K-1)d .. t only: every rank fetches
    the ``d*(K-1)`` frames before its shard (zeros before the sequence
    starts), K and d being the temporal kernel size and dilation. The output
    has as many frames as the input shard. ``padding`` is spatial (an int or
    a (height, width) pair); so is ``stride`` as an int or a pair, while a
    ``(t, h, w)`` triple also sets a temporal stride s: global output frame j
    reads inputs j*s - (K-1)d .. j*s and is computed by the rank whose shard
    holds input j*s, so a shard of n frames at global offset a gives
    ceil((a+n)/s) - ceil(a/s) frames (none, if no j*s falls in it). Each
    rank's offset comes from one small exchange of every rank's shard length
    per call (on every path but the fused one below), which also checks
    that the ranks agree on the convolution (``HaloError(ERR_MISMATCH)``
    otherwise). ``padding_mode`` is torch's
    ("zeros", "reflect", "replicate", "circular"), at the spatial borders
    and, unless ``temporal_padding_mode`` (one of the same) says otherwise,
    at the ends of the sequence (CogVideoX and LTX-Video replicate in time
    and pad space with zeros: ``temporal_padding_mode="replicate"``). Time
    is padded first, so the spatial padding covers the padded frames. ``group=None`` means the default
    process group, or, when torch.distributed is not initialised, one
    process with the whole sequence. ``grid=`` (a 3-d :class:`halocp.TileGrid`,
    instead of ``group``) tiles T x H x W as :class:`TiledConv3d` does, for
    a causal video VAE tiled over H x W, say.

    A temporal stride of 1 with zero padding takes the fused path (the
    halos travel while the shard is convolved, no padded copy); the other
    configurations pad the shard with ``cp_halo_exchange`` and convolve it.
    """

    def _halo(self, context):
        return context, 0


class CenteredConv3d(_ContextParallelConv3d):
    """A centred ("same") temporal Conv3d over a time axis sharded across
    ``group``: output frame t sees input frames t-(K-1)d/2 .. t+(K-1)d/2,
    padding (``padding_mode``) beyond the ends of the sequence. ``(K-1)*d``
    must be even. Otherwise as :class:`CausalConv3d` (with a temporal stride
    s, output j reads inputs j*s - (K-1)d/2 .. j*s + (K-1)d/2).
    """

    def _halo(self, context):
        if context % 2:
            raise ValueError(f"a centred temporal kernel needs an even context (K-1)*dilation, not {context}")
        return context // 2, context // 2


def _tiled_dims(grid):
    """The sharded spatial dims of a grid: those over more than one rank."""
    return {i: g for i, (n, g) in enumerate(zip(grid.shape, grid.groups)) if n > 1}


class _TiledConv:
    """The forward of TiledConv2d and TiledConv3d: every spatial dim tiled
    over a grid dim of more than one rank is sharded; the others are local."""

    def _check_grid(self, grid, nsp):
        if not isinstance(grid, TileGrid) or len(grid.shape) != nsp:
            raise HaloError(_lib.ERR_INVALID_ARGUMENT,
                            f"halocp.nn: {type(self).__name__} wants a halocp.TileGrid of {nsp} dims (one per spatial "
                            f"dim, 1 where a dim is not tiled), not {grid!r}")
        self.grid = grid

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        nsp = len(self.kernel_size)
        _check_input(self, x, nsp)
        if x.dim() == nsp + 1:  # unbatched
            return self.forward(x.unsqueeze(0)).squeeze(0)
        p = self._reversed_padding_repeated_twice  # (left, right) per spatial dim, last dim first
        pads = [(p[2 * (nsp - 1 - i)], p[2 * (nsp - 1 - i) + 1]) for i in range(nsp)]
        return _sharded_conv(self, x, pads, _tiled_dims(self.grid))

    def extra_repr(self) -> str:
        return super().extra_repr() + f", grid={'x'.join(map(str, self.grid.shape))}"


class TiledConv2d(_TiledConv, torch.nn.Conv2d):
    """``torch.nn.Conv2d`` over an ``(N, C, H, W)`` activation tiled over
    ``grid``, a :class:`halocp.TileGrid` of shape ``(ranks along H, ranks
    along W)`` (1 where a dim is not tiled), for spatially parallel work such
    as a VAE's decoder.

    Each rank holds one tile; the layer fetches its halos, corners included,
    with :func:`halocp.tile_halo_exchange`'s recipe, and convolves, so that
    the tiles of the outputs put together, the input gradients, and the
    weight and bias gradients summed over the grid are those of the same
    ``Conv2d`` on the whole tensor. Every argument of ``Conv2d`` is
    supported: ``stride`` (output j of a tiled dim is computed by the rank
    whose tile holds input j * stride, so tiles need not be multiples of the
    stride), ``dilation``, ``padding`` (ints or "same"/"valid"), ``groups``
    and ``padding_mode``. Tiles may be uneven.
    """

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1, groups=1,
                 bias=True, padding_mode="zeros", device=None, dtype=None, *, grid):
        torch.nn.Conv2d.__init__(self, in_channels, out_channels, kernel_size, stride, padding, dilation, groups,
                                 bias, padding_mode, device, dtype)
        self._check_grid(grid, 2)


class TiledConv3d(_TiledConv, torch.nn.Conv3d):
    """``torch.nn.Conv3d`` over an ``(N, C, T, H, W)`` activation tiled over
    ``grid``, a :class:`halocp.TileGrid` of shape ``(ranks along T, along H,
    along W)``: T x H x W tiles, or H x W tiles with a grid of shape
    ``(1, h, w)``. Otherwise as :class:`TiledConv2d`.
    """

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1, groups=1,
                 bias=True, padding_mode="zeros", device=None, dtype=None, *, grid):
        torch.nn.Conv3d.__init__(self, in_channels, out_channels, kernel_size, stride, padding, dilation, groups,
                                 bias, padding_mode, device, dtype)
        self._check_grid(grid, 3)


# Layers that live in modules of their own (issue 21), exported here with the others.
from .norm import GroupNorm  # noqa: E402
from .pool import AvgPool3d, MaxPool3d  # noqa: E402


class _Averaging:
    """AvgPool3d as the depthwise convolution that the compiled general path
    runs (its split, exchange and ops): a constant weight of 1/divisor per
    channel, no bias, zeros padded (counted in the divisor, as
    count_include_pad=True counts them)."""

    padding_mode = temporal_padding_mode = "zeros"
    bias = None

    def __init__(self, pool, x):
        k, divisor = pool._k, pool.divisor_override or pool._k[0] * pool._k[1] * pool._k[2]
        self.kernel_size, self.stride, self.dilation, self.groups = k, pool._s, (1, 1, 1), x.shape[1]
        self.weight = torch.full((x.shape[1], 1, *k), 1.0 / divisor, dtype=x.dtype, device=x.device)


def _compiled_average(pool, x):
    """AvgPool3d under torch.compile: the same sums as a convolution (in
    another order: to rounding), whose output count along time the compiled
    path's ops give, as for a strided CausalConv3d. Installed here, since
    pool.py is imported by this module."""
    if not pool.count_include_pad and (pool._p[1] or pool._p[2]):
        raise HaloError(_lib.ERR_INVALID_ARGUMENT,
                        "halocp.nn: AvgPool3d with count_include_pad=False and spatial padding does not compile "
                        "yet; wrap it in torch.compiler.disable")
    return _sharded_conv(_Averaging(pool, x), x, [(p, p) for p in pool._p], {0: pool.group}, name="AvgPool3d")


AvgPool3d._compiled = _compiled_average
from .transpose import ConvTranspose3d  # noqa: E402

__all__ += ["GroupNorm", "ConvTranspose3d", "AvgPool3d", "MaxPool3d"]
