"""Attention over a token sequence sharded along time, causal by frame.

The tokens are ordered by frame (each frame ``tokens_per_frame`` tokens, as
a video's (frame, h, w) tokens flattened), and each rank holds the tokens of
its frames: rank 0 the first ones, rank 1 the next, and so on, any number of
frames per rank (none included). A token attends every token of its own
frame and of every earlier frame, on its rank or an earlier one: the
context-parallel form of HunyuanVideo's VAE attention
(``prepare_causal_attention_mask``).

One autograd Function gathers every rank's keys and values (one all_gather,
each rank's padded to the longest shard, since all_gather wants one shape);
its backward returns each rank the gradients of its own keys and values,
summed over the ranks whose queries read them (one all_reduce of the padded
buffer: gloo has no reduce-scatter). Each rank then attends its queries to
the keys of its own and every earlier rank's frames with torch's
scaled_dot_product_attention and a frame mask; autograd runs through it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from . import _lib
from ._lib import HaloError
from ._sharding import disagreement, distributed, shard_table, world_and_rank

__all__ = ["causal_frame_attention"]

# What every rank sends first: its token count and what the ranks must
# agree on, so that a mismatch raises on every rank alike before the gather.
_ROW = ("tokens", "batch", "heads", "head dim", "value dim", "tokens per frame", "input grad", "dtype")
_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


class _GatherKeysValues(torch.autograd.Function):
    """Every rank's keys and values, concatenated along the sequence in rank
    order; the backward gives each rank the summed gradient of its own."""

    @staticmethod
    def forward(ctx, k, v, lengths, rank, group):
        longest = max(lengths)
        n = k.shape[2]
        parts = []
        for t in (k, v):
            padded = t.new_zeros(*t.shape[:2], longest, t.shape[3])
            padded[:, :, :n] = t
            parts.append(padded)
        buf = torch.cat(parts, 3)  # (B, H, longest, Dk + Dv): one message
        gathered = [torch.empty_like(buf) for _ in lengths]
        dist.all_gather(gathered, buf, group=group)
        full = torch.cat([g[:, :, :m] for g, m in zip(gathered, lengths)], 2)
        ctx.lengths, ctx.rank, ctx.group, ctx.dk = lengths, rank, group, k.shape[3]
        return full[..., :ctx.dk].contiguous(), full[..., ctx.dk:].contiguous()

    @staticmethod
    def backward(ctx, grad_k, grad_v):
        lengths, dk = ctx.lengths, ctx.dk
        longest = max(lengths)
        grad = torch.cat([grad_k, grad_v], 3)
        padded = grad.new_zeros(len(lengths), *grad.shape[:2], longest, grad.shape[3])
        start = 0
        for r, m in enumerate(lengths):
            padded[r, :, :, :m] = grad[:, :, start:start + m]
            start += m
        dist.all_reduce(padded, group=ctx.group)
        mine = padded[ctx.rank, :, :, :lengths[ctx.rank]]
        return mine[..., :dk].contiguous(), mine[..., dk:].contiguous(), None, None, None


def causal_frame_attention(q: Tensor, k: Tensor, v: Tensor, tokens_per_frame: int, group=None,
                           scale: float | None = None) -> Tensor:
    """Attention of this rank's queries ``q`` (N, heads, L, E) to the keys
    ``k`` (N, heads, L, E) and values ``v`` (N, heads, L, Ev) of its own
    frames and every earlier rank's: token i of global frame f attends the
    tokens of frames 0 .. f. ``L`` is this rank's token count, a multiple of
    ``tokens_per_frame`` (zero on a rank without frames); the ranks hold
    consecutive frames in rank order. ``scale`` is the logits' factor
    (``None``: 1/sqrt(E), as scaled_dot_product_attention's). Collective
    over ``group`` (``None``: the default group, or one process holding the
    whole sequence); every rank calls it, and, if any does, every rank runs
    its backward. Returns (N, heads, L, Ev), this rank's part of the whole
    sequence's attention; the gradients of the keys and values go back to
    the ranks that hold them. Ranks that disagree on the shapes, the dtype
    or whether a gradient is needed all raise one ``HaloError``
    (``ERR_MISMATCH``), as does a length that is not whole frames; inputs
    that one rank refuses (shapes that do not go together, dtypes or
    devices that differ), ``ERR_INVALID_ARGUMENT`` on every rank, naming it.
    """
    world, rank = world_and_rank(group)
    # Which inputs need a gradient (1: q, 2: k or v) is agreed too: the
    # ranks whose keys and values need one run the backward's all_reduce.
    grad = torch.is_grad_enabled() and (q.requires_grad + 2 * (k.requires_grad or v.requires_grad))
    shapes_ok = q.dim() == k.dim() == v.dim() == 4 and q.shape[:3] == k.shape[:3] == v.shape[:3] and \
        q.shape[3] == k.shape[3] and q.dtype == k.dtype == v.dtype and q.device == k.device == v.device
    n_batch, heads, length, dim = q.shape if shapes_ok else (-1,) * 4
    row = [length, n_batch, heads, dim, v.shape[-1], int(tokens_per_frame), int(grad),
           _DTYPES.index(q.dtype) if q.dtype in _DTYPES else -1]
    # A rank that refuses its own inputs still sends its row (the others
    # are in the gather already), so that every rank raises.
    table = shard_table(row, group, q.device) if distributed(group) and world > 1 else [row]
    refused = [r for r, t in enumerate(table) if t[0] < 0]
    if refused:
        mine = f"; rank {rank}'s: {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}" if rank in refused else ""
        raise HaloError(_lib.ERR_INVALID_ARGUMENT,
                        f"halocp.causal_frame_attention: q, k and v want (N, heads, L, E) with one (N, heads, L), "
                        f"one E for q and k, one dtype and device; not on rank(s) "
                        f"{', '.join(map(str, refused))}{mine}")
    found = disagreement(table, {i: name for i, name in enumerate(_ROW) if i})
    partial = [f"rank {r}: {t[0]} tokens" for r, t in enumerate(table)
               if t[5] <= 0 or t[0] % max(t[5], 1)]
    if found or partial:
        what = f"the ranks disagree ({found})" if found else \
            f"a shard that is not whole frames of {tokens_per_frame} tokens ({'; '.join(partial)})"
        raise HaloError(_lib.ERR_MISMATCH, f"halocp.causal_frame_attention: {what}")
    lengths = [t[0] for t in table]
    first = sum(lengths[:rank])  # this rank's first token, globally
    if world > 1:
        k, v = _GatherKeysValues.apply(k, v, lengths, rank, group)
    # Keys past this rank's last frame are masked for all its queries: left out.
    end = first + length
    k, v = k[:, :, :end], v[:, :, :end]
    if length == 0:
        # No queries: an empty output, still in the graph of the gathered
        # keys and values, so that this rank runs their backward's collective.
        return (q @ k.transpose(-1, -2)) @ v
    query_frame = (first + torch.arange(length, device=q.device)) // tokens_per_frame
    key_frame = torch.arange(end, device=q.device) // tokens_per_frame
    mask = key_frame[None, :] <= query_frame[:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)

