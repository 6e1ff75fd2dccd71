"""Context-parallel temporal convolutions: the halo exchange and the
convolution in one layer.

Each rank holds a shard of the time axis of an ``(N, C, T, H, W)`` input
(or unbatched ``(C, T, H, W)``); the layer fetches the context its kernel
needs from the neighbouring ranks and convolves, so that the concatenation of
the ranks' outputs, and every gradient, is that of the same convolution over
the full sequence. Weight gradients are per rank, as with any data-parallel
layer: sum them over the group (DDP and FSDP do).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .exchange import cp_halo_exchange

__all__ = ["CausalConv3d", "CenteredConv3d"]


def _pair(v, name):
    if isinstance(v, int):
        return (v, v)
    v = tuple(v)
    if len(v) != 2:
        raise ValueError(f"{name} is spatial (height, width): an int or a pair, not {v!r}")
    return v


class _ContextParallelConv3d(torch.nn.Conv3d):
    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1, groups=1,
                 bias=True, device=None, dtype=None, *, group=None):
        sh, sw = _pair(stride, "stride")
        ph, pw = _pair(padding, "padding")
        super().__init__(in_channels, out_channels, kernel_size, stride=(1, sh, sw), padding=(0, ph, pw),
                         dilation=dilation, groups=groups, bias=bias, device=device, dtype=dtype)
        self.group = group
        self.left, self.right = self._halo(self.dilation[0] * (self.kernel_size[0] - 1))

    def _halo(self, context: int) -> tuple[int, int]:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time = x.dim() - 3  # (N, C, T, H, W) or (C, T, H, W)
        if self.group is not None or (dist.is_available() and dist.is_initialized()):
            x = cp_halo_exchange(x, self.left, self.right, time, self.group)
        elif self.left or self.right:  # one process holds the whole sequence
            x = F.pad(x, (0, 0, 0, 0, self.left, self.right))
        return F.conv3d(x, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", temporal halo=({self.left}, {self.right})"


class CausalConv3d(_ContextParallelConv3d):
    """A causal temporal Conv3d over a time axis sharded across ``group``.

    Output frame t sees input frames t-(K-1)d .. t only: every rank fetches
    the ``d*(K-1)`` frames before its shard (zeros before the sequence
    starts), K and d being the temporal kernel size and dilation. The output
    has as many frames as the input shard. ``stride`` and ``padding`` are
    spatial (an int or a (height, width) pair); the temporal stride is 1.
    ``group=None`` means the default process group, or, when
    torch.distributed is not initialised, one process with the whole sequence.
    """

    def _halo(self, context):
        return context, 0


class CenteredConv3d(_ContextParallelConv3d):
    """A centred ("same") temporal Conv3d over a time axis sharded across
    ``group``: output frame t sees input frames t-(K-1)d/2 .. t+(K-1)d/2,
    zeros beyond the ends of the sequence. ``(K-1)*d`` must be even.
    Otherwise as :class:`CausalConv3d`.
    """

    def _halo(self, context):
        if context % 2:
            raise ValueError(f"a centred temporal kernel needs an even context (K-1)*dilation, not {context}")
        return context // 2, context // 2
