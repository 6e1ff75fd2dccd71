"""What every model's converters share: halocp.nn's layers in place of
torch's, sharing the model's Parameters; a block's forward overridden; the
layers left after the blocks; the check that nothing over time is left."""

from __future__ import annotations

import types

import torch
from torch import Tensor

from .. import _lib
from .._comm import token_group
from .._shapes import is_compiling
from ..exchange import _token
from .. import nn as cpnn
from .._lib import HaloError
from .split import temporal_compression
from .._sharding import world_and_rank
from .._splits import ShardTable


def replace(parent, name, new):
    parent._modules[name] = new


def adopt(new, old):
    """Give ``new`` (built on the meta device) ``old``'s parameters, the
    same Parameter objects, so optimisers and state_dict see no change."""
    new.weight = old.weight
    if old.bias is not None:
        new.bias = old.bias
    return new


def conv3d(conv, group, causal, temporal_padding_mode):
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
    return adopt(new, conv)


def groupnorm(norm, group):
    new = cpnn.GroupNorm(norm.num_groups, norm.num_channels, norm.eps, norm.affine, device="meta", group=group,
                         dim=2)
    if norm.affine:
        adopt(new, norm)
    return new



class FrameGroupNorm(torch.nn.Module):
    """A model's GroupNorm whose statistics are per frame (the frames are its
    batch: Mochi's chunked norm, Allegro's 2-d blocks), so local; held apart
    from torch's GroupNorm, which convert_layers takes for a norm over
    time. The model's own Parameters, under the same names."""

    def __init__(self, norm):
        super().__init__()
        self.num_groups, self.num_channels, self.eps, self.affine = \
            norm.num_groups, norm.num_channels, norm.eps, norm.affine
        self.weight, self.bias = norm.weight, norm.bias

    def forward(self, x):
        return torch.nn.functional.group_norm(x, self.num_groups, self.weight, self.bias, self.eps)

    def extra_repr(self):
        return f"{self.num_groups}, {self.num_channels}, eps={self.eps}, affine={self.affine}, per frame"

def holds_first_frame(group) -> bool:
    """Whether this rank holds the clip's first frame: rank 0 of the group,
    as split_clip puts it (a rank 0 with no frames is not supported)."""
    return world_and_rank(group)[1] == 0


def override(module, forward):
    module.forward = types.MethodType(forward, module)


def convert_layers(vae, group):
    """The torch layers left after the blocks, by type: GroupNorm (its
    statistics span time) and Conv3d one frame long in time (it needs no
    context, but torch's refuses an empty shard)."""
    for parent in list(vae.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not torch.nn.GroupNorm and not (
                    isinstance(child, torch.nn.Conv3d) and not isinstance(child, cpnn._ContextParallelConv3d)):
                continue
            if isinstance(child, torch.nn.GroupNorm):
                replace(parent, name, groupnorm(child, group))
            elif child.kernel_size[0] == 1 and child.stride[0] == 1 and child.padding[0] == 0 and \
                    child.padding_mode == "zeros":
                replace(parent, name, conv3d(child, group, True, "zeros"))


def check_converted(vae, model):
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


def refuse_tiling(vae, *args, **kwargs):
    raise RuntimeError(f"halocp.diffusers: a parallelized {type(vae).__name__} shards the clip along time instead "
                       "of tiling it; leave tiling off")


def no_tiling(vae):
    """Replace the model's own ways round a long clip (frame batches,
    temporal and spatial tiles, slices) by the sharding: off, and the tiled
    calls refused (a tile's norms and the first-frame rules would see the
    tile alone)."""
    for flag in ("use_tiling", "use_slicing", "use_framewise_encoding", "use_framewise_decoding"):
        if hasattr(vae, flag):
            setattr(vae, flag, False)
    for method in ("tiled_encode", "tiled_decode", "_temporal_tiled_encode", "_temporal_tiled_decode"):
        if hasattr(vae, method):
            setattr(vae, method, types.MethodType(refuse_tiling, vae))


def fold_time_space(x, stride):
    """(N, C, T, H, W) -> (N, C*st*sh*sw, T/st, H/sh, W/sw), the channel
    index running over (c, t-phase, h-phase, w-phase), the last fastest."""
    n, c, t, h, w = x.shape
    st, sh, sw = stride
    x = x.reshape(n, c, t // st, st, h // sh, sh, w // sw, sw)
    return x.permute(0, 1, 3, 5, 7, 2, 4, 6).reshape(n, c * st * sh * sw, t // st, h // sh, w // sw)


def unfold_time_space(x, stride):
    """The inverse of fold_time_space."""
    n, c, t, h, w = x.shape
    st, sh, sw = stride
    x = x.reshape(n, c // (st * sh * sw), st, sh, sw, t, h, w)
    return x.permute(0, 1, 5, 2, 6, 3, 7, 4).reshape(n, c // (st * sh * sw), t * st, h * sh, w * sw)



def frames_2d(x):
    """(N, C, T, H, W) -> (N*T, C, H, W), frame by frame."""
    n, c, t, h, w = x.shape
    return x.transpose(1, 2).reshape(n * t, c, h, w)


def frames_3d(y, n, t):
    """The inverse of frames_2d."""
    return y.reshape(n, t, *y.shape[1:]).transpose(1, 2)




class FrameCountError(HaloError, ValueError):
    """check_frames' refusal: a HaloError, as halocp's layers refuse a bad
    shard, and a ValueError, as the converted models first raised it."""


FrameCountError.__module__ = "halocp.diffusers"


def checked_calls(vae):
    """vae's ``_encode`` and ``_decode`` check their shard's frames first
    (check_frames), as methods bound to the model (a deepcopy binds them to
    the copy)."""
    encode, decode = type(vae)._encode, type(vae)._decode

    def _encode(self, x, *args, **kwargs):
        return encode(self, check_frames(self, x, False), *args, **kwargs)

    def _decode(self, z, *args, **kwargs):
        return decode(self, check_frames(self, z, True), *args, **kwargs)

    vae._encode, vae._decode = types.MethodType(_encode, vae), types.MethodType(_decode, vae)


def check_frames(vae, x, latent, first_frame=True):
    """x, once its shard's frames are checked against the split: refused, on
    every rank alike, where the split does not allow them: rank 0 holds
    1 + r*k0 frames (1 + k0 latent frames), rank i > 0 r*ki (ki latent
    frames); without ``first_frame`` (a model that treats no frame apart)
    every rank r*ki. Without this a wrong length would give wrong frames,
    silently: the strided convs would still agree on some split. One small
    exchange of every rank's length (the shard table).

    Under torch.compile the check is an op (the table is read on the host,
    which a graph cannot) whose result is a copy of x that the model computes
    on: a graph orders its exchanges by their data alone, so the check comes
    before the model's first exchange on every rank, and is never dropped
    as unused. The copy costs one pass over the input."""
    # (temporal_compression: CogVideoX holds it in its config alone, whose
    # attribute access warns, which breaks a compiled graph)
    r = 1 if latent else temporal_compression(vae)
    if is_compiling():
        return torch.ops.halocp.check_frames(x, _token(vae._halocp_group), type(vae).__name__, latent, r,
                                             first_frame)
    _check_frames(vae._halocp_group, x, type(vae).__name__, latent, r, first_frame)
    return x


def _check_frames(group, x, model, latent, r, first_frame):
    first = int(first_frame)
    table = ShardTable.of(group, [x.shape[2] if x.dim() == 5 else -1])
    bad = [(i, n) for i, (n,) in enumerate(table) if n < first * (i == 0) or (n - first * (i == 0)) % r]
    if bad:
        what = "latent frames" if latent else "frames"
        rule = (f"every rank holds {r}*k {what} (k >= 0)" if not first_frame else
                f"rank 0 holds 1 + {r}*k0 {what}, rank i > 0 {r}*ki (k >= 0)" if r > 1 else
                "rank 0 holds at least one latent frame")
        raise FrameCountError(_lib.ERR_INVALID_ARGUMENT, f"halocp.diffusers: {model}."
                              f"{'decode' if latent else 'encode'}: " + "; ".join(
            f"rank {i} holds {n} {what}" if n >= 0 else f"rank {i}'s input is not (N, C, T, H, W)"
            for i, n in bad) + f": the split wants {rule} (split_clip)")


@torch.library.custom_op("halocp::check_frames", mutates_args=())
def _check_frames_op(x: Tensor, group: str, model: str, latent: bool, r: int, first_frame: bool) -> Tensor:
    _check_frames(token_group(group), x, model, latent, r, first_frame)
    return x.clone()  # an op's output never aliases its input


@_check_frames_op.register_fake
def _(x, group, model, latent, r, first_frame):
    return torch.empty_like(x)


_check_frames_op.register_autograd(lambda ctx, grad: (grad,) + (None,) * 5)
