"""Attention over a sequence sharded across a group: each rank's queries
against the whole sequence's keys and values, causal (by position, or by
frame for a video's flattened (frame, h, w) tokens) or not. The keys and
values a rank's queries need from the others come in one halo exchange (of
both side by side), their gradients going back to the ranks that hold them
in the exchange's backward. Mochi's VAE attends over frames causally,
HunyuanVideo's over (frame, h, w) tokens causally by frame: both run here."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from . import _lib
from ._lib import HaloError
from ._comm import token_group
from ._sharding import disagreement, world_and_rank
from ._shapes import is_compiling
from ._splits import ShardTable
from .exchange import _token, cp_halo_exchange

__all__ = ["cp_attention"]

# Every rank's row of the shard table: its length and what the ranks must
# agree on, so that a mismatch raises on every rank alike before the exchange.
_ROW = ("length", "batch", "heads", "key dim", "value dim", "tokens per frame", "causal", "dtype")
_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


def cp_attention(query: Tensor, key: Tensor, value: Tensor, *, causal: bool = False, tokens_per_frame: int = 1,
                 scale: float | None = None, group=None) -> Tensor:
    """This rank's part of ``F.scaled_dot_product_attention(query, key,
    value, scale=scale)`` over a sequence sharded along dim -2 in rank order
    (sdpa's layout ``(N, heads, L, E)``, values ``(N, heads, L, Ev)``): the
    ranks' outputs put together, and every gradient, are those of the
    attention over the whole sequence (self-attention: each rank holds the
    same positions of queries, keys and values; shards of any length, 0
    included). ``causal``: position i attends positions 0 .. i; with
    ``tokens_per_frame`` f, a frame's tokens attend their own frame's and
    every earlier frame's (HunyuanVideo's ``prepare_causal_attention_mask``),
    and every shard is whole frames.

    Each rank brings in the keys and values of the positions before its
    shard (``causal``) or of the whole sequence but its own, as a halo as
    long as the longest any rank needs: memory of an all-gather of keys and
    values, never of the attention matrix's rows of another rank. Positions
    beyond the sequence and, when causal, after each query's frame are masked.

    Collective over ``group`` (``None``: the default group, or one process
    holding the whole sequence): the shard table's small exchange, then the
    keys' and values'. Inputs one rank refuses (shapes that do not go
    together, another dtype or device) raise ``HaloError``
    (``ERR_INVALID_ARGUMENT``) on every rank, naming it; ranks that disagree
    on the shapes, the dtype, ``causal`` or ``tokens_per_frame``, or a shard
    that is not whole frames, ``ERR_MISMATCH`` on every rank.

    Under torch.compile, one op (below).
    """
    if is_compiling():
        return torch.ops.halocp.attention(query, key, value, causal, int(tokens_per_frame), scale, _token(group))
    ok = query.dim() == key.dim() == value.dim() == 4 and query.shape[:3] == key.shape[:3] == value.shape[:3] \
        and query.shape[3] == key.shape[3] and query.dtype == key.dtype == value.dtype \
        and query.device == key.device == value.device and query.dtype in _DTYPES
    n, batch, heads, e = (query.shape[2], query.shape[0], query.shape[1], query.shape[3]) if ok else (-1,) * 4
    row = [n, batch, heads, e, value.shape[-1] if ok else -1, int(tokens_per_frame), int(causal),
           _DTYPES.index(query.dtype) if ok else -1]
    _, rank = world_and_rank(group)
    # A rank that refuses its own inputs still sends its row, so that every rank raises.
    table = ShardTable.of(group, row)
    refused = [r for r, t in enumerate(table) if t[0] < 0]
    if refused:
        mine = f"; rank {rank}'s: query {tuple(query.shape)} {query.dtype}, key {tuple(key.shape)} {key.dtype}, " \
               f"value {tuple(value.shape)} {value.dtype}" if rank in refused else ""
        raise HaloError(_lib.ERR_INVALID_ARGUMENT,
                        "halocp.cp_attention: query, key and value want (N, heads, L, E) with one (N, heads, L), "
                        "one E for query and key, one floating dtype and device; not on rank(s) "
                        f"{', '.join(map(str, refused))}{mine}")
    found = disagreement(table, {i: name for i, name in enumerate(_ROW) if i})
    partial = [f"rank {r}: {t[0]} positions" for r, t in enumerate(table) if t[5] <= 0 or t[0] % max(t[5], 1)]
    if found or partial:
        what = f"the ranks disagree ({found})" if found else \
            f"a shard that is not whole frames of {tokens_per_frame} tokens ({'; '.join(partial)})"
        raise HaloError(_lib.ERR_MISMATCH, f"halocp.cp_attention: {what}")
    lengths = [t[0] for t in table]
    offset, total = sum(lengths[:rank]), sum(lengths)
    before = total - lengths[-1]                # the last rank's offset, the longest left halo
    after = 0 if causal else total - lengths[0]  # the first rank's tail, the longest right one

    kv = cp_halo_exchange(torch.cat([key, value], dim=-1), before, after, 2, group)
    key, value = kv[..., :e], kv[..., e:]

    at_key = torch.arange(offset - before, offset + n + after, device=query.device)
    mask = ((at_key >= 0) & (at_key < total))[None, :]
    if causal:
        f = tokens_per_frame
        mask = mask & (at_key[None, :].div(f, rounding_mode="floor") <=
                       torch.arange(offset, offset + n, device=query.device)[:, None] // f)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale)


# ------------------------------------------------------ torch.library ops
# For torch.compile (exchange.py says why ops): the shard table is read on
# the host and sizes the halos (every rank's length), which a graph cannot
# do, while the output's shape is the query's: the whole attention is one
# op. Its backward op runs it again under autograd and takes its gradients,
# exchanges included (the forward recomputed once, as under checkpointing);
# every rank's backward makes the same exchanges in the same order.


def _autograd_on():
    """A guard under which autograd records again inside an op's
    implementation: torch.library runs one with the autograd dispatch keys
    excluded (its autograd wrapper's redispatch, below autograd), which
    enable_grad alone does not undo."""
    keys = torch._C._dispatch_tls_local_exclude_set()
    for name in ("AutogradFunctionality", "AutogradOther", "AutogradNestedTensor"):
        keys = keys.remove(getattr(torch._C.DispatchKey, name))
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), keys)


@torch.library.custom_op("halocp::attention", mutates_args=())
def _attention_op(query: Tensor, key: Tensor, value: Tensor, causal: bool, tokens_per_frame: int,
                  scale: float | None, group: str) -> Tensor:
    with torch.no_grad():
        out = cp_attention(query, key, value, causal=causal, tokens_per_frame=tokens_per_frame, scale=scale,
                           group=token_group(group))
    return out.contiguous()


@_attention_op.register_fake
def _(query, key, value, causal, tokens_per_frame, scale, group):
    return query.new_empty((*query.shape[:-1], value.shape[-1]))


@torch.library.custom_op("halocp::attention_backward", mutates_args=())
def _attention_backward_op(grad: Tensor, query: Tensor, key: Tensor, value: Tensor, causal: bool,
                           tokens_per_frame: int, scale: float | None, group: str) -> list[Tensor]:
    inputs = [t.detach().requires_grad_() for t in (query, key, value)]
    with _autograd_on(), torch.enable_grad():
        out = cp_attention(*inputs, causal=causal, tokens_per_frame=tokens_per_frame, scale=scale,
                           group=token_group(group))
    grads = torch.autograd.grad(out, inputs, grad, allow_unused=True)
    return [t.new_zeros(t.shape) if g is None else g.contiguous() for g, t in zip(grads, inputs)]


@_attention_backward_op.register_fake
def _(grad, query, key, value, causal, tokens_per_frame, scale, group):
    return [t.new_empty(t.shape) for t in (query, key, value)]


def _save_inputs(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:3])
    ctx.args = inputs[3:]


def _attention_grad(ctx, grad):
    return (*torch.ops.halocp.attention_backward(grad, *ctx.saved_tensors, *ctx.args),) + (None,) * 4


_attention_op.register_autograd(_attention_grad, setup_context=_save_inputs)
