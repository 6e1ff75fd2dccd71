"""A diffusers video VAE context-parallel along time: a training step and the
decode of a long clip, each rank holding its frames.

    torchrun --nproc-per-node 2 examples/python/diffusers_vae.py
    torchrun --nproc-per-node 4 examples/python/diffusers_vae.py --model cogvideox --latent-frames 25

The VAE is built from a small random configuration (no download; pass
``--pretrained DIR`` for a diffusers checkpoint folder of the same class).
``--check`` also runs the unpatched VAE on the whole clip on every rank and
prints the largest difference from the sharded one (exit status 1 past 1e-4).
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.distributed as dist

import halocp.diffusers as hd


def build(name: str, pretrained: str | None):
    from diffusers import AutoencoderKLCogVideoX, AutoencoderKLLTXVideo

    cls = {"ltx": AutoencoderKLLTXVideo, "cogvideox": AutoencoderKLCogVideoX}[name]
    if pretrained:
        return cls.from_pretrained(pretrained)
    if name == "ltx":
        return cls(in_channels=3, out_channels=3, latent_channels=8, patch_size=1, block_out_channels=(16, 32, 32, 32),
                   decoder_block_out_channels=(16, 32, 32, 32), layers_per_block=(1, 1, 1, 1, 1),
                   decoder_layers_per_block=(1, 1, 1, 1, 1), spatio_temporal_scaling=(True, True, True, False),
                   decoder_spatio_temporal_scaling=(True, True, True, False))
    return cls(block_out_channels=(16, 32, 32, 32), latent_channels=8, layers_per_block=1, norm_num_groups=8)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="ltx", choices=("ltx", "cogvideox"))
    ap.add_argument("--pretrained", help="a diffusers checkpoint folder of the model's class")
    ap.add_argument("--latent-frames", type=int, default=9, help="the training clip's latent frames (default 9)")
    ap.add_argument("--long", type=int, default=33, help="the decoded clip's latent frames (default 33)")
    ap.add_argument("--size", type=int, default=32, help="frame height and width (default 32)")
    ap.add_argument("--check", action="store_true", help="compare with the unpatched VAE on the whole clip")
    args = ap.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same weights and clips on every rank
    vae = build(args.model, args.pretrained)
    whole = copy.deepcopy(vae) if args.check else None
    vae = hd.parallelize_vae(vae)  # the default group: every rank is one CP group
    r = hd.temporal_compression(vae)

    # Training: each rank encodes and decodes its frames; its loss is its
    # frames' part of the clip's mean squared error, so the clip's gradient
    # is the sum of the ranks' (all_reduce SUM over the CP group).
    split = hd.split_clip(1 + r * (args.latent_frames - 1), world, r)
    clip = torch.rand(1, 3, split.num_frames, args.size, args.size) * 2 - 1
    x = hd.shard_clip(clip, split)
    optimiser = torch.optim.AdamW(vae.parameters(), lr=1e-4)
    posterior = vae.encode(x).latent_dist
    y = vae.decode(posterior.mode()).sample
    loss = (y - x).square().sum() / clip.numel() + 1e-6 * posterior.kl().sum() / split.latent_lengths[0] / world
    loss.backward()
    for p in vae.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
    total = loss.detach().clone()
    dist.all_reduce(total)
    optimiser.step()
    print(f"rank {rank}: frames {split.shards[rank].offset}..{split.shards[rank].offset + split.lengths[rank] - 1} "
          f"of {split.num_frames}, train loss (clip) {total.item():.5f}", flush=True)

    # Serving: decode a long clip's latents, each rank its latent frames,
    # no graph kept; gather_clip puts the frames together where wanted.
    long = hd.split_clip(1 + r * (args.long - 1), world, r)
    z = torch.randn(1, vae.config.latent_channels, args.long, args.size // 8, args.size // 8)
    with torch.inference_mode():
        frames = vae.decode(hd.shard_clip(z, long, latent=True)).sample
    print(f"rank {rank}: decoded {frames.shape[2]} of the long clip's {long.num_frames} frames", flush=True)
    if args.check:
        whole.load_state_dict(vae.state_dict())  # the weights after the step: the names are the model's own
        if hasattr(whole, "num_latent_frames_batch_size"):  # CogVideoX: the whole clip in one call, as CP computes it
            whole.num_latent_frames_batch_size = whole.num_sample_frames_batch_size = 1 << 30
        with torch.inference_mode():
            want = whole.decode(z).sample
        got = hd.gather_clip(frames, long)
        err = (got - want).abs().max().item() / want.abs().max().item()
        print(f"rank {rank}: decode vs one process: max difference {err:.2e} of the largest value", flush=True)
        if err > 1e-4:
            raise SystemExit(f"rank {rank}: the sharded decode differs from one process's by {err:.2e}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
