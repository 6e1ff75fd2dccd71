#!/usr/bin/env python3
"""diffusers' video VAEs made context-parallel by halocp.diffusers.parallelize_vae,
against the unpatched VAE in one process at equal total cores.

    python3 bench/torch_diffusers.py --model ltx              # 2 ranks x 1 thread vs 1 process x 2 threads
    python3 bench/torch_diffusers.py --model cogvideox --world 2 --latent-frames 8 --size 32

The model is built from a small random configuration (no download), float32;
the clip has 1 + r*k frames (r the VAE's temporal compression, k =
--latent-frames - 1), split by halocp.diffusers.split_clip. Two operations:

  train   encode + decode of the clip, forward and backward (the input's and
          every parameter's gradient): a VAE training step
  decode  decode of the latents under torch.no_grad: serving a long clip

Two variants, with the same weights:

  one-process  the unpatched VAE on the whole clip, on rank 0 with --world
               threads (the other ranks wait): equal total cores
  halocp       the converted VAE on --world ranks of --threads threads each,
               each rank its shard

  halocp-old   (--old NAME...) the converted VAE with halocp's speed fixes
               NAME undone (OLD lists them): the path before a fix, timed
               against the one after in the same run

--profile prints torch.profiler's table of one step by op and input shape
instead: one process on the whole clip at --world and at --threads threads,
one process on rank 0's shard alone (the same work less the halos, on the
unpatched model), and each halocp rank.

Steps run back to back, in rounds alternating the variants; the time is the
median step of the slowest rank. The halocp row breaks its step down on the
slowest rank: time inside libhalo's exchange calls (start, wait, run: a rank
waiting for its neighbours' halos counts here), inside GroupNorm's statistics
collective, inside the layers' shard-table agreement, and the rest (local
compute). Memory per rank in one separate train step: the bytes autograd saved
for the backward and the largest tensor any op allocated. The ranks' decoded
frames are checked against one process's (exit status 1 past 1e-4 of the
largest magnitude).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from collections import defaultdict

import ranks  # bench/ranks.py, beside this script


def ltx(torch):
    from diffusers import AutoencoderKLLTXVideo

    return AutoencoderKLLTXVideo(in_channels=3, out_channels=3, latent_channels=8, patch_size=1,
                                 block_out_channels=(16, 32, 32, 32), decoder_block_out_channels=(16, 32, 32, 32),
                                 layers_per_block=(1, 1, 1, 1, 1), decoder_layers_per_block=(1, 1, 1, 1, 1),
                                 spatio_temporal_scaling=(True, True, True, False),
                                 decoder_spatio_temporal_scaling=(True, True, True, False))


def cogvideox(torch):
    from diffusers import AutoencoderKLCogVideoX

    return AutoencoderKLCogVideoX(block_out_channels=(16, 32, 32, 32), latent_channels=8, layers_per_block=1,
                                  norm_num_groups=8, temporal_compression_ratio=4)


def mochi(torch):
    from diffusers import AutoencoderKLMochi

    return AutoencoderKLMochi(encoder_block_out_channels=(32, 32, 32, 32), decoder_block_out_channels=(32, 32, 32, 32),
                              latent_channels=8, layers_per_block=(1, 1, 1, 1, 1))


def hunyuan_video(torch):
    from diffusers import AutoencoderKLHunyuanVideo

    return AutoencoderKLHunyuanVideo(latent_channels=8, block_out_channels=(16, 32, 32, 32), layers_per_block=1,
                                     norm_num_groups=8)


def wan(torch):
    from diffusers import AutoencoderKLWan

    return AutoencoderKLWan(base_dim=16, z_dim=8, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                            temperal_downsample=[False, True, True])


def ltx2(torch):
    from diffusers import AutoencoderKLLTX2Video

    # (Its up blocks want their channels to change: equal ones fail in
    # diffusers 0.42.1's timestep conditioning, unpatched.)
    return AutoencoderKLLTX2Video(in_channels=3, out_channels=3, latent_channels=8, patch_size=1,
                                  block_out_channels=(16, 32, 32), down_block_types=("LTX2VideoDownBlock3D",) * 3,
                                  layers_per_block=(1, 1, 1, 1), spatio_temporal_scaling=(True, True, True),
                                  downsample_type=("spatiotemporal", "temporal", "conv"),
                                  decoder_block_out_channels=(16, 32, 64), decoder_layers_per_block=(1, 1, 1, 1),
                                  decoder_spatio_temporal_scaling=(True, True, True),
                                  decoder_inject_noise=(False,) * 4,
                                  upsample_type=("spatiotemporal", "temporal", "spatiotemporal"),
                                  upsample_residual=(True,) * 3, upsample_factor=(2, 2, 2),
                                  timestep_conditioning=True, temporal_compression_ratio=8,
                                  spatial_compression_ratio=4)


def allegro(torch):
    from diffusers import AutoencoderKLAllegro

    # eval(): its temporal layers hold dropout of 0.1 whatever the config
    return AutoencoderKLAllegro(block_out_channels=(16, 32, 32), down_block_types=("AllegroDownBlock3D",) * 3,
                                up_block_types=("AllegroUpBlock3D",) * 3, temporal_downsample_blocks=(True, True, False),
                                temporal_upsample_blocks=(False, True, True), latent_channels=8, layers_per_block=1,
                                norm_num_groups=8, temporal_compression_ratio=4).eval()


def _whole_clip(vae):
    """The reference computes the whole clip in one call, as the sharded
    model does: no frame batches (CogVideoX), no temporal tiles (HunyuanVideo),
    one tile the size of the clip (Allegro computes in tiles only)."""
    for name in ("num_sample_frames_batch_size", "num_latent_frames_batch_size"):
        if hasattr(vae, name):
            setattr(vae, name, 1 << 30)
    for name in ("use_framewise_encoding", "use_framewise_decoding"):
        if hasattr(vae, name) and type(vae).__name__ == "AutoencoderKLHunyuanVideo":
            setattr(vae, name, False)
    if type(vae).__name__ == "AutoencoderKLAllegro":
        vae.enable_tiling()
        encode, decode = vae.tiled_encode, vae.tiled_decode
        r, s = vae.config.temporal_compression_ratio, vae.spatial_compression_ratio

        def tiled_encode(x):
            vae.kernel = vae.stride = tuple(x.shape[2:])
            return encode(x)

        def tiled_decode(z):
            vae.kernel = vae.stride = (z.shape[2] * r, z.shape[3] * s, z.shape[4] * s)
            return decode(z)

        vae.tiled_encode, vae.tiled_decode = tiled_encode, tiled_decode


MODELS = {"ltx": ltx, "cogvideox": cogvideox, "mochi": mochi, "hunyuan_video": hunyuan_video, "wan": wan,
          "ltx2": ltx2, "allegro": allegro}
# What some models' decode takes besides the latents (LTX-2's decoder is
# timestep-conditioned), and where a decoded clip keeps its frames
# (Allegro's decode gives (batch, frames, channels, h, w)).
DECODE_ARGS = {"ltx2": lambda torch, z: (torch.full((z.shape[0],), 0.05, dtype=z.dtype),)}
FRAMES_DIM = {"allegro": 1}


class Phases:
    """Wall time spent inside halocp's communicating calls, by kind, while
    enabled: libhalo's exchange calls, GroupNorm's statistics gather, the
    layers' shard tables (an exchange of one row per rank: counted here, not
    as an exchange; each call is counted once, under its outermost kind)."""

    def __init__(self):
        import halocp._lib as lib
        import halocp._splits as splits
        import halocp.norm as norm

        self.spent, self.on, self.inside = defaultdict(float), False, False
        for name in ("exchange", "exchange_start", "wait", "test"):
            self._wrap(lib.Plan, name, "exchanges")
        self._wrap(norm, "_gather", "norm collectives")
        self._wrap(splits.ShardTable, "rows", "shard tables", static=True)

    def _wrap(self, owner, name, kind, static=False):
        fn = getattr(owner, name)

        def timed(*args, **kwargs):
            if not self.on or self.inside:
                return fn(*args, **kwargs)
            self.inside, t0 = True, time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spent[kind] += time.perf_counter() - t0
                self.inside = False

        setattr(owner, name, staticmethod(timed) if static else timed)


# --old: halocp's speed fixes, each undone by a patch of the module that
# holds it, to time the path before it against the one after in one run.
OLD = {
    # halocp.nn._conv: a batch-of-one conv3d that torch would give slow_conv3d, as a batch of two halves
    "split": ("halocp.nn", "_takes_slow_conv3d", lambda *args: False),
    # halocp.nn._split_once: a stride-1 conv's shard table at its first call only (the agreement)
    "tables": ("halocp.nn", "_split_once", lambda layer, name, dim, group, row: _every_call_split(name, dim, group, row)),
}


def _every_call_split(*args):
    import halocp._splits

    return halocp._splits.split(*args)


class undone:
    """The fixes named, undone while inside (see OLD)."""

    def __init__(self, names):
        import importlib

        self.patches = [(importlib.import_module(OLD[n][0]), OLD[n][1], OLD[n][2]) for n in names]

    def __enter__(self):
        self.saved = [getattr(m, a) for m, a, _ in self.patches]
        for m, a, v in self.patches:
            setattr(m, a, v)

    def __exit__(self, *exc):
        for (m, a, _), v in zip(self.patches, self.saved):
            setattr(m, a, v)


def run_rank(args) -> int:
    import torch
    import torch.distributed as dist
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_map

    import halocp.diffusers as hd
    from torch_vae import measure_memory

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    phases = Phases()
    build, whole_clip = MODELS[args.model], _whole_clip
    torch.manual_seed(0)  # the same weights and clip on every rank
    whole = build(torch).float()
    sharded = hd.parallelize_vae(copy.deepcopy(whole))
    whole_clip(whole)
    r, first = hd.temporal_compression(sharded), hd.first_frame(sharded)
    split = hd.split_clip(first + r * (args.latent_frames - first), world, r, first_frame=first)
    clip = torch.randn(1, 3, split.num_frames, args.size, args.size)
    x_local = hd.shard_clip(clip, split).contiguous()
    extra = DECODE_ARGS.get(args.model, lambda torch, z: ())
    frames_dim = FRAMES_DIM.get(args.model, 2)

    def decode(model, latents):
        with torch.no_grad():
            return model.decode(latents, *extra(torch, latents)).sample

    with torch.no_grad():
        z = whole.encode(clip).latent_dist.mode()
    z_local = hd.shard_clip(z, split, latent=True).contiguous()
    gy = torch.randn_like(decode(whole, z))
    gz = torch.randn_like(z)
    g_local = (hd.shard_clip(gz, split, latent=True).contiguous(), hd.shard_clip(gy, split, dim=frames_dim).contiguous())

    def train(model, x, grads):
        model.zero_grad(set_to_none=True)
        x = x.detach().requires_grad_()
        zz = model.encode(x).latent_dist.mode()
        yy = model.decode(zz, *extra(torch, zz)).sample
        torch.autograd.backward((zz, yy), grads)
        return yy.detach()

    def variant(name, op, threads=None):
        one = name == "one-process"
        if one and rank:
            return None
        torch.set_num_threads(threads or (world * args.threads if one else args.threads))
        if name == "halocp-old":
            with undone(args.old):
                return train(sharded, x_local, g_local) if op == "train" else decode(sharded, z_local)
        if op == "train":
            return train(whole, clip, (gz, gy)) if one else train(sharded, x_local, g_local)
        return decode(whole, z) if one else decode(sharded, z_local)

    if args.profile:
        shard = lambda: train(whole, x_local, g_local) if args.profile_op == "train" else decode(whole, z_local)
        return profile(args, torch, variant, shard, rank, world)

    # Correctness first: the ranks' decoded frames against one process's.
    want = [variant("one-process", "decode") if rank == 0 else None]
    dist.broadcast_object_list(want, 0)
    got = variant("halocp", "decode")
    ref = hd.shard_clip(want[0], split, dim=frames_dim)
    diff = float((got - ref).abs().max() / ref.abs().max()) if ref.numel() else 0.0

    memory = {}
    for name in ("one-process", "halocp"):
        if name == "halocp" or rank == 0:
            variant(name, "train")
            memory[name] = measure_memory(torch, TorchDispatchMode, tree_map, lambda: variant(name, "train"))
        dist.barrier()

    names = ("one-process", "halocp") + (("halocp-old",) if args.old else ())
    times = {(op, name): [] for op in args.ops for name in names}
    spent = {(op, name): defaultdict(list) for op in args.ops for name in names[1:]}
    for _ in range(args.rounds):
        for op, name in times:
            dist.barrier()
            for _ in range(args.iters):
                phases.spent.clear()
                phases.on = name != "one-process"
                t0 = time.perf_counter()
                variant(name, op)
                times[op, name].append(time.perf_counter() - t0)
                phases.on = False
                if name != "one-process":
                    for kind in ("exchanges", "norm collectives", "shard tables"):
                        spent[op, name][kind].append(phases.spent[kind])
            dist.barrier()

    mine = dict(times={f"{op} {name}": statistics.median(v) for (op, name), v in times.items()},
                spent={f"{op} {name}": {k: statistics.median(v) for k, v in d.items()}
                       for (op, name), d in spent.items()},
                memory=memory, diff=diff, frames=split.lengths[rank])
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    ok = all(e["diff"] < 1e-4 for e in everyone)
    if rank == 0:
        report(everyone, args, split, ok)
    dist.destroy_process_group()
    return 0 if ok else 1


def profile(args, torch, variant, rank0_shard, rank, world):
    """--profile: torch.profiler's table of one step by op and input shapes,
    for one process on the whole clip (--world * --threads threads, then
    --threads), one process on rank 0's shard alone (--threads: the same
    work as rank 0 less the halos, on the unpatched model), and every
    rank of halocp. The tables go to stdout, one after the other."""
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile as torch_profile

    op, rows = args.profile_op, args.profile_rows
    runs = [(f"one-process, {world * args.threads} threads, whole clip", lambda: variant("one-process", op)),
            (f"one-process, {args.threads} thread(s), whole clip",
             lambda: variant("one-process", op, threads=args.threads)),
            (f"one-process, {args.threads} thread(s), rank 0's shard", rank0_shard)]
    tables = []
    for name, fn in runs:
        if rank == 0:
            torch.set_num_threads(args.threads)  # (rank0_shard's; the variants set their own)
            fn()  # warm
            tables.append((name, _profiled(torch, torch_profile, ProfilerActivity, fn, rows)))
        dist.barrier()
    variant("halocp", op)
    dist.barrier()
    mine = _profiled(torch, torch_profile, ProfilerActivity, lambda: variant("halocp", op), rows)
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        for name, table in tables + [(f"halocp rank {r}, {args.threads} thread(s)", t) for r, t in enumerate(everyone)]:
            print(f"## {args.model} {op}: {name}")
            print(table)
    dist.destroy_process_group()
    return 0


def _profiled(torch, torch_profile, activity, fn, rows):
    import time as _time

    with torch_profile(activities=[activity.CPU], record_shapes=True) as prof:
        t0 = _time.perf_counter()
        fn()
        wall = _time.perf_counter() - t0
    table = prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=rows,
                                                              max_name_column_width=40, max_shapes_column_width=80)
    return f"step {wall * 1e3:.1f} ms under the profiler\n{table}"


def report(everyone, args, split, ok):
    mib = lambda b: b / (1 << 20)
    world = len(everyone)
    print(f"# {args.model} VAE (small random config, float32), clip (1, 3, {split.num_frames}, {args.size}, "
          f"{args.size}); halocp: {world} ranks x {args.threads} thread(s), frames {list(split.lengths)}; "
          f"one-process: {world * args.threads} threads")
    print(f"# median of {args.rounds} x {args.iters} steps, slowest rank; memory: one train step, the largest rank")
    print("| op | one-process ms | halocp ms | halocp / one-process | exchanges ms | norm collectives ms "
          "| shard tables ms | local compute ms |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for op in args.ops:
        one = everyone[0]["times"][f"{op} one-process"] * 1e3
        for name in ("halocp", "halocp-old") if args.old else ("halocp",):
            slow = max(range(world), key=lambda i: everyone[i]["times"][f"{op} {name}"])
            cp = everyone[slow]["times"][f"{op} {name}"] * 1e3
            s = {k: v * 1e3 for k, v in everyone[slow]["spent"][f"{op} {name}"].items()}
            rest = cp - sum(s.values())
            label = op if name == "halocp" else f"{op}, {'+'.join(args.old)} undone"
            print(f"| {label} | {one:.1f} | {cp:.1f} | {cp / one:.3f}x | {s['exchanges']:.1f} "
                  f"| {s['norm collectives']:.1f} | {s['shard tables']:.1f} | {rest:.1f} |")
        if args.old:
            new, old = (max(e["times"][f"{op} {n}"] for e in everyone) for n in ("halocp", "halocp-old"))
            print(f"# {op}: halocp / halocp with {'+'.join(args.old)} undone: {new / old:.3f}x")
    one = everyone[0]["memory"]["one-process"]
    cp = max((e["memory"]["halocp"] for e in everyone), key=lambda m: m["saved"])
    print(f"# autograd saved per rank: halocp {mib(cp['saved']):.1f} MiB (largest rank), one process "
          f"{mib(one['saved']):.1f} MiB: {cp['saved'] / one['saved']:.3f}x (1/W = {1 / world:.3f}); largest tensor "
          f"{mib(cp['largest']):.2f} vs {mib(one['largest']):.2f} MiB")
    print(f"# decoded frames vs one process: max rel. error {max(e['diff'] for e in everyone):.1e}; "
          f"correctness {'ok' if ok else 'FAILED'}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="ltx", choices=sorted(MODELS))
    ap.add_argument("--world", type=int, default=2, help="ranks to launch (default 2)")
    ap.add_argument("--latent-frames", type=int, default=9, help="latent frames of the clip (default 9)")
    ap.add_argument("--size", type=int, default=32, help="height and width (default 32)")
    ap.add_argument("--ops", nargs="+", default=["train", "decode"], choices=("train", "decode"))
    ap.add_argument("--rounds", type=int, default=3, help="rounds alternating the variants (default 3)")
    ap.add_argument("--iters", type=int, default=2, help="steps per variant per round (default 2)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    ap.add_argument("--old", nargs="+", default=[], choices=sorted(OLD),
                    help="also time halocp with these fixes undone (halocp-old), alternating with the others")
    ap.add_argument("--profile", action="store_true",
                    help="print torch.profiler's table of one step per variant instead of timing (see profile)")
    ap.add_argument("--profile-op", default="train", choices=("train", "decode"))
    ap.add_argument("--profile-rows", type=int, default=25)
    ap.add_argument("--deadline", type=float, default=1800, help="seconds before the launcher stops the ranks")
    args = ap.parse_args()
    if "RANK" in __import__("os").environ:
        return run_rank(args)
    return ranks.launch(__file__, args.world, args.deadline)


if __name__ == "__main__":
    sys.exit(main())
