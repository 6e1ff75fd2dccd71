"""Exchanges in flight: the plan calls behind the asynchronous API, the
handles it returns, exchanges whose handle was dropped, abort.

libhalo lets one exchange per plan and direction be in flight; until the
wait (or test) that finishes it, the exchange owns its tensors: the library
may still read the input and write the outputs. So everything here keeps
those tensors, and the plan, alive until then, whatever the caller drops.

Words: ``begin`` puts one library exchange in flight (a Pending; the
C call is ``_lib.Plan.exchange_start``); a Route's ``start`` and the public
``*_start`` forms make the caller's handle (an Exchange) over one.
"""

from __future__ import annotations

from . import _lib
from ._comm import _comms, resolve_group
from ._lib import HaloError

# What a plan call does: its direction (a halos-only plan's forward fills
# the halos, its backward adds the halo gradients back).
FORWARD, BACKWARD = _lib.DIR_FORWARD, _lib.DIR_BACKWARD


def run(plan, direction: int, *tensors) -> None:
    """A blocking exchange on plan in direction, on the tensors' data
    pointers in the header's order (_lib.Plan)."""
    if plan.comm.dropped:
        settle(plan.comm)
    plan.exchange(direction, *[t.data_ptr() for t in tensors])


class Pending:
    """One exchange in flight: the plan, the direction, and every tensor the
    library may still touch. Holds no reference to its handle, so that
    dropping the handle is seen (Exchange.__del__).

    A stream-ordered one (started with a stream) is finished by making a
    stream wait for it: ``waiter()`` gives the stream, read at the wait
    (the one that will read the results; it also tells the caching
    allocator that the stream uses the tensors, so that their memory
    outlives the exchange); the host does not wait, unless ``host_wait``
    (torch's work on CPU tensors is not on that stream). Its request is
    freed at that wait: the library releases it when the exchange ends, and
    should the exchange fail, the next exchange on the communicator reports
    it, saying the results the stream read are not valid."""

    __slots__ = ("plan", "direction", "tensors", "request", "finished", "stream", "waiter", "host_wait")

    def __init__(self, plan, direction, tensors, request, stream=None, waiter=None, host_wait=False):
        self.plan, self.direction, self.tensors, self.request = plan, direction, tensors, request
        self.finished = False
        self.stream, self.waiter, self.host_wait = stream, waiter, host_wait

    def finish(self, block: bool) -> bool:
        """Wait (block) or test; True once finished. Raises HaloError on a
        failure, which also ends the exchange (its request is freed)."""
        if self.finished:
            return True
        try:
            done = True
            if not block:
                done = self.plan.test(self.request)
            elif self.stream is None:
                self.plan.wait(self.request)
            else:
                self.plan.wait(self.request, self.waiter())
                if self.host_wait:
                    self.plan.wait(self.request)
        except HaloError:
            self._release()
            raise
        if done:
            self._release()
        return done

    def wait_host(self) -> None:
        """Wait on the host until the exchange has ended, leaving its finish
        to the caller; a failure ends it (and is raised)."""
        try:
            self.plan.wait(self.request)
        except HaloError:
            self._release()
            raise

    def finish_quietly(self) -> None:
        """Wait and swallow a failure: for an exchange abandoned because
        something else failed (that error is the one to report)."""
        try:
            self.finish(block=True)
        except HaloError:
            pass

    def _release(self):
        # The caller is done with the exchange: its request goes (the
        # library releases one still in flight, a stream having been told
        # to wait for it, when it ends).
        self.finished = True
        self.plan.free(self.request)
        self.tensors = ()


def begin(plan, direction: int, *tensors, stream: int | None = None, waiter=None, host_wait=False) -> Pending:
    """Start an exchange on plan in direction (FORWARD, BACKWARD), on the
    host or ordered on a stream (a _lib.stream_handle, with the
    waiter and host_wait of Pending); the returned Pending keeps plan and
    tensors alive until it finishes."""
    comm = plan.comm
    if comm.dropped:
        settle(comm)
    request = plan.exchange_start(direction, [t.data_ptr() for t in tensors], stream)
    return Pending(plan, direction, tensors, request, stream, waiter, host_wait)


def settle(comm) -> None:
    """Finish the exchanges on comm whose handles were dropped unwaited.

    Called before every exchange halocp makes on the communicator, so a
    dropped handle never leaves its plan busy. Their results are discarded
    and so are their failures: a failed exchange leaves the communicator
    failed, and the call that settles reports that itself.
    """
    dropped = comm.dropped
    while dropped:
        dropped.pop(0).finish_quietly()


_RUNNING, _FINISHED, _WAITED, _FAILED = "in flight", "finished", "waited", "failed"


class Exchange:
    """A halo exchange in flight, returned by :func:`halocp.cp_halo_exchange_start`,
    :func:`halocp.halo_exchange_start_` and :func:`halocp.halos_start`.

    ``test()`` progresses it without blocking and says whether it has
    finished; ``wait()`` finishes it and returns the result (the result's
    tensors are written only once the exchange has finished successfully).
    The handle keeps the exchange's tensors alive. ``wait()`` returns the
    result once: a second call raises ``HaloError(ERR_INVALID_STATE)``; after
    a failure, ``test()`` and ``wait()`` raise it again.

    A handle dropped before its exchange finished does not leave the plan
    busy: the next halocp call on the same communicator finishes the
    exchange (waiting for it as ``wait()`` would) and discards its result.
    Until then nothing progresses it on this rank, so peers waiting for its
    data may wait too: wait for what you start.
    """

    __slots__ = ("_pending", "_result", "_state", "_error")

    def __init__(self, pending: Pending | None, result):
        # result: a callable returning the result, called once the exchange
        # has finished successfully (it attaches the autograd graph).
        self._pending, self._result = pending, result
        self._state = _RUNNING if pending is not None else _FINISHED
        self._error = None

    @property
    def done(self) -> bool:
        """True once the exchange has finished (successfully or not)."""
        return self._state != _RUNNING

    def test(self) -> bool:
        """Progress the exchange; True once it has finished (then ``wait()``
        returns at once). Never blocks."""
        self._progress(block=False)
        return self._state != _RUNNING

    def wait(self):
        """Finish the exchange (within the communicator's timeout) and
        return its result."""
        if self._state == _WAITED:
            raise HaloError(_lib.ERR_INVALID_STATE, "halocp: wait() was already called on this exchange")
        self._progress(block=True)
        result, self._result = self._result(), None
        self._state = _WAITED
        return result

    def _progress(self, block: bool) -> None:
        if self._state == _FAILED:
            code, msg = self._error
            raise HaloError(code, f"halocp: this exchange failed earlier: {msg}")
        if self._state != _RUNNING:
            return
        try:
            done = self._pending.finish(block)
        except HaloError as e:
            self._state, self._error, self._pending = _FAILED, (e.code, str(e)), None
            raise
        if done:
            self._state, self._pending = _FINISHED, None

    def __del__(self):
        # No library call here (a finaliser may run anywhere): hand the
        # exchange to its communicator, whose next call finishes it.
        pending = getattr(self, "_pending", None)
        if pending is not None and not pending.finished:
            try:
                pending.plan.comm.dropped.append(pending)
            except Exception:  # interpreter shutdown
                pass

    def __repr__(self):
        return f"<halocp.Exchange {self._state}>"


Exchange.__module__ = "halocp"


def abort(group=None) -> None:
    """Abort the group's communicator, from any thread.

    Every exchange in flight on it (blocked in a call, or started and not
    yet waited for) fails with ``HaloError(ERR_COMM_FAILED)`` within
    milliseconds, and so does every later exchange; peers see this rank as
    failed. Then call :func:`halocp.destroy_communicator` (on every rank):
    the next exchange makes a new communicator, collectively. Idempotent;
    does nothing if the group has no communicator (yet, or any more).
    """
    comm = _comms.get(resolve_group(group))
    if comm is None:
        return
    # Not under comm.lock: the thread blocked in the exchange holds it.
    handle = comm.handle
    if handle is None or comm.closed:
        return
    try:
        _lib.comm_abort(handle)
    except HaloError as e:
        if not (e.code == _lib.ERR_INVALID_HANDLE and comm.closed):  # destroyed meanwhile: nothing to abort
            raise
