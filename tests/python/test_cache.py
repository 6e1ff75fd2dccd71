"""A communicator's one cache of prepared state (Communicator.prepared):
plans, routes and the CUDA paths' buffers share one pool of CACHE_SIZE
entries and one policy, least recently used out as CLOCK approximates it (a
hit marks its entry, an eviction gives a marked one a second chance). In one
process, with no communicator made: the policy is local.

    python -m pytest -p no:cacheprovider tests/python/test_cache.py
"""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))

from halocp import _comm  # noqa: E402


def _bare_comm():
    """A Communicator with the state prepared() reads, made without ranks."""
    comm = object.__new__(_comm.Communicator)
    comm.lock, comm.closed, comm.cache = threading.RLock(), False, OrderedDict()
    return comm


def test_one_pool_least_recently_used_out():
    comm, made = _bare_comm(), []

    def maker(key):
        return lambda: made.append(key) or object()

    n = _comm.CACHE_SIZE
    kinds = ("plan", "route", "buffers")
    keys = [(kinds[i % 3], i) for i in range(n)]
    values = {k: comm.prepared(k, maker(k)) for k in keys}
    assert len(made) == n and len(comm.cache) == n
    # A hit returns the same entry, made once, and marks it used.
    assert comm.prepared(keys[0], maker("again")) is values[keys[0]]
    assert len(made) == n
    # One more entry, of any kind, evicts the oldest entry of all kinds not
    # used since it was made or last passed over: keys[1] (a route), not
    # the used keys[0] (a plan), which goes to the back unmarked.
    comm.prepared(("plan", "new"), maker(("plan", "new")))
    assert len(comm.cache) == n
    assert keys[1] not in comm.cache and keys[0] in comm.cache
    assert list(comm.cache)[-2:] == [("plan", "new"), keys[0]] and comm.cache[keys[0]][1] is False
    # The evicted one is made again on its next lookup, evicting the next
    # oldest unused (keys[2]).
    comm.prepared(keys[1], maker(keys[1]))
    assert made[-1] == keys[1] and keys[2] not in comm.cache
    # keys[0]'s second chance is spent once it goes unused through a sweep:
    # with every other entry marked, the sweep comes back round to it.
    for k in list(comm.cache):
        if k != keys[0]:
            comm.cache[k][1] = True
    comm.prepared(("route", "newer"), maker(("route", "newer")))
    assert keys[0] not in comm.cache and len(comm.cache) == n
    assert comm.cached("route")[("newer",)] is not None


def test_a_closed_communicator_makes_nothing():
    comm = _bare_comm()
    comm.closed = True
    with pytest.raises(_comm.HaloError, match="destroyed"):
        comm.prepared(("plan", 1), lambda: pytest.fail("made on a closed communicator"))
