"""Who holds what along a sharded dim: the group's size and this rank's
place in it, and how to say where the rows of a shard table (halocp._splits,
every rank's shard with the arguments its layer was built with) disagree.
A leaf module: it imports nothing of the package.
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


def disagreement(table, columns) -> str | None:
    """The ranks whose rows differ from rank 0's in the named columns
    (``columns`` maps a column index to its name), spelled the same on every
    rank; None when they all agree."""
    bad = [r for r, row in enumerate(table) if any(row[i] != table[0][i] for i in columns)]
    if not bad:
        return None
    return "; ".join(f"rank {r}: " + ", ".join(f"{name} {table[r][i]}" for i, name in columns.items())
                     for r in [0] + bad)
