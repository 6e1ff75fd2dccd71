"""How a clip is sharded along time for a VAE of temporal compression r:
rank 0 holds 1 + r*k0 frames, rank i > 0 r*ki (every rank r*ki for a VAE
that treats no frame apart: ``first_frame=False``); the public table of
every rank's offsets and lengths; the cut and the gather back."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .._sharding import distributed, world_and_rank

__all__ = ["temporal_compression", "split_clip", "ClipSplit", "Shard", "shard_clip", "gather_clip"]


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
    ``groups[i]`` frames. Without ``first_frame`` the clip is ``compression *
    sum(groups)`` frames and rank 0 holds no extra one. ``shards`` is the
    public table of every rank's offsets and lengths."""

    num_frames: int
    compression: int
    groups: tuple[int, ...]
    first_frame: bool = True

    @property
    def world(self) -> int:
        return len(self.groups)

    @property
    def lengths(self) -> tuple[int, ...]:
        return tuple(self.compression * k + (r == 0 and self.first_frame) for r, k in enumerate(self.groups))

    @property
    def latent_lengths(self) -> tuple[int, ...]:
        return tuple(k + (r == 0 and self.first_frame) for r, k in enumerate(self.groups))

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
    r = vae.__dict__.get("temporal_compression_ratio") or vae.config.get("temporal_compression_ratio") or \
        vae.config.get("scale_factor_temporal")  # Wan's name for it
    return int(r)


def split_clip(num_frames: int, world: int, compression: int, groups=None, *, first_frame: bool = True) -> ClipSplit:
    """The split of a ``1 + compression * k`` frame clip over ``world`` ranks:
    balanced (the k groups of ``compression`` frames spread as evenly as
    they go, the spare ones to the last ranks, since rank 0 also holds the
    first frame), or ``groups`` (each rank's count k_i >= 0) as given.
    ``first_frame=False``: a ``compression * k`` frame clip, for a VAE that
    treats no frame apart (:func:`first_frame`)."""
    if world < 1 or compression < 1:
        raise ValueError(f"split_clip: world ({world}) and compression ({compression}) must be positive")
    k, rest = divmod(num_frames - bool(first_frame), compression)
    if num_frames < bool(first_frame) or rest:
        raise ValueError(f"split_clip: a clip of {num_frames} frames is not {'1 + ' * bool(first_frame)}"
                         f"{compression} * k frames")
    if groups is None:
        q, spare = divmod(k, world)
        groups = [q + (r >= world - spare) for r in range(world)]
    groups = tuple(int(g) for g in groups)
    if len(groups) != world or min(groups) < 0 or sum(groups) != k:
        raise ValueError(f"split_clip: groups {list(groups)} are not {world} counts >= 0 summing to {k}")
    return ClipSplit(num_frames, compression, groups, bool(first_frame))


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
