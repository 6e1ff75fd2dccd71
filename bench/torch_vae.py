#!/usr/bin/env python3
"""A causal video VAE's encoder and decoder blocks (examples/python/vae_block.py),
forward + backward, three ways.

    python3 bench/torch_vae.py                  # 2 ranks, (1, 8, 8, 32, 32) per rank
    python3 bench/torch_vae.py --world 4 --frames 4

The clip is (1, C, world x frames, H, W) float32, its T split evenly over
--world ranks (the seed's approach needs shards of at least its halo and,
for the stride-2 encoder, of even length). Every variant has the same
weights:

  one-process  the blocks on the whole clip, torch's layers, on rank 0 alone
               (the other ranks wait): what the ranks replace
  halocp       the blocks with halocp.nn's layers: CausalConv3d,
               GroupNorm (statistics by one small collective),
               ConvTranspose3d (boundary frames summed by cp_halo_sum)
  seed         the blocks as the seed module lets one write them: its halo
               exchange (torch.distributed P2P, the boundary slabs packed,
               zero halos, torch.cat; reimplemented here with the seed's
               semantics) padding the input of every causal conv and of the
               transposed conv (which then crops its output), and GroupNorm
               on the gathered tensor (all_gather, then this rank's part), as
               CogVideoX does

One step is a forward and a backward pass of both blocks (input and every
parameter gradient). Steps run back to back, in rounds that alternate the
variants; the time is the median step of the slowest rank. Memory, per
rank, in one separate step per variant: the peak RSS growth of the step
(freed heap returned first, the high-water mark reset), the largest tensor
any op allocated, and the bytes autograd saved for the backward.

Correctness: the ranks' latents and decoded clips, and the input
gradient, are compared with the one-process blocks' (the exit status is 1
past 1e-4 of the largest magnitude).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import ranks  # bench/ranks.py, beside this script

KEEP_FREED_MEMORY = "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=4294967296"


def seed_layers(torch, dist, F, vae_block, group):
    """vae_block.Layers built on the seed's halo exchange."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)

    def exchange(x, left, right):
        """The seed's cp_halo_exchange along T, P2P mode: [left halo | x | right halo]."""
        return _Seed.apply(x, left, right)

    class _Seed(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, left, right):
            ctx.left, ctx.right = left, right
            n = x.shape[2]
            lh = torch.zeros_like(x.narrow(2, 0, left))
            rh = torch.zeros_like(x.narrow(2, 0, right))
            ops = []
            if left and rank > 0:
                ops.append(dist.P2POp(dist.irecv, lh, rank - 1, group))
            if left and rank < world - 1:
                ops.append(dist.P2POp(dist.isend, x.narrow(2, n - left, left).contiguous(), rank + 1, group))
            if right and rank < world - 1:
                ops.append(dist.P2POp(dist.irecv, rh, rank + 1, group))
            if right and rank > 0:
                ops.append(dist.P2POp(dist.isend, x.narrow(2, 0, right).contiguous(), rank - 1, group))
            for req in dist.batch_isend_irecv(ops) if ops else []:
                req.wait()
            return torch.cat([lh, x, rh], 2)

        @staticmethod
        def backward(ctx, grad):
            left, right = ctx.left, ctx.right
            n = grad.shape[2] - left - right
            from_right = grad.new_zeros(grad.narrow(2, 0, left).shape)
            from_left = grad.new_zeros(grad.narrow(2, 0, right).shape)
            ops = []
            if left and rank > 0:
                ops.append(dist.P2POp(dist.isend, grad.narrow(2, 0, left).contiguous(), rank - 1, group))
            if left and rank < world - 1:
                ops.append(dist.P2POp(dist.irecv, from_right, rank + 1, group))
            if right and rank < world - 1:
                ops.append(dist.P2POp(dist.isend, grad.narrow(2, left + n, right).contiguous(), rank + 1, group))
            if right and rank > 0:
                ops.append(dist.P2POp(dist.irecv, from_left, rank - 1, group))
            for req in dist.batch_isend_irecv(ops) if ops else []:
                req.wait()
            grad_x = grad.narrow(2, left, n).clone()
            if left:
                grad_x.narrow(2, n - left, left).add_(from_right)
            if right:
                grad_x.narrow(2, 0, right).add_(from_left)
            return grad_x, None, None

    class _Gather(torch.autograd.Function):
        """The whole tensor on every rank; backward: this rank's part of the gradient."""

        @staticmethod
        def forward(ctx, x):
            parts = [torch.empty_like(x) for _ in range(world)]
            dist.all_gather(parts, x.contiguous(), group)
            ctx.n = x.shape[2]
            return torch.cat(parts, 2)

        @staticmethod
        def backward(ctx, grad):
            # Every rank's output depends on every rank's input: sum first.
            grad = grad.contiguous()
            dist.all_reduce(grad, group=group)
            return grad.narrow(2, rank * ctx.n, ctx.n).contiguous()

    class CausalConv3d(vae_block._CausalConv3d):
        def forward(self, x):
            k, d = self.kernel_size[0], self.dilation[0]
            xp = exchange(x, d * (k - 1), 0)
            if rank == 0 and self.mode != "constant":  # the clip's own padding, not zeros
                xp = torch.cat([F.pad(x.narrow(2, 0, 1), (0, 0, 0, 0, d * (k - 1), 0), self.mode)
                                .narrow(2, 0, d * (k - 1)), xp.narrow(2, d * (k - 1), x.shape[2])], 2)
            pads = self.pads[:4] + (0, 0)
            return torch.nn.Conv3d.forward(self, F.pad(xp, pads, self.mode))

    class GroupNorm(torch.nn.GroupNorm):
        def forward(self, x):
            whole = super().forward(_Gather.apply(x))
            return whole.narrow(2, rank * x.shape[2], x.shape[2])

    class Upsample(torch.nn.ConvTranspose3d):
        """Input halos of the frames whose contributions reach this rank's
        output frames [2a, 2(a+n)), a transposed conv with no temporal
        padding, then the crop."""

        def forward(self, x):
            s, p, k = self.stride[0], self.padding[0], self.kernel_size[0]
            left, right = max((k - 1 - p) // s, 0), (s - 1 + p) // s
            z = torch.nn.functional.conv_transpose3d(exchange(x, left, right), self.weight, self.bias,
                                                     (s,) + self.stride[1:], (0,) + self.padding[1:], 0,
                                                     self.groups, self.dilation)
            return z.narrow(2, left * s + p, x.shape[2] * s)

    class Layers(vae_block.Layers):
        def causal_conv(self, cin, cout, kernel_size=3, stride=1, padding=1):
            return CausalConv3d(cin, cout, kernel_size, stride, padding, self.mode)

        def norm(self, channels, groups):
            return GroupNorm(groups, channels)

        def upsample(self, cin, cout):
            return Upsample(cin, cout, 4, stride=2, padding=1)

    return Layers


def run_rank(args) -> int:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_map

    sys.path.insert(0, str(ranks.REPO / "examples" / "python"))
    import vae_block

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    c, t, hw = args.channels, args.frames, args.size
    group = dist.group.WORLD

    torch.manual_seed(0)  # the same weights and clip on every rank
    whole = vae_block.VAEBlocks(c, 2 * c, args.padding_mode)
    halo = vae_block.VAEBlocks(c, 2 * c, args.padding_mode, group=group)
    halo.load_state_dict(whole.state_dict())
    seed = vae_block.VAEBlocks(c, 2 * c)
    layers = seed_layers(torch, dist, F, vae_block, group)(None, args.padding_mode)
    seed.encoder = vae_block.EncoderBlock(layers, c, 2 * c)
    seed.decoder = vae_block.DecoderBlock(layers, 2 * c, c)
    seed.load_state_dict(whole.state_dict())
    clip = torch.randn(1, c, world * t, hw, hw)
    grads = [torch.randn(1, 2 * c, world * t // 2, hw // 2, hw // 2), torch.randn(1, c, world * t, hw, hw)]

    def part(v, frames):
        return v.narrow(2, rank * frames, frames).contiguous()

    x_whole = clip.clone().requires_grad_()
    x = part(clip, t).requires_grad_()
    g = [part(grads[0], t // 2), part(grads[1], t)]
    variants = {"one-process": (whole, x_whole, grads), "halocp": (halo, x, g), "seed": (seed, x, g)}

    def step(name):
        model, inp, gs = variants[name]
        if name == "one-process" and rank:
            return None
        inp.grad = None
        model.zero_grad(set_to_none=True)
        outs = model(inp)
        torch.autograd.backward(outs, gs)
        return [o.detach() for o in outs] + [inp.grad]

    # Correctness first (the memory steps come after, one per variant).
    want = [None] * 3
    if rank == 0:
        want = step("one-process")
    dist.broadcast_object_list(want, 0)
    diff = {}
    for name in ("halocp", "seed"):
        got = step(name)
        parts = [part(want[0], t // 2), part(want[1], t), part(want[2], t)]
        diff[name] = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(got, parts))

    memory = {}
    for name in variants:
        step(name)
        memory[name] = measure_memory(torch, TorchDispatchMode, tree_map, lambda: step(name))
        dist.barrier()

    times = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name in variants:
            dist.barrier()
            for _ in range(args.iters):
                t0 = time.perf_counter()
                step(name)
                times[name].append(time.perf_counter() - t0)
            dist.barrier()

    mine = dict(times={k: statistics.median(v) for k, v in times.items()}, memory=memory, diff=diff)
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    ok = all(d < 1e-4 for e in everyone for d in e["diff"].values())
    if rank == 0:
        report(everyone, args, ok)
    dist.destroy_process_group()
    return 0 if ok else 1


def measure_memory(torch, TorchDispatchMode, tree_map, run) -> dict:
    """Peak RSS growth of run(), the largest tensor an op allocated, and the
    bytes autograd saved (each storage once)."""

    class Largest(TorchDispatchMode):
        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))

            def note(o):
                if isinstance(o, torch.Tensor):
                    self.largest = max(self.largest, o.numel() * o.element_size())

            tree_map(note, out)
            return out

    saved = {}

    def pack(s):
        saved[s.untyped_storage().data_ptr()] = s.untyped_storage().nbytes()
        return s

    with Largest() as mode, torch.autograd.graph.saved_tensors_hooks(pack, lambda s: s):
        run()
    return dict(peak=ranks.peak_rss_growth(run), largest=mode.largest, saved=sum(saved.values()))


def report(everyone, args, ok):
    mib = lambda b: b / (1 << 20)
    world = len(everyone)
    c, t, hw = args.channels, args.frames, args.size
    print(f"# causal VAE encoder block ({c} -> {2 * c} channels, /2 in T, H, W) + decoder block "
          f"({2 * c} -> {c}, x2), padding_mode {args.padding_mode}; clip (1, {c}, {world * t}, {hw}, {hw}) float32, "
          f"{world} ranks of {t} frames, {args.threads} thread(s) each")
    print(f"# step = forward + backward; median of {args.rounds} x {args.iters} steps, slowest rank "
          f"(one-process: rank 0 alone, the others waiting); memory: one step, the largest rank; MiB = 2^20 bytes")
    base = everyone[0]["times"]["one-process"]
    print("| variant | step ms | vs one-process | peak RSS growth MiB | largest tensor MiB | autograd saved MiB "
          "| max rel. error vs one-process |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for k in everyone[0]["times"]:
        ms = max(e["times"][k] for e in everyone) * 1e3
        mem = {m: max(e["memory"][k][m] for e in everyone) for m in ("peak", "largest", "saved")}
        err = "-" if k == "one-process" else f"{max(e['diff'][k] for e in everyone):.1e}"
        print(f"| {k} | {ms:.1f} | {ms / base / 1e3:.3f}x | {mib(mem['peak']):.1f} | {mib(mem['largest']):.2f} "
              f"| {mib(mem['saved']):.1f} | {err} |")
    ms = {k: max(e["times"][k] for e in everyone) * 1e3 for k in everyone[0]["times"]}
    print(f"# halocp vs seed: {ms['halocp'] / ms['seed']:.3f}x the time; correctness {'ok' if ok else 'FAILED'}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2, help="ranks to launch (default 2)")
    ap.add_argument("--frames", type=int, default=8, help="frames per rank, even (default 8)")
    ap.add_argument("--channels", type=int, default=8, help="clip channels; the latent has twice as many (default 8)")
    ap.add_argument("--size", type=int, default=32, help="height and width, even (default 32)")
    ap.add_argument("--padding-mode", default="replicate", choices=("replicate", "zeros"))
    ap.add_argument("--rounds", type=int, default=5, help="rounds alternating the variants (default 5)")
    ap.add_argument("--iters", type=int, default=2, help="steps per variant per round (default 2)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1: ranks share the CPUs)")
    ap.add_argument("--deadline", type=float, default=1800, help="seconds before the launcher stops the ranks")
    args = ap.parse_args()
    if args.frames < 4 or args.frames % 2 or args.size % 2:
        ap.error("--frames and --size are even, --frames at least 4 (the seed's halos are one hop: the latent's "
                 "frames / 2 a rank must hold the causal convs' 2-frame halo)")
    if "RANK" in os.environ:
        return run_rank(args)
    env = {"GLIBC_TUNABLES": ":".join(filter(None, [os.environ.get("GLIBC_TUNABLES"), KEEP_FREED_MEMORY]))}
    return ranks.launch(__file__, args.world, args.deadline, env)


if __name__ == "__main__":
    sys.exit(main())
