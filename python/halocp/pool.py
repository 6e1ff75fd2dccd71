"""Pooling over a time axis sharded across a group: a video VAE's temporal
downsampling by averaging (CogVideoX averages pairs of frames) or by max.

Output frame j pools input frames j*s - p .. j*s - p + d(K-1) and is
computed by the rank whose shard holds input j*s, as for halocp.nn's strided
convolutions (the same split, from the same small exchange of every rank's
shard length, which also checks that the ranks agree on the window). The
frames a window needs from other ranks come with cp_halo_exchange: zeros
beyond the ends for averaging (torch's padding, counted in the divisor),
-inf there for max, as torch pads (the zeros the exchange gives beyond the
ends replaced, so no gradient flows into them).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import _lib
from ._lib import HaloError
from ._shapes import is_compiling, result_dtype
from ._sharding import distributed, world_and_rank
from ._splits import split_and_lengths
from .exchange import cp_halo_exchange

__all__ = ["AvgPool3d", "MaxPool3d"]


def _triple(v):
    return tuple(v) if isinstance(v, (tuple, list)) else (v, v, v)


class _Empty(torch.autograd.Function):
    """No output frames on this rank, but the graph that runs its part of
    the exchange's backward, which its peers wait for."""

    @staticmethod
    def forward(ctx, padded, shape, dtype):
        ctx.save_for_backward(padded)
        return padded.new_empty(shape, dtype=dtype)

    @staticmethod
    def backward(ctx, grad):
        (padded,) = ctx.saved_tensors
        return torch.zeros_like(padded), None, None


class _ShardedPool:
    """What the two layers share: the checks, the split, the exchange."""

    def _setup(self, group, dilation):
        k, s, p = _triple(self.kernel_size), _triple(self.stride or self.kernel_size), _triple(self.padding)
        if self.ceil_mode:
            raise ValueError(f"halocp.nn.{type(self).__name__}: ceil_mode is for one process (an output count "
                             f"that rounds up depends on the whole clip's end); pad instead")
        self.group, self._k, self._s, self._p, self._d = group, k, s, p, _triple(dilation)
        e = self._d[0] * (k[0] - 1)
        if 2 * p[0] > e + 1:  # torch's rule, checked here, not at the first call
            raise ValueError(f"halocp.nn.{type(self).__name__}: temporal padding {p[0]} is more than half the "
                             f"temporal window ({e + 1} frames)")
        self.left, self.right = p[0], max(e - p[0], p[0], 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not distributed(self.group):
            return super().forward(x)
        name = type(self).__name__
        if not isinstance(x, torch.Tensor) or x.dim() not in (4, 5):
            what = f"shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
            raise HaloError(_lib.ERR_INVALID_ARGUMENT,
                            f"halocp.nn: {name} on rank {world_and_rank(self.group)[1]} wants (N, C, T, H, W) "
                            f"input (or unbatched), not {what}")
        if x.dim() == 4:
            return self.forward(x.unsqueeze(0)).squeeze(0)
        if is_compiling():
            return self._compiled(x)
        k, s, p, d = self._k, self._s, self._p, self._d
        e = d[0] * (k[0] - 1)
        row = [x.shape[2], k[0], s[0], d[0], p[0], p[0]]
        phase, count, lengths = split_and_lengths(name, 2, self.group, row, "window")
        padded = cp_halo_exchange(x, self.left, self.right, 2, self.group)
        if self._beyond is not None:
            # The slots outside the clip: global frames < 0 and >= its length.
            rank = world_and_rank(self.group)[1]
            first = sum(lengths[:rank]) - self.left
            t = torch.arange(first, first + padded.shape[2], device=x.device)
            outside = ((t < 0) | (t >= sum(lengths))).view(1, 1, -1, 1, 1)
            if bool(outside.any()):
                padded = padded.masked_fill(outside, self._beyond)
        if count == 0:
            shape = list(x.shape[:2]) + [0] + [max((x.shape[3 + i] + 2 * p[1 + i] - d[1 + i] * (k[1 + i] - 1) - 1)
                                                   // s[1 + i] + 1, 0) for i in range(2)]
            dtype = result_dtype(lambda w: self._pool(w, k, s, (0, p[1], p[2])), padded, k, d)
            return _Empty.apply(padded, shape, dtype)
        return self._pool(padded.narrow(2, phase, (count - 1) * s[0] + e + 1), k, s, (0, p[1], p[2]))

    def _compiled(self, x):
        raise HaloError(_lib.ERR_INVALID_ARGUMENT,
                        f"halocp.nn: {type(self).__name__} over a sharded time axis does not compile yet (its output "
                        f"length is data to the graph); wrap it in torch.compiler.disable")

    def extra_repr(self) -> str:
        return super().extra_repr() + f", temporal halo=({self.left}, {self.right})"


class AvgPool3d(_ShardedPool, torch.nn.AvgPool3d):
    """``torch.nn.AvgPool3d`` over an ``(N, C, T, H, W)`` input (or
    unbatched) whose T is sharded across ``group`` in rank order, shards of
    any length (0 included). Every argument is torch's; the temporal
    padding is zeros counted in the divisor, so ``count_include_pad=False``
    needs no temporal padding, and ``ceil_mode`` is refused. The ranks'
    outputs put together, and the input gradients, are torch's over the
    whole clip. ``group=None``: the default group, or one process with the
    whole clip when torch.distributed is not initialised."""

    _beyond = None  # the exchange's zeros

    def __init__(self, kernel_size, stride=None, padding=0, ceil_mode=False, count_include_pad=True,
                 divisor_override=None, *, group=None):
        super().__init__(kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)
        self._setup(group, 1)
        if not count_include_pad and self._p[0]:
            raise ValueError("halocp.nn.AvgPool3d: count_include_pad=False with temporal padding: the frames "
                             "beyond the clip's ends are zeros from the exchange, counted in the divisor")

    def _pool(self, window, k, s, padding):
        return F.avg_pool3d(window, k, s, padding, False, self.count_include_pad, self.divisor_override)

    # _compiled (under torch.compile): halocp.nn's, which runs the average as its convolution.


class MaxPool3d(_ShardedPool, torch.nn.MaxPool3d):
    """``torch.nn.MaxPool3d`` over an ``(N, C, T, H, W)`` input (or
    unbatched) whose T is sharded across ``group``, as :class:`AvgPool3d`;
    dilation included, ``return_indices`` and ``ceil_mode`` refused (indices
    into a shard would not be torch's into the clip)."""

    _beyond = float("-inf")

    def __init__(self, kernel_size, stride=None, padding=0, dilation=1, return_indices=False, ceil_mode=False, *,
                 group=None):
        if return_indices:
            raise ValueError("halocp.nn.MaxPool3d: return_indices is for one process (indices into a shard are "
                             "not the clip's)")
        super().__init__(kernel_size, stride, padding, dilation, return_indices, ceil_mode)
        self._setup(group, dilation)

    def _pool(self, window, k, s, padding):
        return F.max_pool3d(window, k, s, padding, self._d, False)
