"""One rank of tests/python/test_bootstrap.py: rank 2 of 3 is alive but
never makes the group's first halo exchange; ranks 0 and 1 must get a
HaloError naming rank 2 within halo's bootstrap timeout, not wait in a
torch collective until torch's own timeout.

Prints "RESULT ok <seconds> <message>" or "RESULT FAIL <why>".
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import halocp


def main():
    # torch's own default: 30 minutes, which the others used to wait out.
    dist.init_process_group("gloo", timeout=timedelta(minutes=30))
    rank = dist.get_rank()
    if rank == 2:
        time.sleep(float(os.environ["ABSENT_FOR"]))
        print("RESULT absent", flush=True)
        os._exit(0)
    t0 = time.monotonic()
    try:
        halocp.cp_halo_exchange(torch.randn(2, 4), 1, 1, 1)
    except halocp.HaloError as e:
        print(f"RESULT ok {time.monotonic() - t0:.1f} code={e.code} {e}".replace("\n", " "), flush=True)
        os._exit(0)
    except Exception as e:  # noqa: BLE001
        print(f"RESULT FAIL {type(e).__name__}: {e}".replace("\n", " "), flush=True)
        os._exit(1)
    print("RESULT FAIL the exchange succeeded without rank 2", flush=True)
    os._exit(1)


if __name__ == "__main__":
    main()
