"""A diffusers VAE made context-parallel by halocp.diffusers.parallelize_vae,
trained with FSDP2 on a DP x CP device mesh (issue 32), gloo on CPU, against
the same VAE trained on one process: the loss of every step and every
parameter after.

    python tests/fsdp2_vae.py --cp 2 --dp 2    (starts torchrun with cp*dp ranks)

Each DP group trains on its own clip, each CP rank on its frames of it
(halocp.diffusers.split_clip, uneven); FSDP2 shards the encoder, the decoder
and the model over the DP ranks of a CP position and averages their
gradients; the CP ranks' gradients are summed by hand (each holds the
gradient of its frames' part of the loss). CogVideoX's VAE, so GroupNorm's
statistics gathers run on the CP group between FSDP2's all-gathers and
reduce-scatters on the DP group. float64, so that the sums' order does not
hide a wrong frame."""

import argparse
import copy
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fsdp2 import free_port_pair  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
STEPS = 2


def launch(cp: int, dp: int) -> int:
    import subprocess

    port = free_port_pair()
    env = dict(os.environ, PYTHONPATH=str(REPO / "python"), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(cp * dp), "--master-port",
           str(port), __file__, "--cp", str(cp), "--dp", str(dp)]
    return subprocess.run(cmd, env=env, timeout=280).returncode


def rank_main(cp: int, dp: int) -> None:
    import torch
    import torch.distributed as dist
    from diffusers import AutoencoderKLCogVideoX
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import halocp.diffusers as hd

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dp, cp), mesh_dim_names=("dp", "cp"))
    d, c = mesh["dp"].get_local_rank(), mesh["cp"].get_local_rank()
    cp_group = mesh["cp"].get_group()

    torch.manual_seed(0)
    ref = AutoencoderKLCogVideoX(block_out_channels=(4, 8, 8, 8), latent_channels=4, layers_per_block=1,
                                 norm_num_groups=2, temporal_compression_ratio=4).double()
    ref.num_sample_frames_batch_size = ref.num_latent_frames_batch_size = 1 << 30  # the whole clip, one call
    model = hd.parallelize_vae(copy.deepcopy(ref), group=cp_group)
    r = hd.temporal_compression(model)
    split = hd.split_clip(1 + r * 4, cp, r, groups=[1] + [3] + [0] * (cp - 2) if cp > 1 else [4])
    clips = torch.randn(STEPS, dp, 3, split.num_frames, 8, 8, dtype=torch.float64)
    n = clips[0].numel()

    def loss_of(vae, x):
        y = vae.decode(vae.encode(x).latent_dist.mode()).sample
        return (y - x).square().sum() / n

    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref_losses = []
    for s in range(STEPS):
        loss = loss_of(ref, clips[s])
        opt.zero_grad()
        loss.backward()
        opt.step()
        ref_losses.append(loss.item())

    fully_shard(model.encoder, mesh=mesh["dp"])
    fully_shard(model.decoder, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for s in range(STEPS):
        x = hd.shard_clip(clips[s, d:d + 1], split, cp_group).contiguous()
        local = loss_of(model, x) * dp  # FSDP2 averages over dp: the clip's loss is the sum over dp and cp
        opt.zero_grad()
        local.backward()
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad.to_local(), group=cp_group)
        opt.step()
        loss = local.detach() / dp
        dist.all_reduce(loss)
        if abs(loss.item() - ref_losses[s]) > 1e-9 * max(1.0, abs(ref_losses[s])):
            raise SystemExit(f"rank {rank} (dp {d}, cp {c}): step {s}: loss {loss.item()}, one process {ref_losses[s]}")
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        full = p.full_tensor()
        err = (full - q).abs().max().item()
        if err > 1e-9:
            raise SystemExit(f"rank {rank} (dp {d}, cp {c}): {name} differs from one process's by {err}")
    print(f"rank {rank} of {cp * dp} (dp {d}, cp {c}, frames {split.lengths[c]}): ok, {STEPS} steps, "
          f"losses {ref_losses}")
    dist.destroy_process_group()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--cp", type=int, default=2)
    ap.add_argument("--dp", type=int, default=2)
    args = ap.parse_args()
    if "LOCAL_RANK" in os.environ:
        rank_main(args.cp, args.dp)
    else:
        sys.exit(launch(args.cp, args.dp))
