#!/usr/bin/env python3
"""A small context-parallel job with halocp, to start under a launcher.

Every rank holds a shard, along T, of one (N, C, T, H, W) sequence; it
exchanges halos with halocp.cp_halo_exchange, runs the forward and the
backward pass, and checks both, bit for bit, against the answer computed
from the whole sequence gathered on every rank. The values are small
integers, so every sum is exact whatever its order.

    torchrun --nproc_per_node 2 -r 1 -t 1 examples/python/halo_job.py    # PyTorch 1.13 (Debian)
    torchrun --nproc-per-node 2 examples/python/halo_job.py              # PyTorch 2.x

It reads the launcher's RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT
(torch.distributed's env:// initialisation, gloo backend) and prints one
line per rank: "rank r of W: ok (...)". Exit status 1 if anything differs.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist

import halocp


def reference(shards: list[torch.Tensor], rank: int, left: int, right: int, grad_outs: list[torch.Tensor]):
    """This rank's output and input gradient, from every rank's shard (and
    every rank's output gradient): the exchange on the whole sequence."""
    full = torch.cat(shards, 2).requires_grad_()
    padded = torch.nn.functional.pad(full, (0, 0, 0, 0, left, right))
    start, outs = 0, []
    for x in shards:
        n = x.shape[2]
        outs.append(padded.narrow(2, start, left + n + right))
        start += n
    torch.autograd.backward(outs, grad_outs)
    start = sum(x.shape[2] for x in shards[:rank])
    return outs[rank].detach(), full.grad.narrow(2, start, shards[rank].shape[2])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--left", type=int, default=2, help="halo slices before each shard (default 2)")
    ap.add_argument("--right", type=int, default=1, help="halo slices after each shard (default 1)")
    ap.add_argument("--frames", type=int, default=3, help="frames per rank (default 3)")
    ap.add_argument("--steps", type=int, default=3, help="forward + backward steps (default 3)")
    args = ap.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ok = True
    for step in range(args.steps):
        gen = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randint(-8, 8, (1, 3, args.frames, 4, 5), generator=gen).float().requires_grad_()
        g = torch.randint(-8, 8, (1, 3, args.frames + args.left + args.right, 4, 5), generator=gen).float()

        y = halocp.cp_halo_exchange(x, args.left, args.right, 2)
        y.backward(g)

        shards, grads = [torch.empty_like(x) for _ in range(world)], [torch.empty_like(g) for _ in range(world)]
        dist.all_gather(shards, x.detach())
        dist.all_gather(grads, g)
        want_y, want_grad = reference(shards, rank, args.left, args.right, grads)
        if not torch.equal(y.detach(), want_y) or not torch.equal(x.grad, want_grad):
            print(f"rank {rank} of {world}: step {step}: output or gradient differs from the reference", flush=True)
            ok = False
    dist.barrier()
    if ok:
        print(f"rank {rank} of {world}: ok ({args.steps} steps; halocp {halocp.version()} from {halocp.library_path()})",
              flush=True)
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
