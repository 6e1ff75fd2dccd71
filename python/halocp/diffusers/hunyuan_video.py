"""HunyuanVideo's VAE (AutoencoderKLHunyuanVideo): causal convs padding
time with copies of the clip's first frame and space by replication,
strided causal down-sampling convs, up-samplers that double every frame but
the clip's first in time, GroupNorm over time, and the mid-blocks'
attention over every (frame, h, w) token with a causal frame mask.

HunyuanVideo 1.5's (AutoencoderKLHunyuanVideo15), built from the same causal
convs and attention: space-to-depth down-samplers and depth-to-space
up-samplers that fold the clip's first frame in space only, per-frame RMS
norms."""

from __future__ import annotations


import torch

from .. import attention as cpattn
from . import _convert as cv

# F.pad's modes as torch's Conv3d names them.
_PAD_MODES = {"replicate": "replicate", "constant": "zeros", "reflect": "reflect", "circular": "circular"}


def _hunyuan_model(vae):
    cv.no_tiling(vae)
    cv.checked_calls(vae)


def _hunyuan_causal_conv(m, group):
    """HunyuanVideoCausalConv3d: F.pad of (kw//2, kw//2, kh//2, kh//2,
    kt-1, 0) in its pad_mode (replicate: the clip's first frame repeated
    before it, the frame's borders in space), then the conv with its own
    padding (zeros, none in the models): a causal conv whose spatial padding
    is the pad's. The pad reads the kernel's sizes in the model's order, W
    from kernel_size[0] and T from kernel_size[2] (the same for the cubic
    kernels the model builds)."""
    conv = m.conv
    pw, ph, pt = m.time_causal_padding[0], m.time_causal_padding[2], m.time_causal_padding[4]
    if any(conv.padding) or pt != conv.kernel_size[0] - 1 or m.pad_mode not in _PAD_MODES:
        raise NotImplementedError(f"halocp.diffusers: a HunyuanVideoCausalConv3d padding {m.time_causal_padding} "
                                  f"({m.pad_mode}) around a kernel {tuple(conv.kernel_size)} with its own padding "
                                  f"{tuple(conv.padding)}")
    mode = _PAD_MODES[m.pad_mode]
    # Nothing padded (the 1x1x1 shortcuts): zeros, the layer's one-frame path.
    conv.padding, conv.padding_mode = (0, ph, pw), mode if ph or pw else "zeros"
    cv.replace(m, "conv", cv.conv3d(conv, group, True, mode if pt else "zeros"))
    cv.override(m, lambda self, x: self.conv(x))


def _nearest(x, factors):
    """Nearest up-sampling of (N, C, T, H, W) by integer factors (t, h, w):
    F.interpolate's nearest for these, which also takes an empty shard."""
    for dim, f in zip((2, 3, 4), factors):
        if f != 1:
            x = x.repeat_interleave(f, dim=dim)
    return x


def _hunyuan_upsample(m, group):
    """HunyuanVideoUpsampleCausal3D: the clip's first frame up-sampled in
    space only (by rank 0, which holds it), every other frame in time and
    space; then its causal conv."""
    factors = tuple(m.upsample_factor)
    if any(int(f) != f or f < 1 for f in factors):
        raise NotImplementedError(f"halocp.diffusers: a HunyuanVideoUpsampleCausal3D by {factors} (not integers)")
    factors = tuple(int(f) for f in factors)

    def forward(self, x):
        if cv.holds_first_frame(group):
            x = torch.cat([_nearest(x[:, :, :1], (1,) + factors[1:]), _nearest(x[:, :, 1:], factors)], dim=2)
        else:
            x = _nearest(x, factors)
        return self.conv(x)

    cv.override(m, forward)


def _attend(attn, x, group):
    """The mid-block's attention (diffusers' AttnProcessor2_0 on the
    flattened (frame, h, w) tokens with prepare_causal_attention_mask): the
    GroupNorm over the whole clip's tokens, the projections per token, and
    halocp.cp_attention, each rank's queries against the keys and
    values of its own and every earlier rank's frames."""
    n, c, t, h, w = x.shape
    length = t * h * w
    tokens = x.permute(0, 2, 3, 4, 1).reshape(n, length, c)
    residual = tokens
    if attn.group_norm is not None:
        tokens = attn.group_norm(tokens.transpose(1, 2)).transpose(1, 2)
    q, k, v = attn.to_q(tokens), attn.to_k(tokens), attn.to_v(tokens)
    # Explicit sizes: an empty shard's view cannot infer one from no elements.
    q, k, v = (p.view(n, length, attn.heads, p.shape[-1] // attn.heads).transpose(1, 2) for p in (q, k, v))
    if attn.norm_q is not None:
        q = attn.norm_q(q)
    if attn.norm_k is not None:
        k = attn.norm_k(k)
    # The logits' scale is scaled_dot_product_attention's default, as the
    # shipped processor's (it leaves attn.scale aside).
    y = cpattn.cp_attention(q, k, v, causal=True, tokens_per_frame=h * w, group=group)
    y = y.transpose(1, 2).reshape(n, length, attn.heads * y.shape[-1]).to(q.dtype)
    y = attn.to_out[1](attn.to_out[0](y))
    if attn.residual_connection:
        y = y + residual
    y = y / attn.rescale_output_factor
    return y.reshape(n, t, h, w, y.shape[-1]).permute(0, 4, 1, 2, 3)


def _hunyuan_mid_block(m, group):
    """HunyuanVideoMidBlock3D: its resnets, and between them its attention
    over every (frame, h, w) token, causal by frame, made context-parallel
    (_attend); its gradient checkpointing as the model's, of the resnets."""
    for attn in m.attentions:
        if attn is not None and (attn.spatial_norm is not None or attn.is_cross_attention):
            raise NotImplementedError("halocp.diffusers: a HunyuanVideoMidBlock3D attention with a spatial norm "
                                      "or cross-attention")

    def forward(self, x):
        checkpoint = torch.is_grad_enabled() and self.gradient_checkpointing

        def run(block, x):
            return self._gradient_checkpointing_func(block, x) if checkpoint else block(x)

        x = run(self.resnets[0], x)
        for attn, resnet in zip(self.attentions, self.resnets[1:]):
            if attn is not None:
                x = _attend(attn, x, group)
            x = run(resnet, x)
        return x

    cv.override(m, forward)


def _attn15(m, group):
    """HunyuanVideo15AttnBlock: one head over every (frame, h, w) token,
    the channels its width, causal by frame (its own
    prepare_causal_attention_mask): the per-token RMS norm and 1x1x1
    projections as they are, halocp.cp_attention between."""

    def forward(self, x):
        identity = x
        x = self.norm(x)
        q, k, v = self.to_q(x), self.to_k(x), self.to_v(x)
        n, c, t, h, w = q.shape
        q, k, v = (p.reshape(n, c, t * h * w).transpose(1, 2).unsqueeze(1) for p in (q, k, v))
        y = cpattn.cp_attention(q, k, v, causal=True, tokens_per_frame=h * w, group=group)
        y = y.squeeze(1).reshape(n, t, h, w, c).permute(0, 4, 1, 2, 3)
        return self.proj_out(y) + identity

    cv.override(m, forward)


def _downsample15(m, group):
    """HunyuanVideo15Downsample: its causal conv, then space-to-depth (and a
    mean over channel groups for the shortcut); with a temporal fold, the
    clip's first frame is folded in space only and the frames after it in
    pairs, which never straddle shards (rank 0 holds 1 + 2k frames, the
    others 2k). Rank 0 runs the model's forward; the others fold every frame
    in pairs."""
    # (the model builds the flag from numpy: a Python bool, which dynamo
    # can branch on)
    m.add_temporal_downsample = bool(m.add_temporal_downsample)

    def forward(self, x):
        if not self.add_temporal_downsample or cv.holds_first_frame(group):
            return type(self).forward(self, x)
        h = self._dcae_downsample_rearrange(self.conv(x), r1=2, r2=2, r3=2)
        s = self._dcae_downsample_rearrange(x, r1=2, r2=2, r3=2)
        n, _, t, hh, ww = s.shape
        return h + s.view(n, h.shape[1], self.group_size, t, hh, ww).mean(dim=2)

    cv.override(m, forward)


def _upsample15(m, group):
    """HunyuanVideo15Upsample: its causal conv, then depth-to-space (the
    shortcut its input's channels repeated); with a temporal unfold, the
    clip's first frame unfolds in space only and every other frame into
    two. Rank 0 runs the model's forward; the others unfold every frame in
    two, the shortcut repeated after the unfold, as the model does for the
    frames after the first."""
    m.add_temporal_upsample = bool(m.add_temporal_upsample)  # (as _downsample15's)

    def forward(self, x):
        if not self.add_temporal_upsample or cv.holds_first_frame(group):
            return type(self).forward(self, x)
        h = self._dcae_upsample_rearrange(self.conv(x), r1=2, r2=2, r3=2)
        shortcut = self._dcae_upsample_rearrange(x, r1=2, r2=2, r3=2).repeat_interleave(self.repeats, dim=1)
        return h + shortcut

    cv.override(m, forward)


def _encoder15(m, group):
    """HunyuanVideo15Encoder3D: as the model's, its closing shortcut's view
    with explicit sizes, which an empty shard takes (diffusers' infers one
    from no elements)."""

    def forward(self, x):
        x = self.conv_in(x)
        checkpoint = torch.is_grad_enabled() and self.gradient_checkpointing
        for block in (*self.down_blocks, self.mid_block):
            x = self._gradient_checkpointing_func(block, x) if checkpoint else block(x)
        n, c, t, h, w = x.shape
        shortcut = x.view(n, c // self.group_size, self.group_size, t, h, w).mean(dim=2)
        return self.conv_out(self.conv_act(self.norm_out(x))) + shortcut

    cv.override(m, forward)


MODELS = {"AutoencoderKLHunyuanVideo": _hunyuan_model, "AutoencoderKLHunyuanVideo15": _hunyuan_model}
BLOCKS = {
    "HunyuanVideoCausalConv3d": _hunyuan_causal_conv,
    "HunyuanVideoUpsampleCausal3D": _hunyuan_upsample,
    "HunyuanVideoMidBlock3D": _hunyuan_mid_block,
    "HunyuanVideo15CausalConv3d": _hunyuan_causal_conv,
    "HunyuanVideo15AttnBlock": _attn15,
    "HunyuanVideo15Downsample": _downsample15,
    "HunyuanVideo15Upsample": _upsample15,
    "HunyuanVideo15Encoder3D": _encoder15,
}
