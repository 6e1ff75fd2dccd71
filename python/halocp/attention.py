"""Attention over a sequence sharded across a group: each rank's queries
against the whole sequence's keys and values, causal or not. The keys and
values a rank's queries need from the others come in one halo exchange (of
both side by side), its gradient going back to the ranks that hold them in
the exchange's backward."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ._sharding import world_and_rank
from ._splits import ShardTable
from .exchange import cp_halo_exchange

__all__ = ["cp_attention"]


def cp_attention(query: Tensor, key: Tensor, value: Tensor, *, causal: bool = False, scale: float | None = None,
                 group=None) -> Tensor:
    """This rank's part of ``F.scaled_dot_product_attention(query, key,
    value, is_causal=causal, scale=scale)`` over a sequence sharded along
    dim -2 in rank order (sdpa's layout ``(..., L, E)``): the ranks' outputs
    put together, and every gradient, are those of the attention over the
    whole sequence (self-attention: each rank holds the same positions of
    queries, keys and values; shards of any length, 0 included).

    Each rank brings in the keys and values of the positions before its
    shard (``causal``) or of the whole sequence but its own, as a halo as
    long as the longest any rank needs: memory of an all-gather of keys and
    values, never of the attention matrix's rows of another rank. Positions
    beyond the sequence and, when causal, after each query are masked.

    Collective over ``group`` (the shard table's small exchange of the
    lengths, then the exchange); shards whose query, key and value lengths differ
    are refused on every rank alike, naming them (``ValueError``).
    """
    n = query.shape[-2]
    ok = key.shape[-2] == n and value.shape[-2] == n and key.dim() == query.dim() == value.dim() >= 2
    _, rank = world_and_rank(group)
    row = [n, key.shape[-2], value.shape[-2], int(ok)]
    table = ShardTable.of(group, row)
    bad = [(r, row) for r, row in enumerate(table) if not row[3]]
    if bad:
        raise ValueError("halocp.cp_attention: query, key and value must hold the same positions of the sequence "
                         "(dim -2) on each rank; " + "; ".join(f"rank {r}: query {q}, key {k}, value {v}"
                                                              for r, (q, k, v, _) in bad))
    lengths = [row[0] for row in table]
    offset, total = sum(lengths[:rank]), sum(lengths)
    before = total - lengths[-1]                # the last rank's offset, the longest left halo
    after = 0 if causal else total - lengths[0]  # the first rank's tail, the longest right one

    e = key.shape[-1]
    kv = cp_halo_exchange(torch.cat([key, value], dim=-1), before, after, key.dim() - 2, group)
    key, value = kv[..., :e], kv[..., e:]

    at_key = torch.arange(offset - before, offset + n + after, device=query.device)
    mask = ((at_key >= 0) & (at_key < total))[None, :]
    if causal:
        mask = mask & (at_key[None, :] <= torch.arange(offset, offset + n, device=query.device)[:, None])
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale)
