"""GroupNorm over a tensor sharded across a group: the statistics of the
whole tensor without gathering it.

Forward: each rank reduces its shard to (count, mean, M2) per (sample,
group) -- M2 the sum of squared deviations from the shard's own mean -- and one all_gather of that small buffer gives every rank
every rank's triple, which each combines in rank order with Chan's pairwise
formula. Not sum and sum of squares: E[x^2] - E[x]^2 loses the variance to
cancellation when the mean is large beside the spread (in float32, all of it
once |mean|/std passes about 3000), where Chan's update keeps float32's
precision. An all_gather rather than an all_reduce because Chan's update is
not a sum; the buffer is world x 3 x N x G float64 numbers either way, and
every rank then runs the same arithmetic on the same numbers in the same
order: the same bits on every rank and from run to run.

Agreement. The same message first carries what the ranks must agree on
(num_groups, batch, channels, eps, affine, the frame's shape, whether the
input needs a gradient): every rank sees every rank's, so ranks that differ
all raise one HaloError naming them, rather than computing a GroupNorm of
no tensor, aborting inside gloo on a message of another size, or hanging in
the backward's all_reduce. For that the message has one length on every
rank whatever the ranks disagree on: a header and room for ``capacity``
statistics, a number every rank holds alike (it starts at one sample of 32
groups and grows, from the gathered headers, to the most any call of the
group has needed). Statistics beyond it go in a second message, sent only
once the headers agree, and only on a call that needs more than any before.

Backward: the input gradient needs two more sums over the whole group of
elements, of dxhat and of dxhat * xhat (xhat the normalised input, dxhat its
gradient); both go in one all_reduce of a 2 x N x G buffer. Weight and bias
gradients are per rank, as for halocp.nn's convolutions: sum them over the
group (DDP and FSDP do).

float16 and bfloat16 inputs are normalised in float32, as torch does; the
output and gradients come back in the input's dtype.
"""

from __future__ import annotations

import functools
import math
import struct
import weakref

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from . import _lib
from ._comm import token_group
from ._shapes import is_compiling, known
from ._lib import HaloError
from ._sharding import disagreement, world_and_rank
from .exchange import _token

__all__ = ["GroupNorm"]


def _compute_dtype(dtype):
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _per_channel(t, channels):
    """(N, G) -> (N, C): each group's value for each of its channels."""
    return t.repeat_interleave(channels // t.shape[1], 1)


def _broadcast(t, ndim):
    """(N, C) -> (N, C, 1, ...) against an ndim-d activation."""
    return t.view(t.shape + (1,) * (ndim - 2))


# The header's fields, in its order ("frame": the sizes of the dims after C
# but the sharded one, up to three, the third holding the product of any
# more; -1 where there is none).
_FIELDS = ("batch", "num_groups", "channels", "num_channels", "eps", "affine", "input grad", "dims", "sharded dim")
_FRAME = 3
_HEADER = len(_FIELDS) + _FRAME
_EPS, _CHANNELS, _NUM_CHANNELS, _DIMS, _DIM = (_FIELDS.index(f) for f in
                                                ("eps", "channels", "num_channels", "dims", "sharded dim"))

# Statistics the first message has room for, by process group; alike on
# every rank (see the module's notes). One sample of GroupNorm(32, C) to begin.
_FIRST_CAPACITY = 3 * 32
_capacity = weakref.WeakKeyDictionary()  # (a destroyed group's goes with it)


def _header(x, groups, num_channels=None, affine=False, grad=False, dim=2):
    """What the ranks must agree on, as the ints the header carries (eps
    apart: the message takes its bits, see _gather); also for an input the
    layer refuses (then "dims" or "channels" says why, see _refused)."""
    shape = tuple(x.shape) if isinstance(x, torch.Tensor) else ()
    batch, channels = (shape + (0, 0))[:2]
    frame = [shape[d] for d in range(2, len(shape)) if d != dim]
    if len(frame) > _FRAME:
        frame[_FRAME - 1:] = [math.prod(frame[_FRAME - 1:])]
    frame += [-1] * (_FRAME - len(frame))
    num_channels = channels if num_channels is None else num_channels
    return [batch, groups, channels, num_channels, 0, int(affine), int(grad), len(shape), dim] + frame


def _refused(header):
    """Whether a header is that of an input the layer refuses."""
    return header[_DIMS] <= header[_DIM] or header[_CHANNELS] != header[_NUM_CHANNELS]


@functools.lru_cache(maxsize=256)
def _header_tensor(header, eps, device):
    """The header as the message's first slots (float64 slots holding int64
    bits), eps by its bits. Cached: a layer sends the same one every step."""
    head = list(header)
    head[_EPS] = struct.unpack("<q", struct.pack("<d", eps))[0]
    return torch.tensor(head, dtype=torch.int64, device=device).view(torch.float64)


def _said(header):
    """A header as the mismatch message spells it."""
    values = [str(v) for v in header[:len(_FIELDS)]]
    eps = struct.unpack("<d", struct.pack("<q", header[_EPS]))[0]
    values[_EPS] = repr(eps) if eps == eps else f"nan {header[_EPS]:#x}"  # repr is exact: bits that differ show
    for i in (_FIELDS.index("affine"), _FIELDS.index("input grad")):
        values[i] = str(bool(header[i]))
    frame = [v for v in header[len(_FIELDS):] if v >= 0]
    return values + ["x".join(map(str, frame)) or "none"]


def _gather(mine, header, eps, group):
    """Every rank's (3, N, G) statistics, (world, 3, N, G) in rank order, from
    one all_gather that also carries every rank's header; HaloError
    (ERR_MISMATCH) on every rank alike where the headers differ."""
    world = dist.get_world_size(group)
    key = dist.group.WORLD if group is None else group
    capacity = _capacity.get(key, _FIRST_CAPACITY)
    need = mine.numel()
    # One cat builds the message (fewer calls than filling a buffer: this is
    # per step); the zeros only make the bytes on the wire deterministic.
    parts = [_header_tensor(tuple(header), float(eps), mine.device), mine.reshape(-1)]
    if need < capacity:
        parts.append(_zeros(capacity - need, mine.device))
    buf = torch.cat(parts)
    out = mine.new_empty(world, _HEADER + capacity)
    dist.all_gather(list(out.unbind(0)), buf[:_HEADER + capacity], group=group)
    headers = out[:, :_HEADER].view(torch.int64).tolist()  # one small copy to the host
    alike = headers.count(headers[0]) == world  # (the usual case, tested first: this is per step)
    # Every rank computes the next capacity from the same headers.
    _capacity[key] = max(capacity, need) if alike else max([capacity] + [3 * h[0] * h[1] for h in headers])
    refused = [r for r, h in enumerate(headers) if _refused(h)] if not alike or _refused(headers[0]) else None
    if refused:
        why = (_CHANNELS, _NUM_CHANNELS, _DIMS, _DIM)
        said = "; ".join(f"rank {r}: " + ("not a tensor" if headers[r][_DIMS] == 0 else
                                          ", ".join(f"{_FIELDS[i]} {headers[r][i]}" for i in why))
                         for r in refused)
        raise HaloError(_lib.ERR_INVALID_ARGUMENT, "halocp.nn: GroupNorm wants (N, C, ...) input with C = num_channels "
                                                   f"and the sharded dim, not on every rank ({said})")
    if not alike:
        table = [_said(h) for h in headers]
        names = _FIELDS + ("frame",)
        differ = {i: names[i] for i in range(len(names)) if any(row[i] != table[0][i] for row in table)}
        raise HaloError(_lib.ERR_MISMATCH, "halocp.nn: GroupNorm: the ranks of the group disagree on the layer or "
                                           f"its input ({disagreement(table, differ)})")
    if need > capacity:  # agreed: the same length everywhere
        rest = mine.new_empty(world, need - capacity)
        dist.all_gather(list(rest.unbind(0)), buf[_HEADER + capacity:], group=group)
        return torch.cat([out[:, _HEADER:], rest], 1).view((world,) + tuple(mine.shape))
    _, n_batch, groups = mine.shape
    return out.as_strided((world, 3, n_batch, groups), (_HEADER + capacity, n_batch * groups, groups, 1), _HEADER)


@functools.lru_cache(maxsize=64)
def _zeros(n, device):
    return torch.zeros(n, dtype=torch.float64, device=device)


def _statistics(mine, header, eps, group):
    """_gather's, or under torch.compile its op's: the headers are read on the
    host, which a traced graph cannot do (the op below)."""
    if is_compiling():
        return torch.ops.halocp.norm_statistics(mine, header, eps, _token(group))
    return _gather(mine, header, eps, group)


def _global_statistics(x, groups, group, header=None, eps=0.0):
    """(mean, M2, count) of each (sample, group) over every rank's shard;
    header (_header's) is what the ranks must agree on."""
    n_batch = x.shape[0]
    acc = _compute_dtype(x.dtype)
    xg = x.reshape(n_batch, groups, -1)  # a view unless x is not contiguous (a local copy then)
    count = xg.shape[2]
    # (Under torch.compile, a length that is data to the graph, a strided
    # layer's output, takes this branch, whose mean is made 0 for no elements.)
    if known(count != 0, True):
        # Two passes, the second over deviations from the shard's mean (torch's
        # var_mean is as exact but, on CPU, ten times slower here).
        xg = xg.to(acc)
        mean = xg.mean(2, keepdim=True)
        if not known(count != 0, False):
            mean = torch.where(torch.full_like(mean, count) > 0, mean, 0)
        m2 = (xg - mean).square_().sum(2)
        mean = mean.squeeze(2).double()  # in float64 from here: and the count exact past 2^24
        mine = torch.stack([torch.full_like(mean, count), mean, m2.double()])
    else:  # an empty shard: no samples, nothing to add
        # (zeros that are x's sums over no elements: in a traced graph the
        # statistics' exchange then waits for x, in the same order as on
        # the ranks with frames, which AOTAutograd's partitioner keeps)
        mine = xg.sum(2, dtype=torch.float64).expand(3, n_batch, groups).clone()
    world, _ = world_and_rank(group)
    if world == 1:
        return mine[1], mine[2], mine[0]
    every = _statistics(mine, _header(x, groups) if header is None else header, eps, group)
    n, mean, m2 = every[0]
    for other in every[1:]:  # Chan et al.'s pairwise update, in rank order
        n_b, mean_b, m2_b = other
        total = n + n_b
        frac = torch.where(total > 0, n_b / total.clamp(min=1), 0)
        delta = mean_b - mean
        mean = mean + delta * frac
        m2 = m2 + m2_b + delta * delta * n * frac
        n = total
    return mean, m2, n


class _GroupNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, groups, eps, group, header):
        acc = _compute_dtype(x.dtype)
        mean, m2, count = _global_statistics(x, groups, group, header, eps)
        rstd = (m2 / count + eps).rsqrt().to(acc)
        mean = mean.to(acc)
        channels = x.shape[1]
        scale = _per_channel(rstd, channels)
        if weight is not None:
            scale = scale * weight.to(acc)
        shift = -_per_channel(mean, channels) * scale
        if bias is not None:
            shift = shift + bias.to(acc)
        # y = x * scale + shift, in the compute dtype, in x's memory format.
        y = torch.addcmul(_broadcast(shift, x.dim()), x.to(acc), _broadcast(scale, x.dim())).to(x.dtype)
        ctx.save_for_backward(x, weight, mean, rstd)
        ctx.count, ctx.group = count.to(acc), group
        return y

    @staticmethod
    def backward(ctx, grad):
        x, weight, mean, rstd = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        acc = rstd.dtype
        n_batch, channels = x.shape[:2]
        groups = rstd.shape[1]
        xf, gf = x.reshape(n_batch, channels, -1).to(acc), grad.reshape(n_batch, channels, -1).to(acc)
        db = gf.sum(2)  # per (sample, channel): sum dy and sum dy * x, local
        ds = torch.einsum("ncm,ncm->nc", gf, xf)  # dot products: no temporary, 2x faster than (gf * xf).sum(2)
        mean_c, rstd_c = _per_channel(mean, channels), _per_channel(rstd, channels)
        dxhat_xhat_c = (ds - mean_c * db) * rstd_c  # sum dy * xhat
        grad_x = grad_w = grad_b = None
        if need_w:
            grad_w = dxhat_xhat_c.sum(0).to(weight.dtype)
        if need_b:
            grad_b = db.sum(0).to(weight.dtype if weight is not None else x.dtype)
        if need_x:
            w = weight.to(acc) if weight is not None else torch.ones(channels, dtype=acc, device=x.device)
            # The two sums over every rank's elements of each (sample, group), in one buffer.
            sums = torch.stack([(db * w).view(n_batch, groups, -1).sum(2),
                                (dxhat_xhat_c * w).view(n_batch, groups, -1).sum(2)])
            if world_and_rank(ctx.group)[0] > 1:
                dist.all_reduce(sums, group=ctx.group)
            sum_dxhat, sum_dxhat_xhat = sums / ctx.count
            # dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)) = a * dy + b * x + c
            a = rstd_c * w
            b = _per_channel(-rstd * rstd * sum_dxhat_xhat, channels)
            c = _per_channel(rstd * (mean * rstd * sum_dxhat_xhat - sum_dxhat), channels)
            nd = x.dim()
            grad_x = (_broadcast(a, nd) * grad.to(acc)).addcmul_(x.to(acc), _broadcast(b, nd))
            grad_x = grad_x.add_(_broadcast(c, nd)).to(x.dtype)
        return grad_x, grad_w, grad_b, None, None, None, None


class GroupNorm(torch.nn.GroupNorm):
    """``torch.nn.GroupNorm`` over an ``(N, C, *)`` activation sharded along
    ``dim`` (a dim after C: T of a video, say) across ``group``, shards of
    any length (0 included).

    Every rank's output is its part of torch's GroupNorm over the whole
    tensor, and so is its input gradient; statistics come from one
    collective of a few numbers per (sample, group) in the forward and one
    in the backward, never from the tensor itself (see the module's notes).
    ``group=None``: the default process group, or one process with the
    whole tensor when torch.distributed is not initialised; a group of one
    rank is torch's GroupNorm. Weight and bias gradients are per rank: sum
    them over the group. Collective: every rank calls it, forward and
    backward, in the same order as its other collectives.
    """

    def __init__(self, num_groups, num_channels, eps=1e-5, affine=True, device=None, dtype=None, *, group=None,
                 dim=2):
        super().__init__(num_groups, num_channels, eps, affine, device, dtype)
        if dim < 2:
            # GroupNorm reduces over every dim but N and C: which of them is
            # sharded does not change the arithmetic, only N and C would.
            raise ValueError(f"halocp.nn.GroupNorm: the sharded dim comes after N and C (2 or more), not {dim}")
        self.group, self.dim = group, dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        world, rank = world_and_rank(self.group)
        tensor = isinstance(x, torch.Tensor)
        # Whether x needs a gradient is agreed too: a rank that does runs the
        # backward's all_reduce, which a rank that does not would never join.
        header = _header(x, self.num_groups, self.num_channels, self.affine,
                         tensor and x.requires_grad and torch.is_grad_enabled(), self.dim)
        if _refused(header):
            if world == 1:
                what = f"shape {tuple(x.shape)}" if tensor else type(x).__name__
                raise HaloError(_lib.ERR_INVALID_ARGUMENT,
                                f"halocp.nn: GroupNorm on rank {rank} wants (N, C, ...) input with C = "
                                f"{self.num_channels} and a dim {self.dim} (the sharded one), not {what}")
            # The other ranks may be in the statistics' all_gather already:
            # join it with this header, so that every rank raises alike (it
            # raises, here too; returned, under compile, so that the op stays
            # in the graph).
            device = x.device if tensor else (self.weight.device if self.weight is not None else "cpu")
            return _statistics(torch.zeros(3, header[0], self.num_groups, dtype=torch.float64, device=device),
                               header, self.eps, self.group)
        if world == 1:
            return F.group_norm(x, self.num_groups, self.weight, self.bias, self.eps)
        return _GroupNorm.apply(x, self.weight, self.bias, self.num_groups, self.eps, self.group, header)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", sharded dim={self.dim}"


# ------------------------------------------------------ torch.library ops
# For torch.compile (exchange.py says why ops): the statistics' all_gather
# with the ranks' headers, which are read and checked on the host (_gather):
# an op, as the graph cannot raise on what the ranks sent. Its gradient is never needed: the layer's backward
# is the autograd Function's, which takes none through the statistics.


@torch.library.custom_op("halocp::norm_statistics", mutates_args=())
def _norm_statistics_op(mine: Tensor, header: list[int], eps: float, group: str) -> Tensor:
    return _gather(mine, header, eps, token_group(group)).contiguous()


@_norm_statistics_op.register_fake
def _(mine, header, eps, group):
    return mine.new_empty((dist.get_world_size(token_group(group)),) + tuple(mine.shape))
