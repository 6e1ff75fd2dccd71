"""Settings a worker sets from Python after importing halocp (and after
libhalo is loaded) apply to the communicators it makes afterwards: the usual
shape of a torchrun or torch.multiprocessing script (issue 24, 2b).

    launched by tests/python/test_settings.py on 2 ranks
"""

from __future__ import annotations

import os
import time

import torch

import halocp
import ranks
from ranks import expect


def scenario_timeout_from_python():
    halocp._lib.lib()  # the library is loaded before the variable is set
    os.environ["HALO_TIMEOUT_MS"] = "3000"
    x = torch.arange(24.0).reshape(2, 3, 4)
    halocp.cp_halo_exchange(x, 1, 1, 2)  # makes the communicator and the plan, together
    if ranks.RANK == 0:
        t0 = time.monotonic()
        msg = ranks.raises(lambda: halocp.cp_halo_exchange(x, 1, 1, 2), halocp.ERR_TIMEOUT,
                           "an exchange rank 1 never joins", within=20)
        took = time.monotonic() - t0
        expect(2.5 < took < 15, f"the deadline was 3 s, the exchange failed after {took:.1f} s")
        expect("deadline 3s" in msg and "HALO_TIMEOUT_MS in the environment" in msg,
               f"the message does not say which deadline applied and where it came from: {msg}")
    torch.distributed.barrier()


if __name__ == "__main__":
    ranks.main(globals())
