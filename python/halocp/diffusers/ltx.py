"""LTX-Video's VAE (AutoencoderKLLTXVideo, the 0.9.0 and 0.9.5 layouts):
causal encoder, centred decoder, replicate padding in time, space-to-depth
down-samplers and depth-to-space up-samplers that treat the clip's first
frame apart.

LTX-2's (AutoencoderKLLTX2Video), built from the same blocks: its convs take
their causality as a call's argument (the encoder's or decoder's ``causal or
is_causal``) and pad space as configured (the decoder by reflection), its
norms are per-position RMS norms over channels."""

from __future__ import annotations

import math

import torch

from . import _convert as cv


def _ltx_model(vae):
    if vae.encoder.patch_size_t != 1 or vae.decoder.patch_size_t != 1:
        raise NotImplementedError("halocp.diffusers: LTX-Video with patch_size_t != 1 (a temporal patch "
                                  "straddles shards)")
    cv.no_tiling(vae)
    cv.checked_calls(vae)  # (without, a shard the split does not allow gave latents of a wrong length, silently)


def _ltx_causal_conv(m, group):
    """LTXVideoCausalConv3d: replicates the first frame K-1 times before the
    clip (causal) or (K-1)/2 first and last frames around it; space is the
    conv's own padding."""
    cv.replace(m, "conv", cv.conv3d(m.conv, group, m.is_causal, "replicate"))
    cv.override(m, lambda self, x: self.conv(x))


def _inner_conv(m, group):
    """A down- or up-sampler's conv, LTX's or LTX-2's, converted with it."""
    convert = _ltx2_causal_conv if type(m.conv).__name__ == "LTX2VideoCausalConv3d" else _ltx_causal_conv
    convert(m.conv, group)
    m.conv._halocp = True


def _ltx_downsampler(m, group):
    """LTXVideoDownsampler3d: space-to-depth after st-1 copies of the clip's
    first frame, so the rank holding it prepends them, alone; the pairs of
    frames then never straddle shards (rank 0 holds 1 + st*k frames, the
    others multiples of st)."""
    _inner_conv(m, group)

    def forward(self, x, **causal):  # LTX-2's blocks pass causal= on to the conv
        st = self.stride[0]
        if st > 1 and cv.holds_first_frame(group):
            x = torch.cat([x[:, :, :1].expand(-1, -1, st - 1, -1, -1), x], dim=2)
        mean = cv.fold_time_space(x, self.stride).unflatten(1, (-1, self.group_size)).mean(dim=2)
        return cv.fold_time_space(self.conv(x, **causal), self.stride) + mean

    cv.override(m, forward)


def _ltx_upsampler(m, group):
    """LTXVideoUpsampler3d: depth-to-space, then the clip's first st-1
    frames dropped: by the rank holding them, alone."""
    _inner_conv(m, group)

    def forward(self, x, **causal):
        st, sh, sw = self.stride
        drop = st - 1 if cv.holds_first_frame(group) else 0
        y = cv.unfold_time_space(self.conv(x, **causal), self.stride)[:, :, drop:]
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
        return _unpatchify(self, self.conv_out(self.conv_act(x)))

    cv.override(m, forward)


def _unpatchify(decoder, x):
    """The decoders' closing depth-to-space of the patches, with explicit
    sizes (an empty shard; diffusers' reshape infers one from zero
    elements): channel (c, t-phase, w-phase, h-phase), the last fastest."""
    n, c, t, h, w = x.shape
    pt, p = decoder.patch_size_t, decoder.patch_size
    x = x.reshape(n, c // (pt * p * p), pt, p, p, t, h, w).permute(0, 1, 5, 2, 6, 4, 7, 3)
    return x.reshape(n, c // (pt * p * p), t * pt, h * p, w * p)


def _ltx2_model(vae):
    """LTX-2: LTX's patch rule and tiling refusal, its convs made causal or
    centred by their part (a default call's ``causal or is_causal``), the
    compression checked against the down-samplers, the shards' frame counts
    against the split."""
    _ltx_model(vae)
    strides = [m.stride[0] if type(m).__name__ == "LTX2VideoDownsampler3d" else m.conv.stride[0]
               for block in vae.encoder.down_blocks for m in (block.downsamplers or ())]
    if math.prod(strides) != vae.temporal_compression_ratio:
        # its default is 2 ** (number of scaling blocks), whatever they scale
        raise ValueError(f"halocp.diffusers: this AutoencoderKLLTX2Video's temporal_compression_ratio "
                         f"({vae.temporal_compression_ratio}) is not its down-samplers' (temporal strides "
                         f"{strides}); build it with temporal_compression_ratio={math.prod(strides)}")
    for part in (vae.encoder, vae.decoder):
        for m in part.modules():
            if type(m).__name__ == "LTX2VideoCausalConv3d":
                m.is_causal = part.is_causal
    cv.checked_calls(vae)


def _ltx2_causal_conv(m, group):
    """LTX2VideoCausalConv3d: LTX's conv, causal or centred as its part's
    config says (set by _ltx2_model); a call asking for the other (``causal=True``
    to a part built non-causal) is refused, on every rank alike, rather than
    computed the other way."""
    _ltx_causal_conv(m, group)

    def forward(self, x, causal=True):
        if bool(causal) != self.is_causal:
            raise NotImplementedError("halocp.diffusers: a parallelized AutoencoderKLLTX2Video computes its "
                                      f"{'causal' if self.is_causal else 'non-causal'} part as configured; "
                                      f"causal={causal} asks for the other")
        return self.conv(x)

    cv.override(m, forward)


def _ltx2_decoder(m, group):
    """LTX2VideoDecoder3d: its blocks as they are, and the closing
    depth-to-space with explicit sizes, as LTX's decoder."""

    def forward(self, x, temb=None, causal=None):
        causal = causal or self.is_causal
        x = self.conv_in(x, causal=causal)
        if self.timestep_scale_multiplier is not None:
            temb = temb * self.timestep_scale_multiplier
        checkpoint = torch.is_grad_enabled() and self.gradient_checkpointing
        for block in (self.mid_block, *self.up_blocks):
            x = self._gradient_checkpointing_func(block, x, temb, None, causal) if checkpoint else \
                block(x, temb, causal=causal)
        x = self.norm_out(x)
        if self.time_embedder is not None:
            n = x.size(0)
            emb = self.time_embedder(timestep=temb.flatten(), resolution=None, aspect_ratio=None, batch_size=n,
                                     hidden_dtype=x.dtype)
            shift, scale = (emb.view(n, 2, -1, 1, 1, 1) + self.scale_shift_table[None, :, :, None, None, None]).unbind(1)
            x = x * (1 + scale) + shift
        return _unpatchify(self, self.conv_out(self.conv_act(x), causal=causal))

    cv.override(m, forward)


MODELS = {"AutoencoderKLLTXVideo": _ltx_model, "AutoencoderKLLTX2Video": _ltx2_model}
BLOCKS = {
    "LTXVideoDownsampler3d": _ltx_downsampler,
    "LTXVideoUpsampler3d": _ltx_upsampler,
    "LTXVideoCausalConv3d": _ltx_causal_conv,
    "LTXVideoDecoder3d": _ltx_decoder,
    # LTX-2's down- and up-samplers compute as LTX's
    "LTX2VideoDownsampler3d": _ltx_downsampler,
    "LTX2VideoUpsampler3d": _ltx_upsampler,
    "LTX2VideoCausalConv3d": _ltx2_causal_conv,
    "LTX2VideoDecoder3d": _ltx2_decoder,
}
