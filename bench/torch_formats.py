#!/usr/bin/env python3
"""cp_halo_exchange of a channels-last tile: kept in its format, against a
contiguous tile and against converting to contiguous and back.

    python3 bench/torch_formats.py          # (1, 32, 64, 64) float32, halo 1, one rank

One rank (the copy of the shard into the padded output is what differs by
layout; no peer, so no waiting on one), one torch thread, float32, forward:

  contiguous     a contiguous tile
  kept           a channels_last tile, output in channels_last (halocp's way)
  converted      the same tile made contiguous, exchanged, and the output
                 made channels_last again (what a caller would do without it)

Mean of --iters calls after a warm-up, per dim of H and W.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import ranks  # bench/ranks.py, beside this script


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=200)
    args = ap.parse_args()
    if "RANK" not in os.environ:
        return ranks.launch(__file__, 1, deadline=300)

    import torch
    import torch.distributed as dist

    import halocp

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    cl = torch.channels_last
    x = torch.randn(1, 32, 64, 64)
    x_cl = x.contiguous(memory_format=cl)

    def mean_us(fn):
        for _ in range(10):
            fn()
        t0 = time.perf_counter()
        for _ in range(args.iters):
            fn()
        return (time.perf_counter() - t0) / args.iters * 1e6

    print(f"# (1, 32, 64, 64) float32, halo 1 a side, 1 rank, mean of {args.iters} calls")
    print(f"# {'dim':<4} {'contiguous us':>14} {'kept us':>9} {'converted us':>13} {'kept vs converted':>18}")
    for dim, name in ((2, "H"), (3, "W")):
        base = mean_us(lambda: halocp.cp_halo_exchange(x, 1, 1, dim))
        kept = mean_us(lambda: halocp.cp_halo_exchange(x_cl, 1, 1, dim))
        conv = mean_us(lambda: halocp.cp_halo_exchange(x_cl.contiguous(), 1, 1, dim).contiguous(memory_format=cl))
        print(f"  {name:<4} {base:>14.0f} {kept:>9.0f} {conv:>13.0f} {kept / conv:>17.2f}x")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
