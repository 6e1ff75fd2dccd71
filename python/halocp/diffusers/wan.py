"""Wan's VAE (AutoencoderKLWan: Wan 2.1, and Wan 2.2 with is_residual and
patch_size 2): causal convs padded with zeros, strided time convs with the
first frame kept, temporal doubling but for the first frame, Wan 2.2's
zero-padded average and repeat shortcuts.

diffusers encodes the clip in chunks (the first frame, then 4 frames a
call) and decodes it latent frame by latent frame, carrying each causal
conv's last two input frames (feat_cache) into the next call. Chunk by
chunk that is exactly a computation over the whole clip, which each rank
computes its shard of here:

- WanCausalConv3d: the cache holds the frames before the chunk, and zeros
  stand in for those before the clip: a causal conv with zero padding.
- WanResample downsample3d: the first chunk's frame passes untouched; after
  it, output j reads inputs 2j-2 .. 2j (the previous chunk's last frame
  and the chunk's): a causal conv of stride 2 whose output 0, on rank 0, is
  the clip's first frame itself.
- WanResample upsample3d: the first chunk is not doubled and its frame is
  never cached ("Rep": zeros stand in for it), so the time conv runs over
  the frames after the first, zeros before them, and each of its outputs
  gives two frames (its two channel halves).
- AvgDown3D pads each chunk at the front to whole groups: the first
  chunk's frame with factor_t - 1 zero frames, rank 0's alone. DupUp3D
  drops the first chunk's factor_t - 1 repeats: rank 0's alone.
"""

from __future__ import annotations

import types

import torch

from .. import nn as cpnn
from .._sharding import world_and_rank
from . import _convert as cv


def _wan_model(vae):
    from diffusers.models.autoencoders.autoencoder_kl_wan import patchify, unpatchify
    from diffusers.models.autoencoders.vae import DecoderOutput

    r = 2 ** sum(1 for m in vae.encoder.modules() if type(m).__name__ == "WanResample" and m.mode == "downsample3d")
    if vae.config.get("scale_factor_temporal") != r:
        raise ValueError(f"halocp.diffusers: AutoencoderKLWan's scale_factor_temporal "
                         f"({vae.config.get('scale_factor_temporal')}) is not its encoder's compression ({r})")
    cv.no_tiling(vae)
    vae.temporal_compression_ratio = r  # as the other families' models name it (check_frames)
    patch = vae.config.patch_size

    # One encoder (decoder) call over the shard, no feat_cache: the blocks
    # compute the whole clip's causal computation (see the module's doc);
    # the shard lengths checked first, on every rank alike.
    def _encode(self, x):
        if self.use_tiling:
            cv.refuse_tiling(self)
        x = cv.check_frames(self, x, latent=False)
        if patch is not None:
            x = patchify(x, patch_size=patch)
        return self.quant_conv(self.encoder(x))

    def _decode(self, z, return_dict=True):
        if self.use_tiling:
            cv.refuse_tiling(self)
        z = cv.check_frames(self, z, latent=True)
        out = self.decoder(self.post_quant_conv(z))
        if patch is not None:
            out = unpatchify(out, patch_size=patch)
        out = torch.clamp(out, min=-1.0, max=1.0)
        return DecoderOutput(sample=out) if return_dict else (out,)

    vae._encode = types.MethodType(_encode, vae)
    vae._decode = types.MethodType(_decode, vae)


def _causal(m, group, unpadded=False):
    """halocp.nn.CausalConv3d in place of the WanCausalConv3d ``m``: zeros
    K-1 frames before the clip, its own zero padding in space. ``unpadded``:
    a conv padding no frames (the down-sampler's, whose first output the
    caller replaces), which the zeros before the clip then do not reach."""
    pw, pw_right, ph, ph_right, pt, pt_right = m._padding
    kt = m.kernel_size[0]
    if pw != pw_right or ph != ph_right or pt_right or m.dilation[0] != 1 or \
            pt not in ((kt - 1, 0) if unpadded else (kt - 1,)):
        raise NotImplementedError(f"halocp.diffusers: a WanCausalConv3d padded {m._padding} with kernel "
                                  f"{tuple(m.kernel_size)} and dilation {tuple(m.dilation)}")
    new = cpnn.CausalConv3d(m.in_channels, m.out_channels, m.kernel_size, stride=m.stride, padding=(ph, pw),
                            dilation=m.dilation, groups=m.groups, bias=m.bias is not None, group=group,
                            device="meta")
    return cv.adopt(new, m)


def _convs(block, group):
    """The block's WanCausalConv3d children, on halocp.nn."""
    for name, child in list(block.named_children()):
        if type(child).__name__ == "WanCausalConv3d":
            cv.replace(block, name, _causal(child, group))


def _wan_resample(m, group):
    """WanResample: the per-frame spatial resampling, local; downsample3d's
    time conv strided, rank 0's first output the clip's first frame;
    upsample3d's time conv over the frames after the clip's first, each
    output two frames (see the module's doc)."""
    if hasattr(m, "time_conv"):
        cv.replace(m, "time_conv", _causal(m.time_conv, group, unpadded=m.mode == "downsample3d"))

    def forward(self, x, feat_cache=None, feat_idx=None):
        first = cv.holds_first_frame(group)
        if self.mode == "upsample3d":
            head, rest = (x[:, :, :1], x[:, :, 1:]) if first else (None, x)
            y = self.time_conv(rest)
            n, c2, t, h, w = y.shape
            # channels [0, c) give frame 2t, [c, 2c) frame 2t + 1
            y = y.reshape(n, 2, c2 // 2, t, h, w).permute(0, 2, 3, 1, 4, 5).reshape(n, c2 // 2, 2 * t, h, w)
            x = torch.cat([head, y], 2) if first else y
        n, t = x.shape[0], x.shape[2]
        x = cv.frames_3d(self.resample(cv.frames_2d(x)), n, t)
        if self.mode == "downsample3d":
            y = self.time_conv(x)
            x = torch.cat([x[:, :, :1], y[:, :, 1:]], 2) if first else y
        return x

    cv.override(m, forward)


def _wan_attention(m, group):
    """WanAttentionBlock attends within each frame: local; an empty shard
    passes (diffusers' reshape infers a size from zero elements)."""
    shipped = type(m).forward
    cv.override(m, lambda self, x: x if x.shape[2] == 0 else shipped(self, x))


def _avg_down(m, group):
    """AvgDown3D (Wan 2.2's encoder shortcut): factor_t - 1 zero frames before
    the clip's first frame (rank 0's alone), then the mean of each group
    of frames and pixels; the groups never straddle shards."""

    def forward(self, x):
        ft, fs = self.factor_t, self.factor_s
        if ft > 1 and cv.holds_first_frame(group):
            x = torch.cat([x.new_zeros(*x.shape[:2], ft - 1, *x.shape[3:]), x], 2)
        if x.shape[2] % ft:
            raise ValueError(f"halocp.diffusers: AvgDown3D on rank {world_and_rank(group)[1]}: {x.shape[2]} "
                             f"frames are not whole groups of {ft}")
        return cv.fold_time_space(x, (ft, fs, fs)).unflatten(1, (self.out_channels, self.group_size)).mean(2)

    cv.override(m, forward)


def _dup_up(m, group):
    """DupUp3D (Wan 2.2's decoder shortcut): each frame repeated factor_t
    times, the clip's first frame's first factor_t - 1 repeats dropped (rank
    0's alone, whatever first_chunk says)."""

    def forward(self, x, first_chunk=False):
        ft, fs = self.factor_t, self.factor_s
        x = cv.unfold_time_space(x.repeat_interleave(self.repeats, dim=1), (ft, fs, fs))
        return x[:, :, ft - 1:] if cv.holds_first_frame(group) else x

    cv.override(m, forward)


MODELS = {"AutoencoderKLWan": _wan_model}
BLOCKS = {
    # The encoder and decoder as shipped: without feat_cache, one call over
    # the shard through the converted blocks.
    "WanEncoder3d": _convs,
    "WanDecoder3d": _convs,
    "WanResidualBlock": _convs,
    "WanResample": _wan_resample,
    "WanAttentionBlock": _wan_attention,
    "AvgDown3D": _avg_down,
    "DupUp3D": _dup_up,
}
