"""The Route interface: one form of exchange of one layout on one device
path, which every device path implements (_host.py, _cuda.py) and
halocp's autograd Functions and public forms call (exchange.py), whatever
the device. A leaf: it imports nothing of the package.
"""

from __future__ import annotations


class Route:
    """One form of exchange (out of place, in place, halos only) of one
    layout, on one device path (host, staged, direct), prepared once: what
    halocp's autograd Functions and public forms call, whatever the device.

    ``start(t)`` starts the forward exchange of t (x, or the padded buffer)
    and returns ``(pending, finish)``: pending is the Pending to wait for
    (None when nothing is in flight), ``finish()`` returns the result once
    it has finished. ``run(t)`` is both at once. ``backward(*grads)``
    returns the gradient of t for the gradients of the result.
    """

    __slots__ = ("comm",)

    def start(self, t):
        raise NotImplementedError

    def run(self, t):
        pending, finish = self.start(t)
        if pending is not None:
            pending.finish(block=True)
        return finish()

    def backward(self, *grads):
        raise NotImplementedError


class HalosRoute(Route):
    """A halos-only Route, which also starts its backward on its own:
    ``start_add(grad_left, grad_right, grad_x)`` sends the halo gradients
    back and adds the neighbours' into grad_x (x's shape and device, holding
    the rest of x's gradient), returning ``(pending, finish)`` as ``start``
    does, so that a layer computes while the gradients travel."""

    __slots__ = ()

    def start_add(self, grad_left, grad_right, grad_x):
        raise NotImplementedError

    def add(self, grad_left, grad_right, grad_x) -> None:
        """start_add, blocking."""
        pending, finish = self.start_add(grad_left, grad_right, grad_x)
        if pending is not None:
            pending.finish(block=True)
        finish()

    def backward(self, grad_left, grad_right):
        # Autograd asks for a gradient of all of x, so there is one of x's
        # size: zeros, into which the neighbours' part is added.
        grad_x = self.zeros_like_x()
        self.add(grad_left, grad_right, grad_x)
        return grad_x

    def zeros_like_x(self):
        raise NotImplementedError
