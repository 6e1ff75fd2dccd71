#!/usr/bin/env python3
"""halocp against a plain torch.distributed P2P halo exchange, same processes.

    python3 bench/torch_bench.py [--world 2] [--sizes 2KiB,2MiB] [--seconds 0.3] [--json out.json]

Both implementations compute the same thing (the reference semantics: a
differentiable cp_halo_exchange with zero padding at the ends of the sequence)
on the same (N, C, T, H, W) float32 activations, sharded along T; one
iteration is a forward and a backward pass. The baseline is our own
torch.distributed P2P implementation over gloo (isend/irecv of contiguous
copies of the boundary slabs, zero halos, torch.cat), written for this
comparison. Each size: warm-up, then rounds that alternate a block of
baseline iterations with a block of halocp iterations, each block about
--seconds long; per-iteration times, median and p99 over the iterations, the
slowest rank's figure. Every rank checks that both give bit-identical
outputs and input gradients (#wrong).

Without RANK in the environment the script launches --world ranks of itself
on this machine (gloo on 127.0.0.1) and prints rank 0's table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import ranks  # bench/ranks.py, beside this script


# Halo of one side = C * H * W * 4 bytes (one float32 time slice).
SHAPES = {2 << 10: (8, 8, 8), 2 << 20: (128, 64, 64)}


def parse_size(s: str) -> int:
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "B": 1}
    for u, m in units.items():
        if s.endswith(u):
            return int(float(s[: -len(u)]) * m)
    return int(s)


def human(n: int) -> str:
    return f"{n >> 20}MiB" if n >= 1 << 20 and n % (1 << 20) == 0 else f"{n >> 10}KiB" if n % 1024 == 0 else f"{n}B"


def shape_for(size: int) -> tuple[int, int, int]:
    """(C, H, W) with C*H*W*4 == size bytes."""
    if size in SHAPES:
        return SHAPES[size]
    elems = size // 4
    c = 1
    while c * 2 <= 64 and elems % (c * 2) == 0 and elems // (c * 2) >= 64:
        c *= 2
    return c, 1, elems // c


# --------------------------------------------------------------------- ranks


def run_rank(args) -> int:
    import torch
    import torch.distributed as dist

    import halocp

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD

    class P2PHaloExchange(torch.autograd.Function):
        """The baseline: the reference semantics over torch.distributed
        isend/irecv (one hop; shards at least as long as the halos)."""

        @staticmethod
        def forward(ctx, x, left, right, dim):
            ctx.left, ctx.right, ctx.dim = left, right, dim
            n = x.shape[dim]

            def halo(k):
                shape = list(x.shape)
                shape[dim] = k
                return x.new_zeros(shape)

            before, after = halo(left), halo(right)
            pending = []
            if rank > 0:
                pending += [dist.irecv(before, rank - 1, tag=1), dist.isend(x.narrow(dim, 0, right).contiguous(), rank - 1, tag=2)]
            if rank < world - 1:
                pending += [dist.irecv(after, rank + 1, tag=2), dist.isend(x.narrow(dim, n - left, left).contiguous(), rank + 1, tag=1)]
            for p in pending:
                p.wait()
            return torch.cat([before, x, after], dim)

        @staticmethod
        def backward(ctx, g):
            left, right, dim = ctx.left, ctx.right, ctx.dim
            n = g.shape[dim] - left - right
            from_next = g.new_zeros(g.narrow(dim, 0, left).shape)
            from_prev = g.new_zeros(g.narrow(dim, 0, right).shape)
            pending = []
            if rank > 0:
                pending += [dist.isend(g.narrow(dim, 0, left).contiguous(), rank - 1, tag=3), dist.irecv(from_prev, rank - 1, tag=4)]
            if rank < world - 1:
                pending += [dist.isend(g.narrow(dim, left + n, right).contiguous(), rank + 1, tag=4), dist.irecv(from_next, rank + 1, tag=3)]
            for p in pending:
                p.wait()
            grad = g.narrow(dim, left, n).clone()
            grad.narrow(dim, n - left, left).add_(from_next)  # the reference's order: from the right first
            grad.narrow(dim, 0, right).add_(from_prev)
            return grad, None, None, None

    class LocalWork(torch.autograd.Function):
        """The floor: an exchange's local tensor work with no communication
        (a padded output with the shard copied in and zero halos; a gradient
        of x copied from the interior with two halo-sized slabs added), in
        an autograd Function as halocp's own."""

        @staticmethod
        def forward(ctx, x, left, right, dim):
            n = x.shape[dim]
            shape = list(x.shape)
            shape[dim] += left + right
            out = x.new_empty(shape)
            out.narrow(dim, left, n).copy_(x)
            out.narrow(dim, 0, left).zero_()
            out.narrow(dim, left + n, right).zero_()
            ctx.left, ctx.right, ctx.dim = left, right, dim
            return out

        @staticmethod
        def backward(ctx, g):
            left, right, dim = ctx.left, ctx.right, ctx.dim
            n = g.shape[dim] - left - right
            grad = g.narrow(dim, left, n).clone()
            grad.narrow(dim, n - left, left).add_(g.narrow(dim, 0, left))
            grad.narrow(dim, 0, right).add_(g.narrow(dim, left + n, right))
            return grad, None, None, None

    def baseline(x):
        return P2PHaloExchange.apply(x, args.left, args.right, 2)

    def floor(x):
        return LocalWork.apply(x, args.left, args.right, 2)

    def ours(x):
        return halocp.cp_halo_exchange(x, args.left, args.right, 2, group)

    def step(fn, x, g):
        x.grad = None
        y = fn(x)
        y.backward(g)
        return y

    rows = []
    for size in args.sizes:
        c, h, w = shape_for(size)
        gen = torch.Generator().manual_seed(rank)
        x = torch.randn(1, c, args.frames, h, w, generator=gen).requires_grad_()
        g = torch.randn(1, c, args.frames + args.left + args.right, h, w, generator=gen)

        y0, y1 = step(baseline, x, g).detach(), None
        grad0 = x.grad.clone()
        y1 = step(ours, x, g).detach()
        wrong = int((y0.view(torch.int32) != y1.view(torch.int32)).sum() + (grad0.view(torch.int32) != x.grad.view(torch.int32)).sum())

        # Warm-up; its slower implementation's median sizes the blocks, the
        # same on every rank.
        warm = []
        for fn in (baseline, floor, ours):
            for _ in range(10):
                t0 = time.perf_counter()
                step(fn, x, g)
                warm.append(time.perf_counter() - t0)
        per = torch.tensor([statistics.median(warm)], dtype=torch.float64)
        dist.all_reduce(per, op=dist.ReduceOp.MAX)
        iters = args.iters if args.iters else max(10, min(2000, int(args.seconds / per.item())))
        times = {"baseline": [], "floor": [], "halocp": []}
        dist.barrier()
        for _ in range(args.rounds):
            for name, fn in (("baseline", baseline), ("floor", floor), ("halocp", ours)):
                dist.barrier()
                for _ in range(iters):
                    t0 = time.perf_counter()
                    step(fn, x, g)
                    times[name].append(time.perf_counter() - t0)

        def stats(ts):
            ts = sorted(ts)
            return statistics.median(ts), ts[min(len(ts) - 1, int(0.99 * len(ts)))]

        mine = {k: stats(v) for k, v in times.items()}
        everyone = [None] * world
        dist.all_gather_object(everyone, (mine, wrong))
        worst = {k: tuple(max(e[0][k][i] for e in everyone) for i in range(2)) for k in times}
        rows.append(dict(
            halo_bytes=size, count=size // 4, dtype="float32", shape=[1, c, args.frames, h, w],
            left=args.left, right=args.right, iters=iters * args.rounds,
            baseline_median_us=worst["baseline"][0] * 1e6, baseline_p99_us=worst["baseline"][1] * 1e6,
            halocp_median_us=worst["halocp"][0] * 1e6, halocp_p99_us=worst["halocp"][1] * 1e6,
            floor_median_us=worst["floor"][0] * 1e6,
            speedup=worst["baseline"][0] / worst["halocp"][0],
            over_floor=worst["halocp"][0] / worst["floor"][0],
            wrong=sum(e[1] for e in everyone),
        ))
    if rank == 0:
        print_table(rows, args, world)
        if args.json:
            Path(args.json).write_text(json.dumps(dict(world=world, library=halocp.library_path(),
                                                       halo_version=halocp.version(), rows=rows), indent=2) + "\n")
    dist.destroy_process_group()
    return 1 if any(r["wrong"] for r in rows) else 0


def print_table(rows, args, world):
    print(f"# halocp vs torch.distributed P2P (gloo), {world} ranks, forward + backward per iteration")
    print(f"# (N, C, T, H, W) float32 sharded along T, {args.frames} frames per rank, halo left {args.left} right {args.right};"
          " size = one side's halo")
    print("# times: median and p99 over the iterations, slowest rank; algbw = halo bytes moved per rank / median"
          " time, GB = 1e9")
    print("# floor: the same local tensor work with no communication (LocalWork); /floor = halocp / floor")
    head = (f"{'size':>8} {'count':>8} {'dtype':>7} {'iters':>6} {'p2p us':>9} {'p2p p99':>9} {'floor us':>9} "
            f"{'halo us':>9} {'halo p99':>9} {'algbw':>7} {'speedup':>8} {'/floor':>7} {'#wrong':>6}")
    print("#" + head[1:])
    print(f"#{'(B)':>7} {'(elems)':>8} {'':>7} {'':>6} {'':>9} {'':>9} {'':>9} {'':>9} {'':>9} {'(GB/s)':>7} {'(x)':>8} "
          f"{'(x)':>7} {'':>6}")
    for r in rows:
        moved = r["halo_bytes"] * (args.left + args.right) * 2  # forward and backward, each side one slice
        algbw = moved / (r["halocp_median_us"] * 1e-6) / 1e9
        print(f"{r['halo_bytes']:>8} {r['count']:>8} {r['dtype']:>7} {r['iters']:>6} {r['baseline_median_us']:>9.1f} "
              f"{r['baseline_p99_us']:>9.1f} {r['floor_median_us']:>9.1f} {r['halocp_median_us']:>9.1f} "
              f"{r['halocp_p99_us']:>9.1f} {algbw:>7.2f} {r['speedup']:>8.1f} {r['over_floor']:>7.2f} {r['wrong']:>6}")
    wrong = sum(r["wrong"] for r in rows)
    print(f"# Wrong values : {wrong} {'OK' if wrong == 0 else 'FAILED'} (halocp against the baseline: outputs and input gradients, bit for bit)")
    for r in rows:
        print(f"# {human(r['halo_bytes'])} halo: halocp {r['halocp_median_us']:.1f} us, the torch.distributed baseline "
              f"{r['baseline_median_us']:.1f} us per forward + backward: {r['speedup']:.1f}x; "
              f"{r['over_floor']:.2f}x the no-communication floor ({r['floor_median_us']:.1f} us)")


# ------------------------------------------------------------------ launcher


def launch(args) -> int:
    return ranks.launch(__file__, args.world, args.deadline)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2, help="ranks to launch (default 2)")
    ap.add_argument("--sizes", default="2KiB,2MiB", type=lambda s: [parse_size(v) for v in s.split(",")],
                    help="halo sizes, one side, comma-separated (default 2KiB,2MiB)")
    ap.add_argument("--left", type=int, default=1, help="left halo slices (default 1)")
    ap.add_argument("--right", type=int, default=1, help="right halo slices (default 1)")
    ap.add_argument("--frames", type=int, default=4, help="frames per rank (default 4)")
    ap.add_argument("--iters", type=int, default=0, help="iterations per block (default: as many as fit in --seconds)")
    ap.add_argument("--seconds", type=float, default=0.3, help="about how long each block runs (default 0.3)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating blocks per implementation (default 3)")
    ap.add_argument("--json", help="also write the results here as JSON")
    ap.add_argument("--deadline", type=float, default=300, help="seconds before the launcher stops the ranks (default 300)")
    args = ap.parse_args()
    if args.frames < max(args.left, args.right):
        ap.error("the baseline needs --frames >= the halo sizes")
    if args.seconds <= 0 or args.rounds < 1 or args.world < 2:
        ap.error("--seconds must be positive, --rounds at least 1 and --world at least 2")
    if "RANK" in os.environ:
        return run_rank(args)
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())
