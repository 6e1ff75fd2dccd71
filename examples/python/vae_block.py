"""A causal video VAE's encoder and decoder blocks (in the style of
CogVideoX's and Wan's), context-parallel along time with halocp.nn.

Each rank holds a run of frames (any length, 0 included); the blocks give
each rank its part of what the same blocks give on one process, and every
gradient. The same classes build both: ``group=None`` uses torch's layers
(one process holds the whole clip), a process group uses halocp.nn's.

    torchrun --nproc-per-node 2 examples/python/vae_block.py

runs both on an uneven split of one clip and prints the largest difference.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import halocp.nn


class _CausalConv3d(nn.Conv3d):
    """One process's causal Conv3d: (K-1)*d frames of padding before the
    clip, ``padding`` at the spatial borders, all in ``padding_mode``
    (halocp.nn.CausalConv3d's semantics)."""

    def __init__(self, cin, cout, kernel_size, stride=1, padding=0, padding_mode="zeros"):
        super().__init__(cin, cout, kernel_size, stride)
        k, d = self.kernel_size[0], self.dilation[0]
        self.pads = (padding, padding, padding, padding, d * (k - 1), 0)
        self.mode = "constant" if padding_mode == "zeros" else padding_mode

    def forward(self, x):
        return super().forward(F.pad(x, self.pads, self.mode))


class Layers:
    """The layers of the blocks: torch's on one process (``group=None``),
    halocp.nn's over a time axis sharded across ``group``."""

    def __init__(self, group=None, padding_mode="replicate"):
        self.group, self.mode = group, padding_mode

    def causal_conv(self, cin, cout, kernel_size=3, stride=1, padding=1):
        if self.group is None:
            return _CausalConv3d(cin, cout, kernel_size, stride, padding, self.mode)
        s = stride if isinstance(stride, tuple) else (stride,) * 3
        return halocp.nn.CausalConv3d(cin, cout, kernel_size, stride=s, padding=padding, padding_mode=self.mode,
                                      group=self.group)

    def norm(self, channels, groups):
        if self.group is None:
            return nn.GroupNorm(groups, channels)
        return halocp.nn.GroupNorm(groups, channels, group=self.group)

    def upsample(self, cin, cout):
        """x2 in T, H and W: a transposed conv, kernel 4, stride 2, padding 1."""
        if self.group is None:
            return nn.ConvTranspose3d(cin, cout, 4, stride=2, padding=1)
        return halocp.nn.ConvTranspose3d(cin, cout, 4, stride=2, padding=1, group=self.group)


class ResnetBlock(nn.Module):
    """GroupNorm, SiLU, causal conv, twice, plus the (1x1x1-projected) input."""

    def __init__(self, layers, cin, cout, groups):
        super().__init__()
        self.norm1, self.conv1 = layers.norm(cin, groups), layers.causal_conv(cin, cout)
        self.norm2, self.conv2 = layers.norm(cout, groups), layers.causal_conv(cout, cout)
        # A 1x1x1 convolution needs no context, but torch's refuses an
        # empty shard: halocp's takes it.
        self.skip = layers.causal_conv(cin, cout, 1, padding=0) if cin != cout else nn.Identity()

    def forward(self, x):
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))
        return self.skip(x) + h


class EncoderBlock(nn.Module):
    """A ResNet block, then /2 in T, H and W by a causal conv of stride 2
    (output frame j sees input frames 2j-2 .. 2j)."""

    def __init__(self, layers, cin, cout, groups=2):
        super().__init__()
        self.resnet = ResnetBlock(layers, cin, cout, groups)
        self.down = layers.causal_conv(cout, cout, 3, stride=2, padding=1)

    def forward(self, x):
        return self.down(self.resnet(x))


class DecoderBlock(nn.Module):
    """A ResNet block, then x2 in T, H and W by a transposed conv."""

    def __init__(self, layers, cin, cout, groups=2):
        super().__init__()
        self.resnet = ResnetBlock(layers, cin, cout, groups)
        self.up = layers.upsample(cout, cout)

    def forward(self, x):
        return self.up(self.resnet(x))


class VAEBlocks(nn.Module):
    """An encoder block and a decoder block back to back: returns the latent
    and the decoded clip."""

    def __init__(self, channels, latent_channels, padding_mode="replicate", group=None):
        super().__init__()
        layers = Layers(group, padding_mode)
        self.encoder = EncoderBlock(layers, channels, latent_channels)
        self.decoder = DecoderBlock(layers, latent_channels, channels)

    def forward(self, x):
        latent = self.encoder(x)
        return latent, self.decoder(latent)


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same weights and clip on every rank
    whole = VAEBlocks(4, 8).double()
    sharded = VAEBlocks(4, 8, group=dist.group.WORLD).double()
    sharded.load_state_dict(whole.state_dict())
    lengths = [3 + (r % 2) for r in range(world)]  # uneven shards
    clip = torch.randn(1, 4, sum(lengths), 16, 16, dtype=torch.float64)

    start = sum(lengths[:rank])
    latent, decoded = sharded(clip.narrow(2, start, lengths[rank]))
    latent_all, decoded_all = whole(clip)
    # The encoder gives latent frame j to the rank holding frame 2j; the
    # decoder gives each rank twice its latent frames.
    first = -(-start // 2)
    err = max((latent - latent_all.narrow(2, first, latent.shape[2])).abs().max().item(),
              (decoded - decoded_all.narrow(2, 2 * first, decoded.shape[2])).abs().max().item())
    print(f"rank {rank}: frames {lengths[rank]} -> latent {latent.shape[2]} -> decoded {decoded.shape[2]}; "
          f"largest difference from one process {err:.2g}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
