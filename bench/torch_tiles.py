#!/usr/bin/env python3
"""The H x W tile recipe against one exchange of the same bytes.

    python3 bench/torch_tiles.py                  # 4 ranks, a 2 x 2 grid, (1, 32, 64, 64) tiles, halo 1
    python3 bench/torch_tiles.py --halo 2 --channels 64
    python3 bench/torch_tiles.py --world 2        # the two steps alone, each between the same 2 ranks

halocp.tile_halo_exchange pads a tile with one exchange per grid dim, each on
the previous one's output (so the corners ride along). A fused N-D plan
would send the same bytes in one exchange; its cost is bounded below by one
1-D exchange of as many bytes per rank. Every rank runs, in the same
processes, float32, forward only:

  recipe      tile_halo_exchange over the 2 x 2 grid: H then W
  H only      the first step alone (cp_halo_exchange along H, grid column)
  W only      the second step alone, on the H-padded tile (grid row)
  one 1-D     one cp_halo_exchange over all ranks in a line, along H of a
              (1, C, 64, W) shard with a halo of k rows, k chosen so that the
              bytes a middle rank sends are closest to the recipe's

With --world 2 the recipe runs on a 2 x 1 grid (its W step stays on one
rank), and the steps run each on 2 ranks, the same two processes: H only
on the 2 x 1 grid's column, W only on a 1 x 2 grid's row. Where the ranks
outnumber the CPUs (4 on 2), polling ranks wait on each other's time
slices and the 4-rank medians say more about scheduling than about the
steps; the 2-rank run compares the steps themselves.

Blocks of --iters calls alternate the variants for --rounds rounds after a
warm-up; the time is the median call of the slowest rank (its p99 beside
it). The ratio is recipe / one 1-D. Without RANK in the environment the
script launches --world ranks of itself (gloo on 127.0.0.1).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import ranks  # bench/ranks.py, beside this script


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=4, help="ranks, on a grid of 2 x world/2")
    ap.add_argument("--channels", type=int, default=32)
    ap.add_argument("--size", type=int, default=64, help="tile height and width")
    ap.add_argument("--halo", type=int, default=1, help="halo on every side")
    ap.add_argument("--channels-last", action="store_true", help="tiles in torch.channels_last")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    if "RANK" not in os.environ:
        return ranks.launch(__file__, args.world, deadline=600)

    import torch
    import torch.distributed as dist

    import halocp

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    grid = halocp.TileGrid((2, world // 2))
    C, S, h = args.channels, args.size, args.halo
    x = torch.randn(1, C, S, S)
    if args.channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    # The recipe's bytes per middle rank: H halos of S columns, then W halos
    # of S + 2h rows. One 1-D exchange of k rows of S columns on each side.
    recipe_bytes = 4 * C * (2 * h * S + 2 * h * (S + 2 * h))
    k = max(1, round(recipe_bytes / (4 * C * 2 * S)))
    one_bytes = 4 * C * 2 * k * S
    # The W step's group: the grid's row, or with 2 ranks a 1 x 2 grid's.
    w_group = TileGridRow(world, grid)
    x_h = halocp.cp_halo_exchange(x, h, h, 2, grid.groups[0])
    variants = {
        "recipe": lambda: halocp.tile_halo_exchange(x, h, (2, 3), grid),
        "H only": lambda: halocp.cp_halo_exchange(x, h, h, 2, grid.groups[0]),
        "W only": lambda: halocp.cp_halo_exchange(x_h, h, h, 3, w_group),
        "one 1-D": lambda: halocp.cp_halo_exchange(x, k, k, 2),
    }
    times = {name: [] for name in variants}
    for name, fn in variants.items():  # warm-up: plans made, communicators connected
        for _ in range(10):
            fn()
    for _ in range(args.rounds):
        for name, fn in variants.items():
            dist.barrier()
            for _ in range(args.iters):
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
    stats = {}
    for name, ts in times.items():
        ts.sort()
        mine = torch.tensor([statistics.median(ts), ts[int(0.99 * (len(ts) - 1))]], dtype=torch.float64)
        dist.all_reduce(mine, op=dist.ReduceOp.MAX)
        stats[name] = mine.tolist()
    if dist.get_rank() == 0:
        # On 2 ranks the recipe's W step stays on one rank: it sends the H halos only.
        nbytes = {"recipe": recipe_bytes if world > 2 else 4 * C * 2 * h * S, "H only": 4 * C * 2 * h * S,
                  "W only": 4 * C * 2 * h * (S + 2 * h), "one 1-D": one_bytes}
        layout = "channels_last" if args.channels_last else "contiguous"
        print(f"# {world} ranks, grid 2 x {world // 2}, tile (1, {C}, {S}, {S}) float32 {layout}, halo {h}; one 1-D: k = {k}; "
              f"{args.rounds} rounds x {args.iters} calls, median and p99 of the slowest rank")
        print(f"# {'variant':<10} {'bytes/rank':>11} {'median us':>10} {'p99 us':>9} {'vs one 1-D':>11}")
        base = stats["one 1-D"][0]
        for name, (med, p99) in stats.items():
            print(f"  {name:<10} {nbytes[name]:>11} {med * 1e6:>10.1f} {p99 * 1e6:>9.1f} {med / base:>10.2f}x")
        print(f"# H only + W only: {(stats['H only'][0] + stats['W only'][0]) * 1e6:.1f} us; "
              f"W only / H only {stats['W only'][0] / stats['H only'][0]:.2f}x"
              f"{' (each step between the same 2 ranks)' if world == 2 else ''}")
    dist.barrier()
    dist.destroy_process_group()
    return 0


def TileGridRow(world, grid):
    """The group of the W step: the grid's row, or on 2 ranks (a 2 x 1 grid,
    whose rows have one rank) the row of a 1 x 2 grid, so that the W step
    is an exchange between the same two ranks as the H step."""
    import halocp

    if world != 2:
        return grid.groups[1]
    return halocp.TileGrid((1, 2)).groups[1]


if __name__ == "__main__":
    sys.exit(main())
