"""Halos of tensors tiled over a grid of ranks (H x W, T x H x W, ...).

A process group's ranks laid out on a grid, row-major, each holding one tile
of a global tensor; the tiles of a grid row have the same size along the
other dims, as in any tensor-product split. ``tile_halo_exchange`` pads a
tile with the halos of every tiled dim, corners included, by one exchange
per dim over the ranks of that dim's line, each on the previous one's padded
output (which carries the corners along). Forward and backward equal
``F.pad`` of the global tensor sliced at the tile.
"""

from __future__ import annotations

import math
import operator

import torch.distributed as dist
from torch import Tensor

from . import _lib
from ._comm import resolve_group
from ._lib import HaloError
from .exchange import cp_halo_exchange

__all__ = ["TileGrid", "tile_halo_exchange"]


class TileGrid:
    """The ranks of ``group`` on a grid of ``shape``, in row-major order:
    group rank r sits at ``coords`` = the row-major index of r in ``shape``
    (the last grid dim varies fastest).

    ``groups[i]`` is the process group of the ranks on this rank's line
    along grid dim i (those whose coordinates differ from this rank's in
    dim i only), ordered by that coordinate: the group over which the tiles'
    halos along grid dim i travel. A grid dim of one rank has a group of one.

    Making a grid is collective over the **default** process group, as
    ``torch.distributed.new_group`` is: every process calls ``TileGrid`` with
    its own ``group`` and ``shape`` (several grids at once, as in DP x CP,
    are fine) and every line of every grid becomes a group, in one order on
    every process.
    """

    def __init__(self, shape, group=None):
        try:
            self.shape = tuple(operator.index(n) for n in shape)
        except TypeError:
            raise HaloError(_lib.ERR_INVALID_ARGUMENT, f"halocp: a grid shape is a sequence of ints, not {shape!r}") from None
        self.group = resolve_group(group)
        members = dist.get_process_group_ranks(self.group) if group is not None else list(range(dist.get_world_size()))
        if not self.shape or min(self.shape) < 1 or math.prod(self.shape) != len(members):
            raise HaloError(_lib.ERR_INVALID_ARGUMENT,
                            f"halocp: a grid of shape {self.shape} for a group of {len(members)} ranks: "
                            "the shape's product must be the group's size")
        rank = dist.get_rank(self.group)
        self.coords = _unravel(rank, self.shape)
        # Every process makes every line of every grid, in one order.
        grids = [None] * dist.get_world_size()
        dist.all_gather_object(grids, (tuple(members), self.shape))
        _check_agreement(grids)
        self.groups = [None] * len(self.shape)
        for ranks, shape in sorted(set(grids)):
            for i, line in _lines(ranks, shape):
                made = dist.new_group(list(line))
                if dist.get_rank() in line and ranks == tuple(members):
                    self.groups[i] = made

    @property
    def rank(self) -> int:
        """This rank's rank in ``group``."""
        return dist.get_rank(self.group)

    def __repr__(self):
        return f"<halocp.TileGrid {'x'.join(map(str, self.shape))}, rank at {self.coords}>"


def _check_agreement(grids) -> None:
    """Every rank of a group must lay it out on the same grid: ranks that
    disagree would exchange along different lines and compute on wrong data
    (or wait for a peer that never comes). Every process sees the whole
    gather, so every one fails alike, before any group is made or any data
    moves, naming each rank's grid."""
    shapes = {}
    for proc, (members, shape) in enumerate(grids):
        shapes.setdefault(members, {})[proc] = shape
    for members, by_proc in sorted(shapes.items()):
        if len(set(by_proc.values())) > 1:
            said = ", ".join(f"rank {members.index(p) if p in members else p}: "
                             f"{'x'.join(map(str, by_proc[p]))}" for p in sorted(by_proc))
            raise HaloError(_lib.ERR_MISMATCH,
                            f"halocp: the ranks of one group disagree on its TileGrid ({said}): "
                            "every rank must pass the same grid shape")


def _unravel(index: int, shape) -> tuple:
    coords = []
    for n in reversed(shape):
        coords.append(index % n)
        index //= n
    return tuple(reversed(coords))


def _lines(ranks, shape):
    """(grid dim, global ranks of one line along it) for every line of the
    grid whose group ranks 0.. are the global ``ranks``."""
    for i in range(len(shape)):
        stride = math.prod(shape[i + 1:])
        for r in range(len(ranks)):
            if _unravel(r, shape)[i] == 0:
                yield i, tuple(ranks[r + k * stride] for k in range(shape[i]))


def _halo_pairs(halos, count: int):
    if isinstance(halos, int):
        halos = [halos] * count
    pairs = []
    for h in halos:
        pairs.append((h, h) if isinstance(h, int) else tuple(h))
    if len(pairs) != count or any(len(p) != 2 for p in pairs):
        raise HaloError(_lib.ERR_INVALID_ARGUMENT,
                        f"halocp: halos are an int, or one int or (left, right) pair per grid dim ({count}), not {halos!r}")
    return pairs


def tile_halo_exchange(x: Tensor, halos, dims, grid: TileGrid, padding_mode: str = "zeros") -> Tensor:
    """Pad tile ``x`` with its halos along ``dims``, corners included.

    ``dims[i]`` is the tensor dim tiled over grid dim i; ``halos`` is one
    ``(left, right)`` pair (or one int for both sides) per grid dim, or one
    int for all. The result is ``F.pad`` of the global tensor with those
    halos (``padding_mode`` beyond its ends) sliced at this tile: the
    halos of each dim come from the neighbouring tiles along it, the corners
    from the diagonal ones. Differentiable: the gradient of ``x`` is its
    part of the global padded tensor's gradient, the halos' gradients
    added where the neighbours used ``x``'s slices.

    One :func:`halocp.cp_halo_exchange` per grid dim, in grid-dim order, on
    the previous one's output over ``grid.groups[i]``, so the corners ride
    along with the later dims' halos (the backward runs them in reverse).
    Collective over the whole grid. Tiles may differ in size (uneven
    splits), and halos may be longer than a tile; the output keeps x's
    memory format.
    """
    if not isinstance(grid, TileGrid):
        raise HaloError(_lib.ERR_INVALID_ARGUMENT, f"halocp: grid must be a halocp.TileGrid, not {type(grid).__name__}")
    dims = [dims] if isinstance(dims, int) else list(dims)
    pairs = _halo_pairs(halos, len(grid.shape))
    if len(dims) != len(grid.shape):
        raise HaloError(_lib.ERR_INVALID_ARGUMENT,
                        f"halocp: {len(dims)} dims {dims} for a {len(grid.shape)}-d grid {grid.shape}: one per grid dim")
    if isinstance(x, Tensor) and len({d % x.dim() for d in dims if -x.dim() <= d < x.dim()}) != len(dims):
        raise HaloError(_lib.ERR_INVALID_ARGUMENT, f"halocp: dims {dims} must be distinct dims of x")
    for (left, right), dim, group in zip(pairs, dims, grid.groups):
        x = cp_halo_exchange(x, left, right, dim, group, padding_mode)
    return x
