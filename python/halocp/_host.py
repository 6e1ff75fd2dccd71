"""The host path: CPU tensors, exchanged by libhalo in place.

A host plan is told the strides of every tensor it reads or writes, so the
library copies the shard, writes the halos and adds the halo gradients
straight into torch's tensors: each form's forward and backward is one
allocation and one C call (the blocking forms; a started one is three:
start, wait, free).
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import _inflight, _lib
from ._route import HalosRoute, Route
from ._lib import halo_dtype
from ._inflight import FORWARD, BACKWARD
from ._shapes import dim_order, empty_in_order, in_strides, padded_shape, resized, strides_in_order


def _params(dtype, shape, dim, left, right, x_strides, out_strides, grad_strides, padding_mode):
    """halo_plan_params_t of a full plan (forward and backward)."""
    go, gx = grad_strides
    return _lib.plan_params(halo_dtype(dtype), shape, dim, left, right, x_strides, padding_mode,
                            out_strides=out_strides, grad_out_strides=go, grad_x_strides=gx)


class Copy(Route):
    """Out of place: out and grad_out are dense in x's dim order, and so is
    grad_x."""

    __slots__ = ("plan", "out_shape", "out_strides", "x_shape", "x_strides", "dtype")

    def __init__(self, comm, x, left, right, dim, padding_mode):
        order = dim_order(x)
        shape, strides = tuple(x.shape), tuple(x.stride())
        self.comm, self.dtype = comm, x.dtype
        self.out_shape = padded_shape(shape, dim, left + right)
        self.out_strides = strides_in_order(self.out_shape, order)
        self.x_shape, self.x_strides = shape, strides_in_order(shape, order)
        self.plan = comm.plan(("copy", x.dtype, dim, left, right, shape, strides, padding_mode),
                              lambda: _params(x.dtype, shape, dim, left, right, strides, self.out_strides,
                                              (self.out_strides, self.x_strides), padding_mode))

    def run(self, x: Tensor) -> Tensor:
        out = torch.empty_strided(self.out_shape, self.out_strides, dtype=self.dtype)
        self.plan.exchange(FORWARD, x.data_ptr(), out.data_ptr())
        return out

    def start(self, x: Tensor):
        out = torch.empty_strided(self.out_shape, self.out_strides, dtype=self.dtype)
        return _inflight.begin(self.plan, FORWARD, x, out), lambda: out

    def backward(self, grad_out: Tensor) -> Tensor:
        grad_out = in_strides(grad_out, self.out_strides)  # the usual gradient already is
        grad_x = torch.empty_strided(self.x_shape, self.x_strides, dtype=self.dtype)
        if self.comm.dropped:
            _inflight.settle(self.comm)
        self.plan.exchange(BACKWARD, grad_out.data_ptr(), grad_x.data_ptr())
        return grad_x


class _Address:
    """A raw address standing in for a tensor argument of a plan call (the
    interior of a padded buffer, which that buffer keeps alive)."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = ptr

    def data_ptr(self) -> int:
        return self.ptr


class InPlace(Route):
    """In place: x is padded's interior, with padded's strides (the library
    sees the alias and leaves the shard where it is); the gradient has
    padded's memory format and none in the halo slots, which the forward
    overwrote."""

    __slots__ = ("plan", "left", "right", "dim", "offset", "grad_offset", "grad_strides")

    def __init__(self, comm, padded, left, right, dim, padding_mode):
        pshape, pstrides = tuple(padded.shape), tuple(padded.stride())
        self.comm, self.left, self.right, self.dim = comm, left, right, dim
        self.offset = left * pstrides[dim] * padded.element_size()
        self.grad_strides = grad = strides_in_order(pshape, dim_order(padded))
        # The interiors' addresses: padded's in the forward, its gradient's.
        self.grad_offset = left * grad[dim] * padded.element_size()
        shape = resized(pshape, dim, max(pshape[dim] - left - right, 0))
        self.plan = comm.plan(("inplace", padded.dtype, dim, left, right, pshape, pstrides, padding_mode),
                              lambda: _params(padded.dtype, shape, dim, left, right, pstrides, pstrides, (grad, grad),
                                              padding_mode))

    def run(self, padded: Tensor) -> Tensor:
        self.plan.exchange(FORWARD, padded.data_ptr() + self.offset, padded.data_ptr())
        return padded

    def start(self, padded: Tensor):
        pending = _inflight.begin(self.plan, FORWARD, _Address(padded.data_ptr() + self.offset), padded)
        return pending, lambda: padded

    def backward(self, grad_out: Tensor) -> Tensor:
        left, right, dim = self.left, self.right, self.dim
        grad_out = in_strides(grad_out, self.grad_strides)
        grad = torch.empty_strided(grad_out.shape, self.grad_strides, dtype=grad_out.dtype)
        n = grad.shape[dim] - left - right
        if self.comm.dropped:
            _inflight.settle(self.comm)
        self.plan.exchange(BACKWARD, grad_out.data_ptr(), grad.data_ptr() + self.grad_offset)
        grad.narrow(dim, 0, left).zero_()
        grad.narrow(dim, left + n, right).zero_()
        return grad


class Halos(HalosRoute):
    """Halos only: the halos are dense tensors of their own in x's dim
    order; grad_strides are the strides of (grad_left, grad_right, grad_x)
    in the backward, by default those of dense tensors of the halos' and
    x's shapes in that order (a layer passes its own, to hand over views
    of its buffers with no copy)."""

    __slots__ = ("plan", "shapes", "order", "dtype", "grad_strides")

    def __init__(self, comm, x, left, right, dim, padding_mode, grad_strides=None):
        shape, strides, order = tuple(x.shape), tuple(x.stride()), dim_order(x)
        self.comm, self.order, self.dtype = comm, order, x.dtype
        self.shapes = (resized(shape, dim, left), resized(shape, dim, right), shape)
        halo_strides = tuple(strides_in_order(s, order) for s in self.shapes[:2])
        if grad_strides is None:
            grad_strides = halo_strides + (strides_in_order(shape, order),)
        self.grad_strides = grad_strides = tuple(map(tuple, grad_strides))

        def params():
            gl, gr, gx = grad_strides
            return _lib.plan_params(halo_dtype(x.dtype), shape, dim, left, right, strides, padding_mode,
                                    halos_only=True, left_strides=halo_strides[0], right_strides=halo_strides[1],
                                    grad_left_strides=gl, grad_right_strides=gr, grad_x_strides=gx)

        self.plan = comm.plan(("halos", x.dtype, dim, left, right, shape, strides, grad_strides, padding_mode), params)

    def _halos(self):
        return tuple(empty_in_order(s, self.order, self.dtype) for s in self.shapes[:2])

    def run(self, x: Tensor):
        lh, rh = self._halos()
        _inflight.run(self.plan, FORWARD, x, lh, rh)
        return lh, rh

    def start(self, x: Tensor):
        lh, rh = self._halos()
        return _inflight.begin(self.plan, FORWARD, x, lh, rh), lambda: (lh, rh)

    def _grads(self, grad_left, grad_right, grad_x):
        # grad_x is added into in place: it has the plan's strides already.
        # An empty halo's gradient is never read: any tensor will do.
        gl, gr, _ = self.grad_strides
        return (grad_left if grad_left.numel() == 0 else in_strides(grad_left, gl),
                grad_right if grad_right.numel() == 0 else in_strides(grad_right, gr), grad_x)

    def start_add(self, grad_left, grad_right, grad_x):
        return _inflight.begin(self.plan, BACKWARD, *self._grads(grad_left, grad_right, grad_x)), _nothing

    def add(self, grad_left, grad_right, grad_x) -> None:
        _inflight.run(self.plan, BACKWARD, *self._grads(grad_left, grad_right, grad_x))

    def zeros_like_x(self):
        return empty_in_order(self.shapes[2], self.order, self.dtype).zero_()


def _nothing():
    return None
