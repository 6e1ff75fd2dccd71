"""Shapes and memory formats of the tensors an exchange reads and writes.

A leaf: it imports torch and nothing of halocp, so that every other module
may use it (tests/python/test_imports.py keeps it so).

Outputs and gradients keep their input's memory format (channels_last,
channels_last_3d, any dense permutation): they are allocated in the input's
dim order and the plan is told their strides, so the library writes them in
place, with no conversion copy.

While torch.compile traces (``is_compiling``), sizes may be symbolic, and
some are data to the graph (unbacked: a strided layer's output length);
``dim_order`` and ``known`` answer for those without adding a guard.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def dim_order(t: Tensor) -> tuple:
    """t's dims from outermost to innermost in memory when t is dense (its
    elements fill one block, as a contiguous tensor's do, up to a permutation
    of the dims: channels_last, a transposed copy); the contiguous order
    otherwise (a sliced or expanded view), as ``torch.empty_like`` does."""
    shape, strides, numel = t.shape, t.stride(), t.numel()
    if isinstance(numel, torch.SymInt):  # a fake tensor of torch.compile, with symbolic sizes
        shape, strides = _hinted(shape), _hinted(strides)
        numel = math.prod(shape)
    # torch strides the dims outside an empty one 0: they are outermost. A
    # dim of size 1 ties with its inner neighbour: it goes inside it, where
    # torch's formulas for a memory format put it. Other ties keep dim order.
    outer = float("inf") if numel == 0 else 0
    order = tuple(sorted(range(t.dim()), key=lambda d: (-(strides[d] or outer), shape[d] == 1)))
    expected = 1
    for d in reversed(order):
        if shape[d] != 1 and strides[d] != expected and not (outer and strides[d] == 0):
            return tuple(range(t.dim()))
        expected *= max(shape[d], 1)
    return order


def _hinted(values) -> list:
    """Symbolic sizes or strides as ints to compare (no guard is added): an
    unbacked size, data to the traced graph (a strided layer's output
    count), as a large one, as torch's size-oblivious reasoning takes it.
    The order found then holds for the sizes it may have at run time, 0 and
    1 included (torch strides such dims as it likes)."""
    from torch.fx.experimental.symbolic_shapes import optimization_hint

    return [optimization_hint(v, fallback=8192) for v in values]


# True while torch.compile traces (PyTorch >= 2.4; an older torch compiles
# nothing, and halocp keeps its autograd Functions there).
is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", lambda: False)


def known(cond, otherwise: bool) -> bool:
    """cond (a bool, or a symbolic one while torch.compile traces), or
    otherwise where it depends on what the traced graph does not know (an
    unbacked size). No guard is added for that."""
    if not is_compiling():  # (dynamo takes a SymBool for a bool: isinstance cannot tell)
        return cond
    from torch.fx.experimental.symbolic_shapes import guard_or_false, guard_or_true

    return guard_or_true(cond) if otherwise else guard_or_false(cond)


def strides_in_order(shape, order) -> tuple:
    """The strides of a dense tensor of shape whose dims lie in memory in order."""
    strides, acc = [0] * len(shape), 1
    for d in reversed(order):
        strides[d] = acc
        acc *= shape[d]
    return tuple(strides)


def contiguous_strides(shape) -> tuple:
    return strides_in_order(shape, range(len(shape)))


def empty_in_order(shape, order, dtype, device=None) -> Tensor:
    return torch.empty_strided(tuple(shape), strides_in_order(shape, order), dtype=dtype, device=device)


def in_strides(t: Tensor, strides) -> Tensor:
    """t itself if its memory is laid out by strides (size-1 dims aside),
    else a copy that is: the layout a plan was made for."""
    if t.stride() == strides or all(n == 1 or a == b for n, a, b in zip(t.shape, t.stride(), strides)):
        return t
    return torch.empty_strided(t.shape, strides, dtype=t.dtype, device=t.device).copy_(t)


def resized(shape, dim, k) -> tuple:
    """shape with k slices along dim (a halo's shape)."""
    s = list(shape)
    s[dim] = k
    return tuple(s)


def padded_shape(shape, dim, extra) -> tuple:
    """shape with extra more slices along dim (a padded tensor's shape)."""
    return resized(shape, dim, shape[dim] + extra)


def outermost(shape, dim, **kw) -> Tensor:
    """An empty tensor of shape whose dim is outermost in memory: a range of
    slices along dim is one contiguous run."""
    s = list(shape)
    n = s.pop(dim)
    return torch.empty([n] + s, **kw).movedim(0, dim)


class Like:
    """What a Route reads of a tensor (shape, strides, dtype, device),
    without the tensor: a backward that has x's shape and strides, not x
    (an in-place form may have overwritten it since, and it need not be
    kept), finds x's Route with it."""

    __slots__ = ("shape", "strides", "dtype", "device")

    def __init__(self, shape, strides, like: Tensor):
        self.shape, self.strides = torch.Size(shape), tuple(strides)
        self.dtype, self.device = like.dtype, like.device

    def stride(self, dim=None):
        return self.strides if dim is None else self.strides[dim]

    def dim(self):
        return len(self.shape)

    def numel(self):
        return math.prod(self.shape)  # (torch.Size.numel wants its sizes known)

    @property
    def is_cuda(self):
        return self.device.type == "cuda"

    @property
    def is_cpu(self):
        return self.device.type == "cpu"


def mark_sharded(x: torch.Tensor, dim: int = 2) -> torch.Tensor:
    """Tell ``torch.compile`` that ``x``'s ``dim`` is a sharded length, which
    may be any number from step to step, so that one graph serves them all.

    Call it on the compiled model's input, outside the model, every step
    (it marks the tensor, not the model). Without it dynamo compiles a shape
    it has seen once as static, then once more with a dynamic length, and
    again for each rank whose shard is 1 frame long (a size it specialises);
    with it, the length is unbacked from the first call. A rank's first empty
    shard still compiles once more: a 0-long dim changes the tensor's
    strides. Eager calls (and a call while tracing) are unchanged; returns x.
    """
    if is_compiling():
        return x
    try:
        from torch._dynamo.decorators import mark_unbacked
    except ImportError:  # a torch without dynamo: nothing compiles
        return x
    mark_unbacked(x, dim % x.dim())
    return x


def result_dtype(op, x: Tensor, kernel, dilation) -> torch.dtype:
    """The dtype torch's ``op`` (a convolution or pooling of ``kernel``
    and ``dilation`` per spatial dim) gives for an input like x: under
    autocast not x's (a convolution lowers float32 to bfloat16, CPU
    average pooling raises bfloat16 to float32). A rank that computes no
    output frames must still give its peers' dtype, or the next exchange's
    ranks disagree: so op runs on a batch of zero, which computes nothing."""
    if not (torch.amp.is_autocast_available(x.device.type) and torch.is_autocast_enabled(x.device.type)):
        return x.dtype
    extent = [d * (k - 1) + 1 for k, d in zip(kernel, dilation)]
    return op(x.new_empty((0, x.shape[1], *extent))).dtype
