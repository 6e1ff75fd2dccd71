#!/usr/bin/env python3
"""halocp's per-call cost on one rank: a 2 KiB cp_halo_exchange forward +
backward through the eager autograd Function, through the torch.compile
custom op called eagerly, and F.pad's forward + backward (the local work with
no communication), alternating blocks in one process.

    HALO_LIBRARY=build/lib/libhalo.so PYTHONPATH=python python3 bench/torch_step.py [--steps 4000] [--rounds 3] [--profile] [--pieces]

One rank (gloo, world 1): the wire is the library's loopback; what is
measured is Python, ctypes, autograd and allocations. --profile prints
cProfile's top entries of the Function's steps; --pieces adds two pieces of
the forward, in blocks of 5x the steps: the route lookup (exchange.route,
a cache hit) and Route.run (the output's allocation and the C call).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=4000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--port", default=os.environ.get("MASTER_PORT", "29731"))
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--pieces", action="store_true")
    args = ap.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = args.port
    dist.init_process_group("gloo", rank=0, world_size=1)
    import halocp

    x = torch.randn(1, 8, 4, 8, 8).requires_grad_()  # one (8, 8, 8) float32 slice: 2 KiB
    g = torch.randn(1, 8, 6, 8, 8)

    def function():
        x.grad = None
        halocp.cp_halo_exchange(x, 1, 1, 2).backward(g)

    def custom_op():
        x.grad = None
        torch.ops.halocp.exchange(x, 1, 1, 2, "", "zeros").backward(g)

    def floor():
        x.grad = None
        F.pad(x, (0, 0, 0, 0, 1, 1)).backward(g)

    ways = {"function": function, "custom op": custom_op, "F.pad floor": floor}
    steps = dict.fromkeys(ways, args.steps)
    if args.pieces:
        from halocp import exchange

        xd = x.detach()
        route = exchange.route("copy", xd, 1, 1, 2, None, "zeros")
        ways["route lookup"] = lambda: exchange.route("copy", xd, 1, 1, 2, None, "zeros")
        ways["Route.run"] = lambda: route.run(xd)
        steps["route lookup"] = steps["Route.run"] = 5 * args.steps
    times = {k: [] for k in ways}
    for _ in range(args.rounds):
        for name, fn in ways.items():
            for _ in range(200):
                fn()
            t0 = time.perf_counter()
            for _ in range(steps[name]):
                fn()
            times[name].append((time.perf_counter() - t0) / steps[name] * 1e6)
    print(f"# per step (forward + backward), us; {args.rounds} alternating blocks of {args.steps}; median of blocks")
    base = statistics.median(times["F.pad floor"])
    for name, ts in times.items():
        m = statistics.median(ts)
        print(f"{name:>12} {m:8.2f} us  {m / base:5.2f}x floor   blocks: {', '.join(f'{t:.1f}' for t in ts)}")
    if args.profile:
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(args.steps):
            function()
        pr.disable()
        pstats.Stats(pr).sort_stats("tottime").print_stats(15)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
