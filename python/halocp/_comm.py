"""Communicators (one per process group) and their plan caches."""

from __future__ import annotations

import atexit
import os
import threading
import time
import weakref
from collections import OrderedDict

import torch
import torch.distributed as dist

from . import _lib
from ._lib import HaloError

# Entries of prepared state a communicator keeps (Communicator.prepared)
# before it lets the least recently used go: a layout takes one to three
# (its route, its plan, the CUDA paths' buffers), so 64 layouts fit.
# Eviction is local and never needed in step with the other ranks: plans are
# deferred, agreed on in their exchanges (a rank may miss while another hits).
CACHE_SIZE = 192

_BOOTSTRAP_TIMEOUT_VAR = "HALO_BOOTSTRAP_TIMEOUT_MS"


def bootstrap_timeout() -> float:
    """Seconds a rank waits for the others while a communicator is made:
    HALO_BOOTSTRAP_TIMEOUT_MS as libhalo reads it (halo_setting_get), so a
    value the library refuses is refused here too, naming it."""
    return _lib.setting(_BOOTSTRAP_TIMEOUT_VAR)[1] / 1000


def _rank_list(ranks) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _group_name(group) -> str:
    """A name of the group that every member agrees on."""
    c10d = dist.distributed_c10d
    for get in (lambda: c10d._get_process_group_name(group), lambda: group.group_name, lambda: c10d._pg_names[group]):
        try:
            name = get()
        except Exception:  # noqa: BLE001 - another torch version
            continue
        if name:
            return str(name)
    return "ranks-" + "-".join(map(str, dist.get_process_group_ranks(group)))


# Communicators made per group name, so that a new one after
# destroy_communicator uses fresh keys in the store.
_generations: dict = {}


class _StoreGather:
    """An all-gather of small values through the default process group's
    store, with a deadline: a rank that never comes is named in a HaloError
    when the deadline passes, instead of leaving the others in a collective
    until torch's own timeout (30 minutes by default)."""

    def __init__(self, group, rank: int, world: int, timeout: float):
        name = _group_name(group)
        gen = _generations.get(name, 0)
        _generations[name] = gen + 1
        self.prefix = f"halocp/{name}/{gen}"
        self.store = dist.distributed_c10d._get_default_store()
        self.rank, self.world, self.timeout = rank, world, timeout

    def gather(self, step: str, value: bytes) -> list:
        keys = [f"{self.prefix}/{step}/{r}" for r in range(self.world)]
        # Arrival marks are counters: add(mark, 0) reads one without blocking
        # (and makes a missing one 0). A store.wait that times out is avoided
        # on purpose: torch's TCPStore client can then answer later calls
        # with the stale reply, and every rank would look absent.
        marks = [f"{self.prefix}/{step}/here/{r}" for r in range(self.world)]
        start = time.monotonic()
        missing = None  # as of the last look that succeeded
        try:
            self.store.set(keys[self.rank], value)
            self.store.add(marks[self.rank], 1)
            missing, pause = [r for r in range(self.world) if r != self.rank], 0.0005
            while True:
                missing = [r for r in missing if self.store.add(marks[r], 0) == 0]
                if not missing or time.monotonic() - start >= self.timeout:
                    break
                time.sleep(pause)
                pause = min(2 * pause, 0.05)
            if not missing:
                return [self.store.get(k) for k in keys]
            why = ""
        except Exception as e:  # noqa: BLE001 - the store's own failures
            if not missing:
                raise HaloError(_lib.ERR_RENDEZVOUS, f"halocp: rank {self.rank}: the process group's store failed: {e}") from e
            # A rank that gave up first may have taken the store down with it.
            why = f" (then the process group's store failed: {e})"
        raise HaloError(
            _lib.ERR_RENDEZVOUS,
            f"halocp: rank {self.rank}: {_rank_list(missing)} of {self.world} did not take part in making the "
            f"group's communicator within {time.monotonic() - start:.0f}s ({_BOOTSTRAP_TIMEOUT_VAR}): every rank "
            f"of the group must make its first halo exchange on it, in the same order{why}",
        )


class Communicator:
    """libhalo's communicator for one torch process group.

    Made collectively on first use: every rank opens its transport, the
    addresses travel through the default process group's store (within
    halo's bootstrap timeout, HALO_BOOTSTRAP_TIMEOUT_MS), and every rank
    connects. Use :func:`halocp.communicator` to get one.
    """

    # Per-communicator state, released by close():
    # cache: the prepared state (Communicator.prepared): plans, each form's
    # route per layout and device path (halocp.exchange.route), the CUDA
    # paths' buffers (halocp._cuda), keyed by (kind, ...);
    # cuda_path: "direct" or "staged" once asked (halocp._cuda);
    # dropped: exchanges whose handles were dropped unwaited (halocp._inflight).
    cache: OrderedDict
    cuda_path: str | None
    dropped: list

    def __init__(self, group, timeout: float | None = None):
        if _forked_from is not None:
            # Refused before the gathers: they would run on the parent's
            # process group, whose sockets this child shares.
            raise HaloError(
                _lib.ERR_INVALID_STATE,
                f"halocp: this process (pid {os.getpid()}) was forked from process {_forked_from}, which had "
                "loaded libhalo; Go's runtime does not survive a fork, so halocp cannot exchange here. Use it "
                "in a process started by exec (multiprocessing's or torch.multiprocessing's spawn)",
            )
        self.cache, self.cuda_path, self.dropped = OrderedDict(), None, []
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        if self.rank < 0:
            raise HaloError(_lib.ERR_INVALID_ARGUMENT, "halocp: this process is not a member of the group")
        self.timeout = timeout
        self.lock = threading.RLock()
        self.closed = False
        self.handle = None
        # The process that made it; a forked child inherits the object, not
        # the communicator (see _forked).
        self.pid = os.getpid()
        _made.add(self)

        # Every rank takes part in both gathers even when its own step failed,
        # so a failure on one rank is an error on all of them, not a hang.
        address, failure = None, None
        try:
            deadline = bootstrap_timeout()
        except HaloError as e:
            # Said on every rank through the gathers, which need some bound:
            # any will do, this rank fails once the others have heard.
            deadline, failure = 60.0, e
        self._store = _StoreGather(group, self.rank, self.world_size, deadline)
        if failure is None:
            try:
                if timeout is not None and not timeout > 0:
                    raise HaloError(_lib.ERR_INVALID_ARGUMENT, f"halocp: timeout must be positive seconds, not {timeout!r}")
                timeout_ms = None if timeout is None else max(1, round(timeout * 1000))
                self.handle = _lib.comm_create(self.rank, self.world_size, timeout_ms)
                address = _lib.comm_address(self.handle)
            except HaloError as e:
                failure = e
        addresses = self._gather("address", address if failure is None else failure)
        try:
            _lib.comm_connect(self.handle, addresses)
        except HaloError as e:
            failure = e
        self._gather("connected", failure if failure is not None else b"")

    def _gather(self, step: str, mine):
        """Every rank's value for step; raises on every rank if any rank sent
        an error, or did not come in time."""
        if isinstance(mine, HaloError):
            value = b"E" + f"{mine.code}\n{mine}".encode()
        else:
            value = b"A" + mine
        try:
            everyone = self._store.gather(step, value)
        except HaloError:
            self.close()
            raise
        if isinstance(mine, HaloError):
            self.close()
            raise mine
        for r, v in enumerate(everyone):
            if v[:1] == b"E":
                code, _, msg = v[1:].decode(errors="replace").partition("\n")
                self.close()
                raise HaloError(int(code), f"halocp: rank {r} could not set up its communicator: {msg}")
        return [v[1:] for v in everyone]

    def prepared(self, key: tuple, make):
        """The communicator's one cache of prepared state: the entry for key
        (a tuple whose first item names the kind: "plan", "route",
        "buffers"), or make()'s result, kept, on a miss. One policy for
        every kind, least recently used out as CLOCK approximates it: a hit
        only marks its entry used (``cache[key]`` is ``[value, used]``); a
        miss past CACHE_SIZE entries sweeps from the oldest, moving a used
        one to the back unmarked (its second chance) and dropping the first
        unused one. A hit costs no second hash of the key (an OrderedDict's
        move_to_end would: a key holds shapes and strides, 0.3 us a call
        on the route lookup). exchange.route's lookup, once per call, reads
        ``cache`` itself and marks a hit (``entry[1] = True``): this policy.

        An evicted entry lives on while something holds it (a route its
        plan, an autograd graph its route); evicting a plan frees its
        memory once nothing does, and its layout is agreed on afresh in
        its next exchange (plans are deferred)."""
        with self.lock:
            cache = self.cache
            entry = cache.get(key)
            if entry is not None:
                entry[1] = True
                return entry[0]
            if self.closed:
                raise HaloError(_lib.ERR_INVALID_HANDLE, "halocp: the communicator was destroyed")
            value = make()
            cache[key] = [value, False]
            while len(cache) > CACHE_SIZE:
                oldest, entry = next(iter(cache.items()))
                if entry[1]:
                    entry[1] = False
                    cache.move_to_end(oldest)
                else:
                    del cache[oldest]
            return value

    def cached(self, kind: str) -> dict:
        """The cache's entries of one kind, by the rest of their keys (least
        recently used first): for tests and benchmarks."""
        with self.lock:
            return {k[1:]: v for k, (v, _) in self.cache.items() if k[0] == kind}

    def plan(self, key: tuple, make_params) -> _lib.Plan:
        """The cached plan for key, or a new one made from make_params()
        (called on a miss only).

        key holds everything the plan depends on, on this rank. The plan is
        made locally (deferred) and agreed on in its exchanges: ranks may
        find or miss their plans independently (a rank whose shard shape
        repeats while another's is new), the exchange itself brings them to
        one agreed layout.
        """
        return self.prepared(("plan",) + key, lambda: _lib.Plan(self, make_params()))

    def clear_plans(self) -> None:
        """Forget every cached plan, and the prepared state made with them
        (local: frees their memory; never needed for correctness)."""
        with self.lock:
            self.cache.clear()

    def _inherited(self) -> None:
        """Forget, in a forked child, the communicator the parent made: no
        library call (its destroy would tell the peers that the parent's rank
        is gone), and no lock the fork may have copied while held."""
        self.lock = threading.RLock()
        self.closed, self.handle = True, None
        self.cache.clear()  # the plans' finalisers see closed and call nothing
        self.dropped, self.cuda_path = [], None

    def close(self) -> None:
        """Destroy the communicator and its plans (local; never hangs). In a
        forked child of the process that made it, only forgets it."""
        if self.pid != os.getpid():
            self._inherited()
            return
        with self.lock:
            if self.closed:
                return
            self.closed = True
            self.cache.clear()
            self.dropped, self.cuda_path = [], None
            if self.handle is not None:
                _lib.comm_destroy(self.handle)
                self.handle = None

    def __repr__(self):
        state = "closed" if self.closed else f"{sum(k[0] == 'plan' for k in self.cache)} plans"
        return f"<halocp.Communicator rank {self.rank} of {self.world_size}, {state}>"


_comms: dict = {}
_comms_lock = threading.Lock()
_made: weakref.WeakSet = weakref.WeakSet()  # every Communicator of this process
_forked_from: int | None = None  # the parent that had loaded libhalo, in a forked child


def _forked() -> None:
    """In a forked child: a communicator belongs to the process that made it
    (its transport's endpoints and shared memory are the parent's), so the
    child forgets every one it inherited, and its atexit, finalisers and
    destroy_communicator never speak for the parent. Where the parent had
    loaded libhalo, the child cannot make a new one (libhalo refuses every
    call there but destroy); a parent that had not leaves the child free."""
    global _comms_lock, _forked_from
    _comms_lock = threading.Lock()  # the fork may have copied it held
    if _lib._lib is not None and _forked_from is None:
        _forked_from = os.getppid()
    for c in list(_made):
        c._inherited()
    _comms.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked)


def resolve_group(group):
    if group is None:
        if not dist.is_available() or not dist.is_initialized():
            raise HaloError(
                _lib.ERR_INVALID_STATE,
                "halocp: torch.distributed is not initialised: call init_process_group first, or pass a group",
            )
        group = dist.group.WORLD
    return group


# Process groups by token, for the custom ops (which take strings, not
# groups): the group's name, "" for the default group.
_groups_by_token: dict = {}


def group_token(group) -> str:
    """The token naming group in a custom op's arguments."""
    if group is None:
        return ""
    token = _group_name(group)
    # While torch.compile traces, a group held by a module is a placeholder
    # (FakeScriptObject) that names the group but cannot run a collective:
    # only a real group is kept for the ops to find at run time.
    if not _is_placeholder(group):
        _groups_by_token[token] = group
    return token


def _is_placeholder(group) -> bool:
    # type(), not isinstance: a FakeScriptObject passes for the class it stands for.
    return type(group).__name__ == "FakeScriptObject"


def token_group(token: str):
    """The group a token names (None: the default group)."""
    if not token:
        return None
    group = _groups_by_token.get(token)
    if group is None:
        try:  # a group first seen by the tracer: torch's registry of names
            group = dist.distributed_c10d._resolve_process_group(token)
        except Exception:  # noqa: BLE001 - no such name, or another torch version
            raise HaloError(_lib.ERR_INVALID_ARGUMENT, f"halocp: no process group has token {token!r}") from None
        _groups_by_token[token] = group
    return group


def communicator(group=None, *, timeout: float | None = None) -> Communicator:
    """The communicator of a torch process group, made on first use.

    The first call for a group is collective (every rank of the group calls
    it); later calls return the same object. ``timeout`` (seconds) bounds
    every wait of the exchanges on it; unset, it comes from HALO_TIMEOUT_MS,
    else the library's default (the README's configuration table). It applies when the communicator is
    made: to change it, destroy the communicator first.
    """
    group = resolve_group(group)
    comm = _comms.get(group)
    if comm is None or comm.closed:
        with _comms_lock:
            comm = _comms.get(group)
            if comm is None or comm.closed:
                comm = Communicator(group, timeout)
                _comms[group] = comm
    elif timeout is not None and timeout != comm.timeout:
        raise HaloError(
            _lib.ERR_INVALID_STATE,
            f"halocp: the group's communicator exists with timeout {comm.timeout}; destroy_communicator first",
        )
    return comm


def clear_plans(group=None) -> None:
    """Forget the group's cached plans and free their memory (local; any
    rank, any time no exchange of the group is in flight).

    Never needed for correctness: a plan is keyed on this rank's own layout,
    and every exchange checks that all ranks run the same agreed layout (with
    every rank's shard length), agreeing again within the exchange when they
    do not. Sequence lengths may change from step to step.
    """
    comm = _comms.get(resolve_group(group))
    if comm is not None:
        comm.clear_plans()


def destroy_communicator(group=None) -> None:
    """Destroy a group's communicator and its plans (local; never hangs).

    The next exchange on the group makes a new one, collectively. Use it
    after a timeout or a failed peer, which leave a communicator unusable.
    """
    group = resolve_group(group)
    with _comms_lock:
        comm = _comms.pop(group, None)
    if comm is not None:
        comm.close()


@atexit.register
def _close_all() -> None:
    with _comms_lock:
        comms = list(_comms.values())
        _comms.clear()
    for c in comms:
        try:
            c.close()
        except Exception:
            pass
