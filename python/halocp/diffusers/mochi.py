"""Mochi's VAE (AutoencoderKLMochi): causal convs replicating the first
frame (CogVideoX's, converted by cogvideox.BLOCKS), strided temporal convs
down and depth-to-space up, a per-frame GroupNorm, causal attention over
time in the encoder, and the decoder dropping the clip's first r-1 frames."""

from __future__ import annotations

import types

import torch

from ..attention import cp_attention
from . import _convert as cv


def _mochi_model(vae):
    padded = {m.pad_mode for m in vae.modules() if type(m).__name__ == "CogVideoXCausalConv3d"}
    if padded - {"replicate"}:
        # _enable_framewise_encoding/decoding turn its convs' padding to the
        # conv caches' ("constant"), for good: not the model's whole-clip one.
        raise NotImplementedError("halocp.diffusers: this AutoencoderKLMochi had framewise encoding or decoding "
                                  "enabled, which changed its convolutions' padding; convert a fresh one")
    cv.no_tiling(vae)

    def _encode(self, x):
        x = cv.check_frames(self, x, latent=False)
        if self.use_tiling:
            return self.tiled_encode(x)
        return self.encoder(x)[0]

    def _decode(self, z, return_dict=True):
        # One decoder call over the shard, whatever use_framewise_decoding
        # says (its conv caches carry what the halos now bring); the clip's
        # first r-1 decoded frames are rank 0's to drop.
        from diffusers.models.autoencoders.vae import DecoderOutput

        z = cv.check_frames(self, z, latent=True)
        if self.use_tiling:
            return self.tiled_decode(z, return_dict=return_dict)
        dec, _ = self.decoder(z)
        if self.drop_last_temporal_frames and cv.holds_first_frame(self._halocp_group):
            dec = dec[:, :, self.temporal_compression_ratio - 1:]
        return DecoderOutput(sample=dec) if return_dict else (dec,)

    vae._encode = types.MethodType(_encode, vae)
    vae._decode = types.MethodType(_decode, vae)


def _mochi_group_norm(m, group):
    """MochiChunkedGroupNorm3D: a GroupNorm over each frame on its own (in
    chunks of frames, which changes nothing): local, an empty shard
    included."""
    cv.replace(m, "norm_layer", cv.FrameGroupNorm(m.norm_layer))


class _CausalTimeAttention:
    """MochiVaeAttnProcessor2_0 over a time axis sharded across the group:
    its sequences are (batch * height * width, frames, channels), causal
    over frames, so halocp.cp_attention. A clip of one frame is diffusers'
    single-frame path: the softmax over one key is 1, the output its value,
    the same numbers."""

    def __init__(self, group):
        self.group = group

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, **kwargs):
        if encoder_hidden_states is not None or attention_mask is not None or not attn.is_causal:
            raise NotImplementedError("halocp.diffusers: Mochi's attention over time takes no mask nor "
                                      "cross-attention, and is causal")
        residual = hidden_states
        b, n, _ = hidden_states.shape
        query, key, value = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        head_dim = key.shape[-1] // attn.heads
        query, key, value = (t.view(b, n, attn.heads, head_dim).transpose(1, 2) for t in (query, key, value))
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)
        hidden_states = cp_attention(query, key, value, causal=True, group=self.group)
        hidden_states = hidden_states.transpose(1, 2).reshape(b, n, attn.heads * head_dim).to(query.dtype)
        hidden_states = attn.to_out[1](attn.to_out[0](hidden_states))
        if attn.residual_connection:
            hidden_states = hidden_states + residual
        return hidden_states / attn.rescale_output_factor


def _mochi_attention_block(m, group):
    """MochiDownBlock3D, MochiMidBlock3D: their resnets are CogVideoX's
    causal convs and Mochi's per-frame norms (converted as blocks of their
    own); their attentions run over time, causally: a context-parallel
    processor. The down block's strided conv_in keeps its stride: with the
    split's groups of frames it reads this rank's frames alone."""
    for attn in m.attentions:
        if attn is not None:
            attn.set_processor(_CausalTimeAttention(group))


def _mochi_up_block(m, group):
    """MochiUpBlock3D: its resnets, then depth-to-space with explicit sizes,
    which an empty shard takes (diffusers' view infers one from zero
    elements). Every rank keeps all its frames: the decoder's first r-1 are
    dropped once, at the end, by rank 0."""

    def forward(self, hidden_states, conv_cache=None):
        checkpoint = torch.is_grad_enabled() and self.gradient_checkpointing
        for resnet in self.resnets:
            if checkpoint:
                hidden_states, _ = self._gradient_checkpointing_func(resnet, hidden_states, None)
            else:
                hidden_states, _ = resnet(hidden_states)
        hidden_states = self.proj(hidden_states.movedim(1, -1)).movedim(-1, 1)
        stride = (self.temporal_expansion, self.spatial_expansion, self.spatial_expansion)
        return cv.unfold_time_space(hidden_states, stride), {}

    cv.override(m, forward)


MODELS = {"AutoencoderKLMochi": _mochi_model}
BLOCKS = {
    "MochiChunkedGroupNorm3D": _mochi_group_norm,
    "MochiDownBlock3D": _mochi_attention_block,
    "MochiMidBlock3D": _mochi_attention_block,
    "MochiUpBlock3D": _mochi_up_block,
}
