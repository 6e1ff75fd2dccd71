"""diffusers' video VAEs sharded along time, in one call.

    vae = halocp.diffusers.parallelize_vae(vae, group=cp_group)
    split = halocp.diffusers.split_clip(clip.shape[2], world, halocp.diffusers.temporal_compression(vae))
    x_local = halocp.diffusers.shard_clip(clip, split, cp_group)
    z_local = vae.encode(x_local).latent_dist.mode()      # this rank's latent frames
    y_local = vae.decode(z_local).sample                   # this rank's frames again

``parallelize_vae`` rebuilds every temporal operation of the model, found by
its block type, on halocp.nn's context-parallel layers (sharing the
model's parameters: weights and state_dict are untouched) and turns off the
model's own ways round a long clip (temporal tiling, frame batching, conv
caches): each rank computes its shard of the whole-sequence computation, so
the ranks' outputs put together are the unpatched model's on the whole
clip, and its parameter gradients summed over the group are the whole
clip's.

diffusers is imported only when a VAE is converted: halocp needs none of it.
"""

from __future__ import annotations

import types
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from . import nn as cpnn
from ._sharding import distributed, world_and_rank

__all__ = ["parallelize_vae", "supported_classes", "temporal_compression", "split_clip", "ClipSplit", "Shard", "shard_clip", "gather_clip"]


# ------------------------------------------------------------ the one call


def supported_classes() -> tuple[str, ...]:
    """The diffusers VAE classes parallelize_vae converts."""
    return tuple(_MODELS)


def parallelize_vae(vae, group=None):
    """Make ``vae`` (a diffusers video VAE) context-parallel over ``group``
    (``None``: the default process group, or one process holding the whole
    clip when torch.distributed is not initialised) and return it: the same
    module, its parameters the same objects.

    Afterwards ``vae.encode(x_local)`` and ``vae.decode(z_local)`` are
    collective over the group and take and give this rank's frames, split as
    :func:`split_clip` says (rank 0 holds the clip's first frame). Raises
    ``TypeError`` for a class it does not support, naming those it does,
    before changing anything; ``NotImplementedError`` for a layer over time
    that no converter takes, after converting the rest (discard that model).
    """
    model = next((c.__name__ for c in type(vae).__mro__ if c.__name__ in _MODELS), None)
    if model is None:
        raise TypeError(f"halocp.diffusers.parallelize_vae: {type(vae).__name__} is not supported; "
                        f"supported: {', '.join(_MODELS)}")
    if getattr(vae, "_halocp_group", False) is not False:
        raise ValueError("halocp.diffusers.parallelize_vae: this VAE is already parallelized")
    _MODELS[model](vae)
    blocks = _blocks()
    # Blocks first (a block converts the layers inside it), then the layers
    # left, by type; each module is converted once.
    for module in list(vae.modules()):
        convert = blocks.get(type(module).__name__)
        if convert is not None and not getattr(module, "_halocp", False):
            convert(module, group)
            module._halocp = True
    _convert_layers(vae, group)
    _check_converted(vae, model)
    vae._halocp_group = group
    return vae


def _replace(parent, name, new):
    parent._modules[name] = new


def _adopt(new, old):
    """Give ``new`` (built on the meta device) ``old``'s parameters, the
    same Parameter objects, so optimisers and state_dict see no change."""
    new.weight = old.weight
    if old.bias is not None:
        new.bias = old.bias
    return new


def _halocp_conv3d(conv, group, causal, temporal_padding_mode):
    """halocp.nn's conv in place of torch's Conv3d ``conv`` whose temporal
    padding its owner did by hand: causal (K-1 frames before) or centred."""
    kt = conv.kernel_size[0]
    if conv.dilation[0] != 1:
        raise NotImplementedError(f"halocp.diffusers: a temporal dilation of {conv.dilation[0]} "
                                  "(the models pad K-1 frames, whatever the dilation)")
    if conv.padding[0] != 0:
        raise NotImplementedError(f"halocp.diffusers: a Conv3d padding time itself ({conv.padding})")
    cls = cpnn.CausalConv3d if causal or kt == 1 else cpnn.CenteredConv3d
    new = cls(conv.in_channels, conv.out_channels, conv.kernel_size, stride=conv.stride, padding=conv.padding[1:],
              dilation=conv.dilation, groups=conv.groups, bias=conv.bias is not None,
              padding_mode=conv.padding_mode, temporal_padding_mode=temporal_padding_mode, group=group,
              device="meta")
    return _adopt(new, conv)


def _halocp_groupnorm(norm, group):
    new = cpnn.GroupNorm(norm.num_groups, norm.num_channels, norm.eps, norm.affine, device="meta", group=group,
                         dim=2)
    if norm.affine:
        _adopt(new, norm)
    return new


def _holds_first_frame(group) -> bool:
    """Whether this rank holds the clip's first frame: rank 0 of the group,
    as split_clip puts it (a rank 0 with no frames is not supported)."""
    return world_and_rank(group)[1] == 0


def _override(module, forward):
    module.forward = types.MethodType(forward, module)


def _convert_layers(vae, group):
    """The torch layers left after the blocks, by type: GroupNorm (its
    statistics span time) and Conv3d one frame long in time (it needs no
    context, but torch's refuses an empty shard)."""
    for parent in list(vae.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not torch.nn.GroupNorm and not (
                    isinstance(child, torch.nn.Conv3d) and not isinstance(child, cpnn._ContextParallelConv3d)):
                continue
            if isinstance(child, torch.nn.GroupNorm):
                _replace(parent, name, _halocp_groupnorm(child, group))
            elif child.kernel_size[0] == 1 and child.stride[0] == 1 and child.padding[0] == 0 and \
                    child.padding_mode == "zeros":
                _replace(parent, name, _halocp_conv3d(child, group, True, "zeros"))


def _check_converted(vae, model):
    """Refuse a model with a layer over time that no converter took: it
    would compute on this rank's frames alone, silently."""
    for name, m in vae.named_modules():
        if isinstance(m, torch.nn.Conv3d) and not isinstance(m, cpnn._ContextParallelConv3d):
            what = f"a {type(m).__name__} (kernel {tuple(m.kernel_size)})"
        elif isinstance(m, torch.nn.GroupNorm) and not isinstance(m, cpnn.GroupNorm):
            what = "a GroupNorm"
        elif isinstance(m, (torch.nn.AvgPool3d, torch.nn.MaxPool3d, torch.nn.ConvTranspose3d)) and \
                not isinstance(m, (cpnn.AvgPool3d, cpnn.MaxPool3d, cpnn.ConvTranspose3d)):
            what = f"a {type(m).__name__}"
        else:
            continue
        raise NotImplementedError(f"halocp.diffusers.parallelize_vae: {model}'s {name} is {what} that no "
                                  "converter knows; it would see this rank's frames alone")


def _no_temporal_tiling(vae):
    """Replace the model's own ways round a long clip by the sharding."""
    for flag in ("use_tiling", "use_slicing", "use_framewise_encoding", "use_framewise_decoding"):
        if hasattr(vae, flag):
            setattr(vae, flag, False)

    def refuse(self, *args, **kwargs):
        raise RuntimeError("halocp.diffusers: a parallelized VAE shards the clip along time instead of tiling "
                           "it; leave temporal tiling off")

    for method in ("_temporal_tiled_encode", "_temporal_tiled_decode"):
        if hasattr(vae, method):
            setattr(vae, method, types.MethodType(refuse, vae))


# ------------------------------------------------------------ LTX-Video


def _ltx_model(vae):
    if vae.encoder.patch_size_t != 1 or vae.decoder.patch_size_t != 1:
        raise NotImplementedError("halocp.diffusers: LTX-Video with patch_size_t != 1 (a temporal patch "
                                  "straddles shards)")
    _no_temporal_tiling(vae)


def _ltx_causal_conv(m, group):
    """LTXVideoCausalConv3d: replicates the first frame K-1 times before the
    clip (causal) or (K-1)/2 first and last frames around it; space is the
    conv's own padding."""
    _replace(m, "conv", _halocp_conv3d(m.conv, group, m.is_causal, "replicate"))
    _override(m, lambda self, x: self.conv(x))


def _fold_time_space(x, stride):
    """(N, C, T, H, W) -> (N, C*st*sh*sw, T/st, H/sh, W/sw), the channel
    index running over (c, t-phase, h-phase, w-phase), the last fastest."""
    n, c, t, h, w = x.shape
    st, sh, sw = stride
    x = x.reshape(n, c, t // st, st, h // sh, sh, w // sw, sw)
    return x.permute(0, 1, 3, 5, 7, 2, 4, 6).reshape(n, c * st * sh * sw, t // st, h // sh, w // sw)


def _unfold_time_space(x, stride):
    """The inverse of _fold_time_space."""
    n, c, t, h, w = x.shape
    st, sh, sw = stride
    x = x.reshape(n, c // (st * sh * sw), st, sh, sw, t, h, w)
    return x.permute(0, 1, 5, 2, 6, 3, 7, 4).reshape(n, c // (st * sh * sw), t * st, h * sh, w * sw)


def _ltx_downsampler(m, group):
    """LTXVideoDownsampler3d: space-to-depth after st-1 copies of the clip's
    first frame, so the rank holding it prepends them, alone; the pairs of
    frames then never straddle shards (rank 0 holds 1 + st*k frames, the
    others multiples of st)."""
    _ltx_causal_conv(m.conv, group)
    m.conv._halocp = True

    def forward(self, x):
        st = self.stride[0]
        if st > 1 and _holds_first_frame(group):
            x = torch.cat([x[:, :, :1].expand(-1, -1, st - 1, -1, -1), x], dim=2)
        mean = _fold_time_space(x, self.stride).unflatten(1, (-1, self.group_size)).mean(dim=2)
        return _fold_time_space(self.conv(x), self.stride) + mean

    _override(m, forward)


def _ltx_upsampler(m, group):
    """LTXVideoUpsampler3d: depth-to-space, then the clip's first st-1
    frames dropped: by the rank holding them, alone."""
    _ltx_causal_conv(m.conv, group)
    m.conv._halocp = True

    def forward(self, x):
        st, sh, sw = self.stride
        drop = st - 1 if _holds_first_frame(group) else 0
        y = _unfold_time_space(self.conv(x), self.stride)[:, :, drop:]
        if self.residual:
            r = _unfold_time_space(x, self.stride).repeat(1, st * sh * sw // self.upscale_factor, 1, 1, 1)
            y = y + r[:, :, drop:]
        return y

    _override(m, forward)


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

    _override(m, forward)


# ------------------------------------------------------------ CogVideoX


def _cogvideox_model(vae):
    _no_temporal_tiling(vae)
    # One call of the encoder (decoder) covers the shard: no frame batches,
    # so no conv caches between them.
    vae.num_sample_frames_batch_size = vae.num_latent_frames_batch_size = 1 << 62


def _cog_causal_conv(m, group):
    """CogVideoXCausalConv3d: K-1 copies of the first frame before the clip
    and the conv's zero padding in space ("first", the models' mode), or
    replicate padding everywhere ("replicate"). No conv cache."""
    conv = m.conv
    if m.pad_mode == "replicate":
        conv.padding, conv.padding_mode = (0, m.height_pad, m.width_pad), "replicate"
    new = _halocp_conv3d(conv, group, True, "replicate")
    _replace(m, "conv", new)
    _override(m, lambda self, x, conv_cache=None: (self.conv(x), None))


def _frames_2d(x):
    """(N, C, T, H, W) -> (N*T, C, H, W), frame by frame."""
    n, c, t, h, w = x.shape
    return x.transpose(1, 2).reshape(n * t, c, h, w)


def _frames_3d(y, n, t):
    """The inverse of _frames_2d."""
    return y.reshape(n, t, *y.shape[1:]).transpose(1, 2)


def _cog_downsample(m, group):
    """CogVideoXDownsample3D: with compress_time, the clip's first frame is
    kept and the frames after it averaged in pairs (the clip is 1 + 2k frames
    long); halocp.nn.AvgPool3d pools that sharded rest, pairs across shards
    included. Then the per-frame 2-d conv, local."""
    if m.compress_time:
        m.temporal_pool = cpnn.AvgPool3d((2, 1, 1), stride=(2, 1, 1), group=group)

    def forward(self, x):
        if self.compress_time:
            first = _holds_first_frame(group)
            head, rest = (x[:, :, :1], x[:, :, 1:]) if first else (None, x)
            x = self.temporal_pool(rest)
            if first:
                x = torch.cat([head, x], dim=2)
        x = F.pad(x, (0, 1, 0, 1))
        return _frames_3d(self.conv(_frames_2d(x)), x.shape[0], x.shape[2])

    _override(m, forward)


def _cog_upsample(m, group):
    """CogVideoXUpsample3D: nearest x2 in space; with compress_time, x2 in
    time too, but for the clip's first frame (held by rank 0). Then the
    per-frame 2-d conv."""

    def forward(self, x):
        n = x.shape[0]
        x = _frames_3d(F.interpolate(_frames_2d(x), scale_factor=2.0), n, x.shape[2])
        if self.compress_time:
            first = _holds_first_frame(group)
            rest = x[:, :, 1:] if first else x
            rest = rest.repeat_interleave(2, dim=2)
            x = torch.cat([x[:, :, :1], rest], dim=2) if first else rest
        return _frames_3d(self.conv(_frames_2d(x)), n, x.shape[2])

    _override(m, forward)


def _nearest_frames(z, t, h, w):
    """z (N, C, Tz, Hz, Wz) to (t, h, w) by nearest: torch's interpolate,
    which refuses empty tensors, with time repeated when t is a multiple of Tz."""
    if t == 0 or z.shape[2] == 0 or t % z.shape[2]:
        return F.interpolate(z, size=(t, h, w)) if t and z.shape[2] else z.new_zeros(*z.shape[:2], t, h, w)
    n, tz = z.shape[0], z.shape[2]
    z = _frames_3d(F.interpolate(_frames_2d(z), size=(h, w)), n, tz)
    return z.repeat_interleave(t // z.shape[2], dim=2)


def _cog_spatial_norm(m, group):
    """CogVideoXSpatialNorm3D: the latents zq brought to f's size by nearest,
    the clip's first frame on its own (rank 0's), the rest by blocks of
    frames that stay on their rank; GroupNorm across ranks; no conv cache."""

    def forward(self, f, zq, conv_cache=None):
        t, h, w = f.shape[2:]
        if _holds_first_frame(group) and t > 1:
            zq = torch.cat([_nearest_frames(zq[:, :, :1], 1, h, w), _nearest_frames(zq[:, :, 1:], t - 1, h, w)], 2)
        else:
            zq = _nearest_frames(zq, t, h, w)
        y, _ = self.conv_y(zq)
        b, _ = self.conv_b(zq)
        return self.norm_layer(f) * y + b, {}

    _override(m, forward)


# ------------------------------------------------------------ the tables

# Model-level settings, by class (diffusers' own name); the blocks by type.
_MODELS = {
    "AutoencoderKLLTXVideo": _ltx_model,
    "AutoencoderKLCogVideoX": _cogvideox_model,
}


def _blocks():
    return {
        "LTXVideoDownsampler3d": _ltx_downsampler,
        "LTXVideoUpsampler3d": _ltx_upsampler,
        "LTXVideoCausalConv3d": _ltx_causal_conv,
        "LTXVideoDecoder3d": _ltx_decoder,
        "CogVideoXCausalConv3d": _cog_causal_conv,
        "CogVideoXDownsample3D": _cog_downsample,
        "CogVideoXUpsample3D": _cog_upsample,
        "CogVideoXSpatialNorm3D": _cog_spatial_norm,
    }


# ------------------------------------------------------------ the split


@dataclass(frozen=True)
class Shard:
    """One rank's part of a clip: input frames ``[offset, offset + length)``
    and latent frames ``[latent_offset, latent_offset + latent_length)``."""

    rank: int
    offset: int
    length: int
    latent_offset: int
    latent_length: int


@dataclass(frozen=True)
class ClipSplit:
    """How a clip of ``num_frames = 1 + compression * sum(groups)`` frames is
    sharded: rank 0 holds ``1 + compression * groups[0]`` frames, rank i > 0
    ``compression * groups[i]``; their latents are ``1 + groups[0]`` and
    ``groups[i]`` frames. ``shards`` is the public table of every rank's
    offsets and lengths."""

    num_frames: int
    compression: int
    groups: tuple[int, ...]

    @property
    def world(self) -> int:
        return len(self.groups)

    @property
    def lengths(self) -> tuple[int, ...]:
        return tuple(self.compression * k + (r == 0) for r, k in enumerate(self.groups))

    @property
    def latent_lengths(self) -> tuple[int, ...]:
        return tuple(k + (r == 0) for r, k in enumerate(self.groups))

    @property
    def shards(self) -> tuple[Shard, ...]:
        out, a, la = [], 0, 0
        for r, (n, m) in enumerate(zip(self.lengths, self.latent_lengths)):
            out.append(Shard(r, a, n, la, m))
            a, la = a + n, la + m
        return tuple(out)


def temporal_compression(vae) -> int:
    """The VAE's temporal compression ratio r (a clip of 1 + r*k frames has
    1 + k latent frames), as the model or its config holds it."""
    r = vae.__dict__.get("temporal_compression_ratio") or vae.config.get("temporal_compression_ratio")
    return int(r)


def split_clip(num_frames: int, world: int, compression: int, groups=None) -> ClipSplit:
    """The split of a ``1 + compression * k`` frame clip over ``world`` ranks:
    balanced (the k groups of ``compression`` frames spread as evenly as
    they go, the spare ones to the last ranks, since rank 0 also holds the
    first frame), or ``groups`` (each rank's count k_i >= 0) as given."""
    if world < 1 or compression < 1:
        raise ValueError(f"split_clip: world ({world}) and compression ({compression}) must be positive")
    k, rest = divmod(num_frames - 1, compression)
    if num_frames < 1 or rest:
        raise ValueError(f"split_clip: a clip of {num_frames} frames is not 1 + {compression} * k frames")
    if groups is None:
        q, spare = divmod(k, world)
        groups = [q + (r >= world - spare) for r in range(world)]
    groups = tuple(int(g) for g in groups)
    if len(groups) != world or min(groups) < 0 or sum(groups) != k:
        raise ValueError(f"split_clip: groups {list(groups)} are not {world} counts >= 0 summing to {k}")
    return ClipSplit(num_frames, compression, groups)


def _rank_of(split, group):
    world, rank = world_and_rank(group)
    if world != split.world:
        raise ValueError(f"halocp.diffusers: a split over {split.world} ranks used on a group of {world}")
    return rank


def shard_clip(clip: torch.Tensor, split: ClipSplit, group=None, *, dim: int = 2, latent: bool = False):
    """This rank's frames (or latent frames) of a whole ``clip`` along ``dim``:
    a view, as ``narrow`` gives."""
    s = split.shards[_rank_of(split, group)]
    want = split.latent_lengths if latent else split.lengths
    if clip.shape[dim] != sum(want):
        raise ValueError(f"shard_clip: the clip has {clip.shape[dim]} frames along dim {dim}, the split "
                         f"{sum(want)}")
    return clip.narrow(dim, s.latent_offset, s.latent_length) if latent else clip.narrow(dim, s.offset, s.length)


def gather_clip(local: torch.Tensor, split: ClipSplit, group=None, *, dim: int = 2, latent: bool = False):
    """The whole clip on every rank, from each rank's frames (or latent
    frames) along ``dim``: collective over ``group``, not differentiable."""
    rank = _rank_of(split, group)
    dim %= local.dim()
    lengths = split.latent_lengths if latent else split.lengths
    if local.shape[dim] != lengths[rank]:
        raise ValueError(f"gather_clip: rank {rank} holds {local.shape[dim]} frames along dim {dim}, the "
                         f"split says {lengths[rank]}")
    if not distributed(group) or split.world == 1:
        return local.detach().clone()
    # all_gather wants one shape: pad every shard to the longest.
    longest = max(lengths)
    padded = local.detach().new_zeros(*local.shape[:dim], longest, *local.shape[dim + 1:])
    padded.narrow(dim, 0, local.shape[dim]).copy_(local.detach())
    parts = [torch.empty_like(padded) for _ in lengths]
    dist.all_gather(parts, padded.contiguous(), group=group)
    return torch.cat([p.narrow(dim, 0, n) for p, n in zip(parts, lengths)], dim=dim)
