"""Where a layer's outputs fall when its input is sharded along a dim: every
rank's shard length and the layer's window along that dim in one small
exchange (which also checks that the ranks agree on the window), and the
split of the global outputs it gives. The convolutions of halocp.nn and the
pooling layers of halocp.pool share it; the compiled path's conv_split op
runs it too.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import _lib
from ._lib import HaloError
from ._sharding import world_and_rank
from .exchange import halos


class ShardTable:
    """Every rank's shard length along a sharded dim, with its layer's
    arguments (COLUMNS for a convolution or a pooling; ConvTranspose3d has
    its own row): one halos-only exchange of one row of integers per rank,
    whose halos reach every other rank: the one shard table of halocp.
    Every rank sees the same table, so a disagreement raises the same error
    on all of them."""

    COLUMNS = ("length", "kernel", "stride", "dilation", "left padding", "right padding")

    @staticmethod
    def rows(group, row):
        world = dist.get_world_size(group)
        mine = torch.tensor([row], dtype=torch.float64)
        if world == 1:
            return mine
        before, after = halos(mine, world - 1, world - 1, 0, group)
        rank = dist.get_rank(group)
        return torch.cat([before[world - 1 - rank:], mine, after[:world - 1 - rank]])

    @staticmethod
    def of(group, row) -> list[list[int]]:
        """Every rank's row of integers, in rank order, as lists; one
        process holding the whole tensor (no group, torch.distributed not
        initialised) has its own row alone."""
        if world_and_rank(group)[0] == 1:
            return [[int(v) for v in row]]
        return [[int(v) for v in r] for r in ShardTable.rows(group, row).tolist()]


def outputs(stride, e, pl, pr, lengths, rank):
    """(phase, count) of rank's outputs along a dim split in lengths."""
    a, total = sum(lengths[:rank]), sum(lengths)
    count = (total + pl + pr - e - 1) // stride + 1 if total + pl + pr > e else 0
    first = min(-(-a // stride), count)
    last = count if rank == len(lengths) - 1 else min(-(-(a + lengths[rank]) // stride), count)
    return first * stride - a, max(last - first, 0)


def count_bounds(stride, e, pl, pr, n, rank, world):
    """(fewest, most) outputs that rank may have along a dim, knowing its
    own shard length n and place alone (what a traced graph knows before the
    other ranks' lengths arrive): equal when that decides the count, as for
    rank 0 (its shard starts the dim) where the padding covers the kernel,
    and for a rank whose length is a multiple of the stride but for the last
    one. tests/python/test_compile.py checks them against ``outputs`` over
    every split of up to 3 ranks."""
    d = pl + pr - e
    whole = (n + d - 1) // stride + 1 if n + d > 0 else 0  # the count were this shard the whole dim
    if world == 1:
        return whole, whole
    ceil = -(-n // stride)
    if rank == 0:  # at most the later ranks are empty, and short of the kernel (d < 0), clip its last outputs
        return (ceil if d >= 0 else min(ceil, whole)), ceil
    if rank == world - 1:  # up to the dim's end, from an offset of any phase
        return max((n + d) // stride, 0), whole
    return (n // stride if d >= 0 else min(n // stride, max((n + d) // stride, 0))), ceil


def split(layer_name, dim, group, row, what="convolution"):
    """(phase, count) of this rank's outputs along dim, from row (its shard
    length and the layer's convolution along dim; see ShardTable.COLUMNS)
    and every other rank's: one exchange of the table, which also checks
    that the ranks agree on the convolution."""
    return split_and_lengths(layer_name, dim, group, row, what)[:2]


def split_and_lengths(layer_name, dim, group, row, what="convolution"):
    """split's (phase, count), and every rank's shard length."""
    table = ShardTable.rows(group, row)
    agree(layer_name, table, dim, what)
    _, k, s, dil, pl, pr = row
    lengths = [int(v) for v in table[:, 0].tolist()]
    return (*outputs(s, dil * (k - 1), pl, pr, lengths, dist.get_rank(group)), lengths)


def agree(layer_name, table, dim, what="convolution"):
    rows = table[:, 1:]
    bad = [r for r in range(len(rows)) if not torch.equal(rows[r], rows[0])]
    if bad:
        have = "; ".join(f"rank {r}: " + ", ".join(f"{c} {int(v)}" for c, v in zip(ShardTable.COLUMNS[1:],
                                                                                      rows[r].tolist()))
                         for r in [0] + bad)
        raise HaloError(_lib.ERR_MISMATCH,
                        f"halocp.nn: {layer_name}: the ranks sharing dim {dim} disagree on the "
                        f"{what} along it ({have})")
