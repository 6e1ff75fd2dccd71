"""diffusers' video VAEs sharded along time, in one call.

    vae = halocp.diffusers.parallelize_vae(vae, group=cp_group)
    split = halocp.diffusers.split_clip(clip.shape[2], world, halocp.diffusers.temporal_compression(vae),
                                        first_frame=halocp.diffusers.first_frame(vae))
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

One module per model family (ltx, cogvideox, mochi, wan, ...) holds its converters: a
``MODELS`` table (class name -> the model-level step) and a ``BLOCKS`` table
(block type name -> its converter); ``_convert`` what they share; ``split``
the clip's sharding. diffusers is imported only when a VAE is converted:
halocp needs none of it.
"""

from __future__ import annotations

from . import _convert as cv
from . import allegro, cogvideox, hunyuan_video, ltx, mochi, wan
from ._convert import FrameCountError
from .split import ClipSplit, Shard, gather_clip, shard_clip, split_clip, temporal_compression

__all__ = ["parallelize_vae", "supported_classes", "temporal_compression", "first_frame", "split_clip", "ClipSplit",
           "Shard", "shard_clip", "gather_clip", "FrameCountError"]

# The families, in the order supported_classes lists them.
_FAMILIES = (ltx, cogvideox, mochi, hunyuan_video, wan, allegro)


def _table(name):
    table = {}
    for family in _FAMILIES:
        for key, value in getattr(family, name).items():
            if key in table:
                raise RuntimeError(f"halocp.diffusers: {key} is in two families' {name}")
            table[key] = value
    return table


_MODELS = _table("MODELS")
_BLOCKS = _table("BLOCKS")
_NO_FIRST_FRAME = {name for family in _FAMILIES for name in getattr(family, "NO_FIRST_FRAME", ())}


def supported_classes() -> tuple[str, ...]:
    """The diffusers VAE classes parallelize_vae converts."""
    return tuple(_MODELS)


def first_frame(vae) -> bool:
    """Whether ``vae`` treats the clip's first frame apart (a clip of
    1 + r*k frames, rank 0 holding the extra one), as every supported model
    but Allegro does: :func:`split_clip`'s ``first_frame``."""
    return not any(c.__name__ in _NO_FIRST_FRAME for c in type(vae).__mro__)


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
    # Blocks first (a block converts the layers inside it), then the layers
    # left, by type; each module is converted once.
    for module in list(vae.modules()):
        convert = _BLOCKS.get(type(module).__name__)
        if convert is not None and not getattr(module, "_halocp", False):
            convert(module, group)
            module._halocp = True
    cv.convert_layers(vae, group)
    cv.check_converted(vae, model)
    vae._halocp_group = group
    return vae

