"""LTX-Video's VAE (AutoencoderKLLTXVideo, the 0.9.0 and 0.9.5 layouts):
causal encoder, centred decoder, replicate padding in time, space-to-depth
down-samplers and depth-to-space up-samplers that treat the clip's first
frame apart."""

from __future__ import annotations

import torch

from . import _convert as cv


def _ltx_model(vae):
    if vae.encoder.patch_size_t != 1 or vae.decoder.patch_size_t != 1:
        raise NotImplementedError("halocp.diffusers: LTX-Video with patch_size_t != 1 (a temporal patch "
                                  "straddles shards)")
    cv.no_tiling(vae)


def _ltx_causal_conv(m, group):
    """LTXVideoCausalConv3d: replicates the first frame K-1 times before the
    clip (causal) or (K-1)/2 first and last frames around it; space is the
    conv's own padding."""
    cv.replace(m, "conv", cv.conv3d(m.conv, group, m.is_causal, "replicate"))
    cv.override(m, lambda self, x: self.conv(x))


def _ltx_downsampler(m, group):
    """LTXVideoDownsampler3d: space-to-depth after st-1 copies of the clip's
    first frame, so the rank holding it prepends them, alone; the pairs of
    frames then never straddle shards (rank 0 holds 1 + st*k frames, the
    others multiples of st)."""
    _ltx_causal_conv(m.conv, group)
    m.conv._halocp = True

    def forward(self, x):
        st = self.stride[0]
        if st > 1 and cv.holds_first_frame(group):
            x = torch.cat([x[:, :, :1].expand(-1, -1, st - 1, -1, -1), x], dim=2)
        mean = cv.fold_time_space(x, self.stride).unflatten(1, (-1, self.group_size)).mean(dim=2)
        return cv.fold_time_space(self.conv(x), self.stride) + mean

    cv.override(m, forward)


def _ltx_upsampler(m, group):
    """LTXVideoUpsampler3d: depth-to-space, then the clip's first st-1
    frames dropped: by the rank holding them, alone."""
    _ltx_causal_conv(m.conv, group)
    m.conv._halocp = True

    def forward(self, x):
        st, sh, sw = self.stride
        drop = st - 1 if cv.holds_first_frame(group) else 0
        y = cv.unfold_time_space(self.conv(x), self.stride)[:, :, drop:]
        if self.residual:
            r = cv.unfold_time_space(x, self.stride).repeat(1, st * sh * sw // self.upscale_factor, 1, 1, 1)
            y = y + r[:, :, drop:]
        return y

    cv.override(m, forward)


def _ltx_decoder(m, group):
    """LTXVideoDecoder3d: its blocks as they are, and its closing
    depth-to-space of the spatial patches with explicit sizes, which an
    empty shard takes (diffusers' reshape infers one from zero elements)."""

    def forward(self, x, temb=None):
        x = self.conv_in(x)
        if self.timestep_scale_multiplier is not None:
            temb = temb * self.timestep_scale_multiplier
        checkpoint = torch.is_grad_enabled() and self.gradient_checkpointing
        for block in (self.mid_block, *self.up_blocks):
            x = self._gradient_checkpointing_func(block, x, temb) if checkpoint else block(x, temb)
        x = self.norm_out(x.movedim(1, -1)).movedim(-1, 1)
        if self.time_embedder is not None:
            n = x.size(0)
            emb = self.time_embedder(timestep=temb.flatten(), resolution=None, aspect_ratio=None, batch_size=n,
                                     hidden_dtype=x.dtype)
            shift, scale = (emb.view(n, 2, -1, 1, 1, 1) + self.scale_shift_table[None, :, :, None, None, None]).unbind(1)
            x = x * (1 + scale) + shift
        x = self.conv_out(self.conv_act(x))
        n, c, t, h, w = x.shape
        pt, p = self.patch_size_t, self.patch_size
        # channel (c, t-phase, w-phase, h-phase), the last fastest
        x = x.reshape(n, c // (pt * p * p), pt, p, p, t, h, w).permute(0, 1, 5, 2, 6, 4, 7, 3)
        return x.reshape(n, c // (pt * p * p), t * pt, h * p, w * p)

    cv.override(m, forward)


MODELS = {"AutoencoderKLLTXVideo": _ltx_model}
BLOCKS = {
    "LTXVideoDownsampler3d": _ltx_downsampler,
    "LTXVideoUpsampler3d": _ltx_upsampler,
    "LTXVideoCausalConv3d": _ltx_causal_conv,
    "LTXVideoDecoder3d": _ltx_decoder,
}
