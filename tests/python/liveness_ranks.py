"""Ranks of tests/python/test_liveness.py: peers that die and Ctrl-C, with
HALO_TIMEOUT_MS at 30 s so that only finding out (not the deadline) passes.

    liveness_ranks.py kill    rank 1 of 3 is SIGKILLed after a first exchange;
                              ranks 0 and 2 must get a HaloError PEER_FAILED
                              naming rank 1 within seconds
    liveness_ranks.py sigint  rank 1 of 2 stays alive but away; rank 0, blocked
                              in an exchange, gets SIGINT and must raise
                              KeyboardInterrupt within about a second; rank 1,
                              coming back, is told that rank 0 aborted

Each rank prints "RESULT ok <seconds> <message>" or "RESULT FAIL <why>".
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist

import halocp


def result(ok: bool, took: float, what: str) -> None:
    print(f"RESULT {'ok' if ok else 'FAIL'} {took:.2f} {what}".replace("\n", " "), flush=True)
    os._exit(0 if ok else 1)


def exchange():
    halocp.cp_halo_exchange(torch.randn(2, 64, 4), 1, 1, 1)


def expect_failure(code: int, needle: str) -> None:
    t0 = time.monotonic()
    try:
        exchange()
    except halocp.HaloError as e:
        took = time.monotonic() - t0
        result(e.code == code and needle in str(e), took, f"code={e.code} {e}")
    except BaseException as e:  # noqa: BLE001
        result(False, time.monotonic() - t0, f"{type(e).__name__}: {e}")
    result(False, time.monotonic() - t0, "the exchange succeeded")


def kill():
    rank = dist.get_rank()
    exchange()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    expect_failure(halocp.ERR_PEER_FAILED, "rank 1")


def sigint():
    rank = dist.get_rank()
    exchange()
    if rank == 1:
        time.sleep(4)  # away, but alive: no liveness link breaks
        expect_failure(halocp.ERR_PEER_FAILED, "rank 0 aborted its communicator")
    # Delivered to the process while the main thread is blocked in libhalo,
    # as Ctrl-C would be.
    fired = []
    threading.Timer(0.5, lambda: (fired.append(time.monotonic()), os.kill(os.getpid(), signal.SIGINT))).start()
    t0 = time.monotonic()
    try:
        exchange()
    except KeyboardInterrupt:
        took = time.monotonic() - fired[0]
        # The communicator was aborted: later calls fail at once.
        try:
            exchange()
        except halocp.HaloError as e:
            result(e.code == halocp.ERR_COMM_FAILED and took < 2.0, took, f"KeyboardInterrupt, then code={e.code} {e}")
        result(False, took, "an exchange after the interrupt succeeded")
    except BaseException as e:  # noqa: BLE001
        result(False, time.monotonic() - t0, f"{type(e).__name__}: {e}")
    result(False, time.monotonic() - t0, "the exchange succeeded without rank 1")


def main():
    dist.init_process_group("gloo")
    {"kill": kill, "sigint": sigint}[sys.argv[1]]()


if __name__ == "__main__":
    main()
