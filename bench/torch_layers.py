#!/usr/bin/env python3
"""One context-parallel CausalConv3d, forward + backward, three ways and two floors.

    python3 bench/torch_layers.py                 # (1, 16, 8, 32, 32) per rank, 16 -> 16 channels
    python3 bench/torch_layers.py --issue         # (1, 64, 16, 64, 64), 64 -> 64

A causal temporal convolution (kernel 3, spatial padding 1: the output has
the input's shape) over an activation whose T axis is sharded over --world
ranks, float32. Every rank runs, in the same processes and with the same
weights:

  halocp      halocp.nn.CausalConv3d: the halos-only exchange runs while the
              frames that need no halo are convolved; no padded copy
  halocp-solo the same layer on a group of its rank alone: zero halos, no
              peer, so its computation and libhalo's calls without the
              ranks waiting for each other
  halocp-pad  halocp.cp_halo_exchange + conv3d (the padded copy)
  torch-p2p   the same layer over torch.distributed: batch_isend_irecv of the
              boundary frames (gloo), torch.cat, conv3d
  floor       conv3d of the shard with zero temporal padding (padding=1 in
              conv3d, the same output frames): no exchange
  floor-pad   the same with the zeros padded on first (F.pad, then conv3d with
              no temporal padding): no exchange. Both floors are measured
              because torch's CPU conv3d (slow_conv3d, im2col) runs slower with
              padding than without, so either may be the faster

One step is a forward and a backward pass (input, weight and bias
gradients). Steps run back to back, in rounds that alternate the variants
(so that the load of a shared machine falls on all of them alike); the
time is the median step of the slowest rank. Memory, in one separate
step per variant: the peak RSS growth of the step (the convolution's own
workspace included), the allocations at least as large as the padded input
(seen by a TorchDispatchMode), and the bytes autograd saves for the backward
(saved_tensors_hooks, each storage once).

The ranks run with glibc's malloc told to keep freed memory
(mmap_threshold 32 MiB, no trimming): with its defaults, each step of some
variants maps its large convolution buffers afresh and page-faults them in
(thousands of faults per step), which then decides the ranking more than
the arithmetic does. --system-malloc keeps the defaults.

Without RANK in the environment the script launches --world ranks of itself
on this machine (gloo on 127.0.0.1) and rank 0 prints the table.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time

import ranks  # bench/ranks.py, beside this script

SMALL, ISSUE = (1, 16, 8, 32, 32), (1, 64, 16, 64, 64)
KEEP_FREED_MEMORY = "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=4294967296"
K = 3  # temporal kernel: the left halo is K - 1 frames


def run_rank(args) -> int:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_map

    import halocp

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    n, c, t, h, w = args.shape
    halo = K - 1

    torch.manual_seed(0)  # the same weights on every rank
    layer = halocp.nn.CausalConv3d(c, c, K, padding=1)
    weight, bias = layer.weight, layer.bias
    solos = [dist.new_group([r]) for r in range(world)]  # collective: every rank makes every group
    solo = halocp.nn.CausalConv3d(c, c, K, padding=1, group=solos[rank])
    solo.weight, solo.bias = weight, bias
    torch.manual_seed(1 + rank)
    x = torch.randn(n, c, t, h, w).requires_grad_()
    g = torch.randn(n, c, t, h, w)

    class TorchHalo(torch.autograd.Function):
        """[left halo | x] over torch.distributed P2P: the halo is the
        previous rank's last frames (zeros on rank 0); one hop, so shards of
        at least `halo` frames."""

        @staticmethod
        def forward(ctx, x):
            before = x.new_zeros(n, c, halo, h, w)
            ops = []
            if rank + 1 < world:
                ops.append(dist.P2POp(dist.isend, x[:, :, t - halo:].contiguous(), rank + 1))
            if rank > 0:
                ops.append(dist.P2POp(dist.irecv, before, rank - 1))
            for req in dist.batch_isend_irecv(ops) if ops else []:
                req.wait()
            return torch.cat([before, x], 2)

        @staticmethod
        def backward(ctx, grad):
            grad_x = grad[:, :, halo:].clone()
            mine = grad.new_zeros(n, c, halo, h, w)
            ops = []
            if rank > 0:
                ops.append(dist.P2POp(dist.isend, grad[:, :, :halo].contiguous(), rank - 1))
            if rank + 1 < world:
                ops.append(dist.P2POp(dist.irecv, mine, rank + 1))
            for req in dist.batch_isend_irecv(ops) if ops else []:
                req.wait()
            grad_x[:, :, t - halo:] += mine
            return grad_x

    def conv_valid(padded):
        return F.conv3d(padded, weight, bias, 1, (0, 1, 1))

    variants = {
        "halocp": layer,
        "halocp-solo": solo,
        "halocp-pad": lambda x: conv_valid(halocp.cp_halo_exchange(x, halo, 0, 2)),
        "torch-p2p": lambda x: conv_valid(TorchHalo.apply(x)),
        "floor": lambda x: F.conv3d(x, weight, bias, 1, (halo // 2, 1, 1)),
        "floor-pad": lambda x: conv_valid(F.pad(x, (0, 0, 0, 0, halo, 0))),
    }

    def step(fn):
        x.grad = weight.grad = bias.grad = None
        y = fn(x)
        y.backward(g)
        return y

    # Agreement: halocp against torch-p2p (different summation orders, so close, not equal).
    y0 = step(variants["torch-p2p"]).detach()
    ref = [x.grad.clone(), weight.grad.clone(), bias.grad.clone()]
    y1 = step(variants["halocp"]).detach()
    diff = max(float((a - b).abs().max() / a.abs().max()) for a, b in zip([y0] + ref, [y1, x.grad, weight.grad, bias.grad]))

    # Memory, one step each (after a warm-up step).
    padded_bytes = n * c * (t + halo) * h * w * 4
    memory = {}
    for name, fn in variants.items():
        step(fn)
        memory[name] = measure_memory(torch, TorchDispatchMode, tree_map, lambda: step(fn), padded_bytes)
        dist.barrier()

    times = {name: [] for name in variants}
    faults = {name: [] for name in variants}
    for _ in range(args.warmup):
        for fn in variants.values():
            step(fn)
    for _ in range(args.rounds):
        for name, fn in variants.items():
            dist.barrier()
            for _ in range(args.iters):
                f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                t0 = time.perf_counter()
                step(fn)
                times[name].append(time.perf_counter() - t0)
                faults[name].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)

    mine = dict(times={k: statistics.median(v) for k, v in times.items()},
                faults={k: statistics.median(v) for k, v in faults.items()}, memory=memory, diff=diff)
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        report(everyone, args, padded_bytes)
    dist.destroy_process_group()
    return 0 if all(e["diff"] < 1e-4 for e in everyone) else 1


def measure_memory(torch, TorchDispatchMode, tree_map, run, padded_bytes) -> dict:
    """Peak RSS growth of run(), its allocations of at least padded_bytes,
    and the bytes autograd saved."""

    class Big(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.big = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            inputs = set()
            tree_map(lambda a: inputs.add(a.storage().data_ptr()) if isinstance(a, torch.Tensor) and a.numel() else None,
                     (args, kwargs))

            def note(o):
                if isinstance(o, torch.Tensor) and o.storage().data_ptr() not in inputs:
                    if o.numel() * o.element_size() >= padded_bytes:
                        self.big.append(f"{func.__name__}{tuple(o.shape)}")

            tree_map(note, out)
            return out

    saved = {}

    def pack(s):
        saved[s.storage().data_ptr()] = s.storage().nbytes()
        return s

    with Big() as mode, torch.autograd.graph.saved_tensors_hooks(pack, lambda s: s):
        run()
    big = mode.big

    return dict(peak=ranks.peak_rss_growth(run), big=big, saved=sum(saved.values()))


def report(everyone, args, padded_bytes):
    mib = lambda b: b / (1 << 20)
    world = len(everyone)
    names = list(everyone[0]["times"])
    ms = {k: max(e["times"][k] for e in everyone) * 1e3 for k in names}
    print(f"# CausalConv3d k={K}, {args.shape[1]}->{args.shape[1]} channels, (N, C, T, H, W) = {tuple(args.shape)} "
          f"float32 per rank, {world} ranks, {args.threads} thread(s) each, "
          f"{'default glibc malloc' if args.system_malloc else 'malloc keeping freed memory'}")
    print(f"# step = forward + backward; median of {args.rounds} x {args.iters} steps, slowest rank; "
          f"memory: one step, the larger of the ranks; padded input = {mib(padded_bytes):.2f} MiB")
    floor = min(ms["floor"], ms["floor-pad"])
    print("| variant | step ms | vs faster floor | page faults / step | peak RSS growth MiB "
          "| allocations >= padded input | autograd saved MiB |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for k in names:
        peak = max(e["memory"][k]["peak"] for e in everyone)
        saved = max(e["memory"][k]["saved"] for e in everyone)
        big = max((e["memory"][k]["big"] for e in everyone), key=len)
        flt = max(e["faults"][k] for e in everyone)
        print(f"| {k} | {ms[k]:.1f} | {ms[k] / floor:.3f}x | {flt:.0f} | {mib(peak):.1f} | {len(big)}"
              f"{' (' + ', '.join(big) + ')' if big else ''} | {mib(saved):.2f} |")
    diff = max(e["diff"] for e in everyone)
    print(f"# halocp vs torch-p2p: outputs and gradients differ by at most {diff:.1e} of their largest magnitude")
    big = sum(len(e["memory"]["halocp"]["big"]) for e in everyone)
    print(f"# halocp against the faster floor: {ms['halocp'] / floor - 1:+.1%}; "
          f"halocp's allocations of the padded input's size, all ranks: {big}")


def launch(args) -> int:
    env = {}
    if not args.system_malloc:
        env["GLIBC_TUNABLES"] = ":".join(filter(None, [os.environ.get("GLIBC_TUNABLES"), KEEP_FREED_MEMORY]))
    return ranks.launch(__file__, args.world, args.deadline, env)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2, help="ranks to launch (default 2)")
    ap.add_argument("--issue", action="store_true", help=f"the issue's shape {ISSUE} (5 rounds of 1 step)")
    ap.add_argument("--shape", type=lambda s: tuple(int(v) for v in s.split(",")),
                    help=f"N,C,T,H,W per rank (default {','.join(map(str, SMALL))})")
    ap.add_argument("--rounds", type=int, help="rounds alternating the variants (default 12; 5 with --issue)")
    ap.add_argument("--iters", type=int, help="steps per variant per round (default 2; 1 with --issue)")
    ap.add_argument("--warmup", type=int, help="warm-up steps per variant before timing, after the memory steps "
                    "(default 1; 0 with --issue)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1: ranks share the CPUs)")
    ap.add_argument("--system-malloc", action="store_true", help="leave glibc malloc's thresholds at their defaults")
    ap.add_argument("--deadline", type=float, default=3600, help="seconds before the launcher stops the ranks")
    args = ap.parse_args()
    args.shape = args.shape or (ISSUE if args.issue else SMALL)
    args.rounds = args.rounds or (5 if args.issue else 12)
    args.iters = args.iters or (1 if args.issue else 2)
    if args.warmup is None:
        args.warmup = 0 if args.issue else 1
    if len(args.shape) != 5 or args.shape[2] < K - 1:
        ap.error(f"--shape is N,C,T,H,W with T >= {K - 1} (the baseline's exchange is one hop)")
    if "RANK" in os.environ:
        return run_rank(args)
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())
