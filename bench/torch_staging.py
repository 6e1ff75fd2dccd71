#!/usr/bin/env python3
"""halocp's staging path (CUDA tensors' path with a UCX that does not move
CUDA memory) against its host path, on CPU tensors: what staging costs per
call, and the bytes of buffers each staged layout keeps.

    python3 bench/torch_staging.py                  # the shapes and modes below
    python3 bench/torch_staging.py --iters 20 --json staging.json

Two ranks, one torch thread each, float32 shards (1, 32, F, 32, 32) along
dim 2 (F = 4 and 32 frames), halo 1 a side, padding zeros and replicate:
forward + backward of halocp.halos (the exchange of the fused layers):

  host     CPU tensors on halocp's host path (the baseline)
  staged   the same call under halocp._cuda.stage_cpu(True): the staging
           path's code on CPU memory (its copies are memcpys here, not PCIe
           transfers, so this measures the bytes it moves, not a GPU's time)

Each time is rank 0's median of --rounds block means of --iters calls after
a warm-up, the variants alternating block by block; ratio staged / host from
the same run. "buffers" is the bytes the staged layout keeps (its x, grad x,
halo and halo-gradient buffers). The exit status is 1 if a staged result
differs from the host path's by a bit.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import ranks  # bench/ranks.py, beside this script


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=20, help="calls per block")
    ap.add_argument("--rounds", type=int, default=5, help="blocks per variant")
    ap.add_argument("--json", help="also write the figures to this file")
    args = ap.parse_args()
    if "RANK" not in os.environ:
        return ranks.launch(__file__, 2, deadline=600)

    import torch
    import torch.distributed as dist

    import halocp
    from halocp import _cuda

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    comm = halocp.communicator()

    def call(x, mode, staged):
        def run():
            with _cuda.stage_cpu(staged):
                lh, rh = halocp.halos(x, 1, 1, 2, padding_mode=mode)
                gx, = torch.autograd.grad([lh, rh], [x], [torch.ones_like(lh), torch.ones_like(rh)])
            return lh, rh, gx
        return run

    def timed(fns):
        return ranks.interleaved(fns, args.rounds, args.iters, warmup=3, before_block=dist.barrier)

    print(f"# halos forward + backward, 2 ranks, float32, dim 2, halo 1 a side, 1 torch thread; "
          f"rank 0's median of {args.rounds} blocks of {args.iters} calls")
    print(f"# {'shard':<20} {'padding':<10} {'host':>9} {'staged':>9} {'staged/host':>11} {'buffers':>11} {'shard':>11} {'#wrong':>6}")
    print(f"# {'':<20} {'':<10} {'us':>9} {'us':>9} {'':>11} {'bytes':>11} {'bytes':>11} {'':>6}")
    rows, wrong_total = [], 0
    for frames in (4, 32):
        for mode in ("zeros", "replicate"):
            torch.manual_seed(frames)
            x = torch.randn(1, 32, frames, 32, 32).requires_grad_()
            want, got = call(x, mode, False)(), call(x, mode, True)()
            wrong = sum(int((a.view(torch.int32) != b.view(torch.int32)).sum()) for a, b in zip(want, got))
            wrong_total += wrong
            t = timed({"host": call(x, mode, False), "staged": call(x, mode, True)})
            lay = next(v for k, v in comm.cached("buffers").items() if tuple(x.shape) in k and k[-1] == mode)
            buffers = sum(b.numel() * b.element_size() for b in (lay.x, lay.gx, lay.lh, lay.rh, lay.gl, lay.gr))
            shard = x.numel() * x.element_size()
            ratio = t["staged"] / t["host"]
            if dist.get_rank() == 0:
                print(f"  {str(tuple(x.shape)):<20} {mode:<10} {t['host']:>9.1f} {t['staged']:>9.1f} {ratio:>10.2f}x"
                      f" {buffers:>11} {shard:>11} {wrong:>6}")
            rows.append({"shape": tuple(x.shape), "padding": mode, "us": t, "staged_vs_host": ratio,
                         "buffer_bytes": buffers, "shard_bytes": shard, "wrong": wrong})
    if dist.get_rank() == 0:
        print(f"# {'all staged results bit-identical to the host path' if not wrong_total else f'{wrong_total} wrong values'}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"iters": args.iters, "rounds": args.rounds, "rows": rows, "wrong": wrong_total}, f, indent=1)
    dist.destroy_process_group()
    return 1 if wrong_total else 0


if __name__ == "__main__":
    sys.exit(main())
