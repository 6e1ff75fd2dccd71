"""Who holds what along a sharded dim: the group's size and this rank's
place in it, and a table of every rank's shard with the arguments its layer
was built with. A leaf module: it imports nothing of the package.

The table travels through the group's own torch.distributed collective
(gloo on CPU, NCCL on GPU), as the statistics of halocp.nn.GroupNorm do.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def distributed(group) -> bool:
    """False when one process holds the whole tensor: no group given and
    torch.distributed not initialised (the layers' ``group=None``)."""
    return group is not None or (dist.is_available() and dist.is_initialized())


def world_and_rank(group) -> tuple[int, int]:
    if not distributed(group):
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def shard_table(row, group, device) -> list[list[int]]:
    """Every rank's row of integers, in rank order: one all_gather of one
    small tensor on ``device`` (NCCL wants it on the GPU)."""
    world, _ = world_and_rank(group)
    if world == 1:
        return [list(row)]
    mine = torch.tensor(row, dtype=torch.int64, device=device)
    rows = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(rows, mine, group=group)
    return [r.tolist() for r in rows]


def disagreement(table, columns) -> str | None:
    """The ranks whose rows differ from rank 0's in the named columns
    (``columns`` maps a column index to its name), spelled the same on every
    rank; None when they all agree."""
    bad = [r for r, row in enumerate(table) if any(row[i] != table[0][i] for i in columns)]
    if not bad:
        return None
    return "; ".join(f"rank {r}: " + ", ".join(f"{name} {table[r][i]}" for i, name in columns.items())
                     for r in [0] + bad)
