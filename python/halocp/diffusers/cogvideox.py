"""CogVideoX's VAE (AutoencoderKLCogVideoX): causal convs repeating the
first frame, GroupNorm over time, the temporal average of pairs after the
first frame, the decoder's spatial norm over the latents."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import nn as cpnn
from . import _convert as cv


def _cogvideox_model(vae):
    cv.no_tiling(vae)
    # One call of the encoder (decoder) covers the shard: no frame batches,
    # so no conv caches between them.
    vae.num_sample_frames_batch_size = vae.num_latent_frames_batch_size = 1 << 62
    cv.checked_calls(vae)  # (without, a shard the split does not allow gave latents of a wrong length, silently)


def _cog_causal_conv(m, group):
    """CogVideoXCausalConv3d: K-1 copies of the first frame before the clip
    and the conv's zero padding in space ("first", the models' mode), or
    replicate padding everywhere ("replicate"). No conv cache."""
    conv = m.conv
    if m.pad_mode == "replicate":
        conv.padding, conv.padding_mode = (0, m.height_pad, m.width_pad), "replicate"
    new = cv.conv3d(conv, group, True, "replicate")
    cv.replace(m, "conv", new)
    cv.override(m, lambda self, x, conv_cache=None: (self.conv(x), None))


def _cog_downsample(m, group):
    """CogVideoXDownsample3D: with compress_time, the clip's first frame is
    kept and the frames after it averaged in pairs (the clip is 1 + 2k frames
    long); halocp.nn.AvgPool3d pools that sharded rest, pairs across shards
    included. Then the per-frame 2-d conv, local."""
    if m.compress_time:
        m.temporal_pool = cpnn.AvgPool3d((2, 1, 1), stride=(2, 1, 1), group=group)

    def forward(self, x):
        if self.compress_time:
            first = cv.holds_first_frame(group)
            head, rest = (x[:, :, :1], x[:, :, 1:]) if first else (None, x)
            x = self.temporal_pool(rest)
            # Every rank's rest is an even count of frames (split_clip), so its pairs are its own: what a
            # traced graph cannot tell from this rank's length alone (halocp.nn._count_bounds).
            torch._check(x.shape[2] == rest.shape[2] // 2)
            if first:
                x = torch.cat([head, x], dim=2)
        x = F.pad(x, (0, 1, 0, 1))
        return cv.frames_3d(self.conv(cv.frames_2d(x)), x.shape[0], x.shape[2])

    cv.override(m, forward)


def _cog_upsample(m, group):
    """CogVideoXUpsample3D: nearest x2 in space; with compress_time, x2 in
    time too, but for the clip's first frame (held by rank 0). Then the
    per-frame 2-d conv."""

    def forward(self, x):
        n = x.shape[0]
        x = cv.frames_3d(F.interpolate(cv.frames_2d(x), scale_factor=2.0), n, x.shape[2])
        if self.compress_time:
            first = cv.holds_first_frame(group)
            rest = x[:, :, 1:] if first else x
            rest = rest.repeat_interleave(2, dim=2)
            x = torch.cat([x[:, :, :1], rest], dim=2) if first else rest
        return cv.frames_3d(self.conv(cv.frames_2d(x)), n, x.shape[2])

    cv.override(m, forward)


def _nearest_frames(z, t, h, w):
    """z (N, C, Tz, Hz, Wz) to (t, h, w) by nearest: torch's interpolate,
    which refuses empty tensors, with time repeated when t is a multiple of Tz."""
    if t == 0 or z.shape[2] == 0 or t % z.shape[2]:
        if t and z.shape[2]:
            return F.interpolate(z, size=(t, h, w))
        if t:
            return z.new_zeros(*z.shape[:2], t, h, w)
        # no frames, from z (its sums over none): a traced graph then runs the layers after z, as other ranks do
        return z[:, :, :0].sum((2, 3, 4), keepdim=True).expand(*z.shape[:2], 0, h, w)
    n, tz = z.shape[0], z.shape[2]
    z = cv.frames_3d(F.interpolate(cv.frames_2d(z), size=(h, w)), n, tz)
    return z.repeat_interleave(t // z.shape[2], dim=2)


def _cog_spatial_norm(m, group):
    """CogVideoXSpatialNorm3D: the latents zq brought to f's size by nearest,
    the clip's first frame on its own (rank 0's), the rest by blocks of
    frames that stay on their rank; GroupNorm across ranks; no conv cache."""

    def forward(self, f, zq, conv_cache=None):
        t, h, w = f.shape[2:]
        if cv.holds_first_frame(group) and t > 1:
            zq = torch.cat([_nearest_frames(zq[:, :, :1], 1, h, w), _nearest_frames(zq[:, :, 1:], t - 1, h, w)], 2)
        else:
            zq = _nearest_frames(zq, t, h, w)
        y, _ = self.conv_y(zq)
        b, _ = self.conv_b(zq)
        return self.norm_layer(f) * y + b, {}

    cv.override(m, forward)


MODELS = {"AutoencoderKLCogVideoX": _cogvideox_model}
BLOCKS = {
    "CogVideoXCausalConv3d": _cog_causal_conv,
    "CogVideoXDownsample3D": _cog_downsample,
    "CogVideoXUpsample3D": _cog_upsample,
    "CogVideoXSpatialNorm3D": _cog_spatial_norm,
}
