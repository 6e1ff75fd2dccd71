"""Allegro's VAE (AutoencoderKLAllegro): 2-d blocks over each frame (the
frames are their batch: resnets, down- and up-samplers, the mid-block's
attention, their GroupNorms) between temporal conv layers over the clip
(GroupNorm over time, centred convs replicating the clip's first and last
frames, zero-padded ones around the encoder and decoder, a kernel-2 stride-2
conv halving time and a depth-to-space doubling it). No frame is treated
apart: a clip of r*k frames has k latent frames, and every rank holds r*ki
frames (split_clip's ``first_frame=False``).

diffusers ships it encoding and decoding in overlapping tiles only (24
frames of 320x320, blended where they overlap; without tiling it raises):
each tile's norms see that tile alone. The converted model computes the
whole clip in one call, each rank its shard."""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

from .._sharding import world_and_rank
from .._splits import ShardTable
from . import _convert as cv


def _allegro_model(vae):
    r = int(vae.config.temporal_compression_ratio)
    down = sum(b.add_temp_downsample for b in vae.encoder.down_blocks)
    up = sum(b.add_temp_upsample for b in vae.decoder.up_blocks)
    if 2 ** down != r or 2 ** up != r:
        raise ValueError(f"halocp.diffusers: this AutoencoderKLAllegro's temporal_compression_ratio ({r}) is not "
                         f"its encoder's {2 ** down} or its decoder's {2 ** up}")
    vae.temporal_compression_ratio = r  # as the other families' models name it (check_frames)
    cv.no_tiling(vae)
    # Its 2-d blocks' GroupNorms see (N*T, C, H, W): per frame, not over time.
    temporal = {id(n) for m in vae.modules() if type(m).__name__ == "AllegroTemporalConvLayer"
                for n in m.modules() if isinstance(n, torch.nn.GroupNorm)}
    for parent in list(vae.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.GroupNorm and id(child) not in temporal:
                cv.replace(parent, name, cv.FrameGroupNorm(child))

    # One encoder (decoder) call over the shard; the 1x1 quant convs per
    # frame, as the tiled calls apply them. Bound to the model (a deepcopy
    # binds them to the copy).
    def _encode(self, x):
        x = cv.check_frames(self, x, False, first_frame=False)
        if self.use_tiling:
            return self.tiled_encode(x)
        h = self.encoder(x)
        return cv.frames_3d(self.quant_conv(cv.frames_2d(h)), h.shape[0], h.shape[2])

    def _decode(self, z):
        z = cv.check_frames(self, z, True, first_frame=False)
        if self.use_tiling:
            return self.tiled_decode(z)
        z = cv.frames_3d(self.post_quant_conv(cv.frames_2d(z)), z.shape[0], z.shape[2])
        # (N, T, C, H, W), as diffusers' tiled decode gives it (its pipeline permutes it back)
        return self.decoder(z).permute(0, 2, 1, 3, 4)

    vae._encode, vae._decode = types.MethodType(_encode, vae), types.MethodType(_decode, vae)


def _temporal_conv(conv, group, mode):
    """A temporal conv of the clip, centred: ``mode`` the padding in time (the
    layer's own, zeros, or its replicated first and last frames)."""
    conv.padding = (0, *conv.padding[1:])
    return cv.conv3d(conv, group, False, mode)


class _PairConv(torch.nn.Module):
    """The down-sampling layer's conv of kernel 2 and stride 2 in time, no
    padding: output j reads inputs 2j and 2j+1, which the split keeps on one
    rank (every shard an even number of frames at an even offset, checked by
    encode), so local; an empty shard keeps the graph that runs the other
    layers' backward exchanges. The model's own Parameters."""

    def __init__(self, conv):
        super().__init__()
        if conv.kernel_size[0] != 2 or conv.stride[0] != 2 or conv.padding[0] or conv.dilation[0] != 1:
            raise NotImplementedError(f"halocp.diffusers: an AllegroTemporalConvLayer down-sampling conv of kernel "
                                      f"{tuple(conv.kernel_size)}, stride {tuple(conv.stride)}, padding "
                                      f"{tuple(conv.padding)}")
        self.stride, self.padding = conv.stride, conv.padding
        self.weight, self.bias = conv.weight, conv.bias

    def forward(self, x):
        empty = not x.shape[2]
        y = F.conv3d(F.pad(x, (0, 0, 0, 0, 0, 2)) if empty else x, self.weight, self.bias, self.stride, self.padding)
        return y[:, :, :0] if empty else y

    def extra_repr(self):
        return f"kernel {tuple(self.weight.shape[2:])}, stride {self.stride}, padding {self.padding}, local pairs"


def _padded_norm_conv(seq, x, first, last):
    """One of the layer's (GroupNorm, SiLU, [Dropout], conv) after its
    _pad_temporal_dim, which repeats the clip's first and last frames
    before the norm: its statistics count them twice. So the ranks holding
    them normalise their shard with the copy beside it (the GroupNorm over
    time sums every rank's), then drop it; the conv pads its normalised
    frames by replication, the same values."""
    x = torch.cat([x[:, :, :1]] * first + [x] + [x[:, :, -1:]] * last, dim=2)
    x = seq[0](x)
    return seq[1:](x[:, :, int(first):x.shape[2] - int(last)])


def _allegro_temporal_layer(m, group):
    """AllegroTemporalConvLayer: GroupNorm over time (convert_layers) of the
    clip with its first and last frames repeated (its _pad_temporal_dim,
    before the norm: _padded_norm_conv), convs of kernel 3 in time with those
    frames replicated around it; down-sampling by the pair conv with
    the even frames as the shortcut, up-sampling by a one-frame conv whose
    channel halves become two frames, every frame doubled as the shortcut."""
    for seq in (m.conv1, m.conv2, m.conv3, m.conv4):
        conv = seq[-1]
        if seq is m.conv1 and m.down_sample:
            cv.replace(seq, str(len(seq) - 1), _PairConv(conv))
        elif not (seq is m.conv1 and m.up_sample):  # that one is one frame long: convert_layers
            cv.replace(seq, str(len(seq) - 1), _temporal_conv(conv, group, "replicate"))

    def forward(self, x, batch_size):
        x = x.unflatten(0, (batch_size, -1)).transpose(1, 2)
        # The clip's ends: the first and last ranks holding frames (rank 0
        # may hold none); the same ranks at every level of the model.
        held = [i for i, (n,) in enumerate(ShardTable.of(group, [x.shape[2]])) if n]
        rank = world_and_rank(group)[1]
        ends = (bool(held) and rank == held[0], bool(held) and rank == held[-1])
        if self.down_sample:
            identity = x[:, :, ::2]  # the clip's even frames: each shard starts at an even one
        elif self.up_sample:
            identity = x.repeat_interleave(2, dim=2)
        else:
            identity = x
        x = self.conv1(x) if self.down_sample or self.up_sample else _padded_norm_conv(self.conv1, x, *ends)
        if self.up_sample:
            x = x.unflatten(1, (2, -1)).permute(0, 2, 3, 1, 4, 5).flatten(2, 3)
        for seq in (self.conv2, self.conv3, self.conv4):
            x = _padded_norm_conv(seq, x, *ends)
        return (identity + x).transpose(1, 2).flatten(0, 1)

    cv.override(m, forward)


def _allegro_coder(m, group):
    """AllegroEncoder3D / AllegroDecoder3D: their temp_conv_in and
    temp_conv_out, kernel 3 in time padded with zeros (their own padding),
    centred; the rest as it is (per frame, or blocks converted apart)."""
    for name in ("temp_conv_in", "temp_conv_out"):
        cv.replace(m, name, _temporal_conv(getattr(m, name), group, "zeros"))


def _allegro_mid_block(m, group):
    """AllegroMidBlock3DConv: its attentions are within each frame (the
    frames are their batch), local; an empty shard passes them untouched
    (diffusers' reshape infers a size from zero elements)."""

    def forward(self, x, *args, **kwargs):
        return x if not x.shape[0] else type(self).forward(self, x, *args, **kwargs)

    for attn in m.attentions:
        if attn is not None:
            cv.override(attn, forward)


MODELS = {"AutoencoderKLAllegro": _allegro_model}
BLOCKS = {
    "AllegroTemporalConvLayer": _allegro_temporal_layer,
    "AllegroEncoder3D": _allegro_coder,
    "AllegroDecoder3D": _allegro_coder,
    "AllegroMidBlock3DConv": _allegro_mid_block,
}
# The classes that treat no frame apart (split_clip's first_frame=False).
NO_FIRST_FRAME = ("AutoencoderKLAllegro",)
