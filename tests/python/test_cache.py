"""A communicator's one cache of prepared state (Communicator.prepared):
plans, routes and the CUDA paths' buffers share one pool of CACHE_SIZE
entries and one policy, least recently used first out. In one process, with
no communicator made: the policy is local.

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
    # A hit returns the same entry and makes it the most recently used.
    assert comm.prepared(keys[0], maker("again")) is values[keys[0]]
    assert len(made) == n
    # One more entry, of any kind, evicts the least recently used of all
    # kinds: keys[1] (a route), not the refreshed keys[0] (a plan).
    comm.prepared(("plan", "new"), maker(("plan", "new")))
    assert len(comm.cache) == n
    assert keys[1] not in comm.cache and keys[0] in comm.cache
    # The evicted one is made again on its next lookup.
    comm.prepared(keys[1], maker(keys[1]))
    assert made[-1] == keys[1] and keys[2] not in comm.cache
    assert set(comm.cached("route")) <= {k[1:] for k in comm.cache if k[0] == "route"}


def test_a_closed_communicator_makes_nothing():
    comm = _bare_comm()
    comm.closed = True
    with pytest.raises(_comm.HaloError, match="destroyed"):
        comm.prepared(("plan", 1), lambda: pytest.fail("made on a closed communicator"))
